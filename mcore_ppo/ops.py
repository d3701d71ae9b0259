"""The head as torch ops: ``mcore_ppo::head_forward`` and ``mcore_ppo::head_backward``.

Every entry point reaches the kernels through these two operators (``torch.library``, with
schemas of tensors, ints, floats, bools and strings only), each with a fake (shape) kernel, so
``torch.compile`` keeps a head call in one graph and ``torch.library.opcheck`` can test them:

- ``head_forward`` runs one rank's forward (:func:`mcore_ppo.shard.forward`): under sequence
  parallelism the all-gather of the token rows, the statistics pass, the TP combine and the
  outputs. Besides the outputs it returns, when a backward follows, every tensor that backward
  reads (:class:`SavedLayout`), the backend's residual (the triton probability buffer) included.
- ``head_backward`` runs the backward (:func:`mcore_ppo.shard.backward`) from those tensors, the
  one TP reduction of ``d_hidden`` included. It overwrites the residual (the buffer becomes
  ``dz`` in place) and, in Megatron's ``main_grad`` mode, accumulates into ``main_grad``: both
  are declared mutated arguments.

The collectives run inside the ops, over the group named by ``tp_group``
(:func:`mcore_ppo.parallel.groups.group_key`), and the backend is named by its key
(:func:`mcore_ppo.backends.backend_key`): Python objects (options, backends, groups, plans) stay
outside the ops' signatures. Autograd is registered for ``head_forward``
(``torch.library.register_autograd``); the head itself applies :class:`HeadFunction`, an
autograd Function with the same two steps around the ops, which costs less host time per call
than the generic registration's wrapper. Either way the tensors the backward reads are saved
with ``save_for_backward``, so saved-tensor hooks (activation offloading) see them.

An eager call that nothing watches (no compile, no Python dispatch or function mode, no
profiler, plain tensors: :func:`_dispatcher_needed`) runs the ops' implementations directly,
without the dispatcher's trip through the registered autograd wrapper; everything that looks at
ops sees the ops.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from mcore_ppo import shard
from mcore_ppo.backends import backend_from_key
from mcore_ppo.backends.base import SavedTokens
from mcore_ppo.main_grad import dummy_weight_grad
from mcore_ppo.numerics import accumulation_dtype
from mcore_ppo.options import HiddenGrad, WeightGrad
from mcore_ppo.parallel.ranks import group_from_key, group_size
from mcore_ppo.statistics import Statistics

_LIB = torch.library.Library("mcore_ppo", "DEF")
_LIB.define(
    "head_forward(Tensor hidden, Tensor weight, Tensor labels, Tensor? temperature, float temperature_value, "
    "Tensor? given_statistics, int ignore_index, int vocab_start, int vocab_size, str backend, str tp_group, "
    "str hidden_grad, str statistics, bool labels_in_range, bool grad_needed) "
    "-> (Tensor log_prob, Tensor entropy, Tensor detached, Tensor[] saved)"
)
_LIB.define(
    "head_backward(Tensor? grad_log_prob, Tensor? grad_entropy, Tensor hidden, Tensor weight, Tensor lse, "
    "Tensor? saved_entropy, Tensor local_labels, Tensor valid, Tensor? local_ids, Tensor? slot_ok, "
    "Tensor(a!)[] residual, Tensor? temperature, float temperature_value, Tensor(b!)? main_grad, str backend, "
    "str tp_group, str hidden_grad, bool need_hidden, bool need_weight) -> (Tensor d_hidden, Tensor d_weight)"
)


class HeadCall(NamedTuple):
    """Everything a head call passes to ``head_forward`` besides its tensors (the op's other
    arguments), and where the weight gradient goes."""

    backend: str
    tp_group: str
    hidden_grad: HiddenGrad
    weight_grad: WeightGrad
    ignore_index: int
    vocab_start: int
    vocab_size: int
    temperature_value: float
    statistics: Statistics
    labels_in_range: bool


class SavedLayout(NamedTuple):
    """Which tensors ``head_forward``'s ``saved`` list holds, in this order: the gathered token
    rows (``gathered``: sequence parallelism over several ranks; else the backward reads the
    input's own rows), ``lse``, the entropy (``entropy``: asked for), the local labels and the
    valid flags, the ``k`` ids' local rows and slot flags (``ids``), then the backend's residual.
    Decided from the call alone, so the forward, its fake and the backward agree."""

    gathered: bool
    entropy: bool
    ids: bool

    @staticmethod
    def of(labels: torch.Tensor, statistics: Statistics, hidden_grad: HiddenGrad, tp_group: str):
        # The head passes SEQUENCE_PARALLEL only over several ranks (one rank gathers nothing);
        # the group is not looked up here, which a compiled region cannot trace.
        gathered = hidden_grad is HiddenGrad.SEQUENCE_PARALLEL and tp_group != ""
        return SavedLayout(gathered, statistics.entropy, labels.dim() == 2)

    def pack(self, token_hidden, saved: SavedTokens) -> list[torch.Tensor]:
        head = [token_hidden] if self.gathered else []
        entropy = [saved.entropy] if self.entropy else []
        ids = [saved.local_ids, saved.slot_ok] if self.ids else []
        return [*head, saved.lse, *entropy, saved.local_labels, saved.valid, *ids, *saved.residual]

    def unpack(self, saved: list[torch.Tensor]) -> tuple:
        """``(token_hidden or None, lse, entropy or None, local_labels, valid, local_ids or None,
        slot_ok or None, residual)``."""
        items = iter(saved)
        token_hidden = next(items) if self.gathered else None
        lse = next(items)
        entropy = next(items) if self.entropy else None
        local_labels, valid = next(items), next(items)
        local_ids, slot_ok = (next(items), next(items)) if self.ids else (None, None)
        return token_hidden, lse, entropy, local_labels, valid, local_ids, slot_ok, list(items)


def _temperature(tensor: torch.Tensor | None, value: float) -> float | torch.Tensor:
    return value if tensor is None else tensor


def _absent(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an output that was not asked for (an op returns tensors, never None)."""
    return like.new_empty(0)


@torch.library.impl(_LIB, "head_forward", "CompositeExplicitAutograd")
def _head_forward(
    hidden, weight, labels, temperature, temperature_value, given_statistics, ignore_index, vocab_start, vocab_size,
    backend, tp_group, hidden_grad, statistics, labels_in_range, grad_needed,
):  # fmt: skip
    call = _call_of(
        temperature_value, ignore_index, vocab_start, vocab_size, backend, tp_group, hidden_grad, statistics,
        labels_in_range,
    )  # fmt: skip
    log_prob, entropy, detached, saved = _forward(
        hidden, weight, labels, temperature, given_statistics, call, grad_needed
    )
    entropy = _absent(log_prob) if entropy is None else entropy
    return log_prob, entropy, _absent(log_prob) if detached is None else detached, saved


def _call_of(
    temperature_value, ignore_index, vocab_start, vocab_size, backend, tp_group, hidden_grad, statistics,
    labels_in_range,
) -> HeadCall:  # fmt: skip
    """The :class:`HeadCall` of ``head_forward``'s other arguments (what :func:`_forward_args` made of it)."""
    return HeadCall(
        backend, tp_group, HiddenGrad(hidden_grad), WeightGrad.GRAD, ignore_index, vocab_start, vocab_size,
        temperature_value, Statistics.from_key(statistics), labels_in_range,
    )  # fmt: skip


def _forward(hidden, weight, labels, temperature, given_statistics, call: HeadCall, grad_needed: bool):
    """``head_forward``'s implementation on the call's parsed arguments (the op's, or a direct
    eager call's: :func:`_run_forward`), None for an output not asked for (the op returns an
    empty tensor in its place)."""
    stats = call.statistics
    result, token_hidden = shard.forward(
        hidden, weight, labels, _temperature(temperature, call.temperature_value), given_statistics,
        backend=backend_from_key(call.backend), tp_group=group_from_key(call.tp_group), hidden_grad=call.hidden_grad,
        ignore_index=call.ignore_index, vocab_start=call.vocab_start, vocab_size=call.vocab_size, statistics=stats,
        labels_in_range=call.labels_in_range, grad_needed=grad_needed,
    )  # fmt: skip
    log_prob, entropy, detached = result.log_prob, result.entropy, result.detached
    if not grad_needed:
        return log_prob, entropy, detached, []
    saved = result.saved
    if given_statistics is not None:
        # The given statistics are an input: an output that aliases them would break the op's contract.
        saved = dataclasses.replace(saved, lse=saved.lse.clone())
    layout = SavedLayout.of(labels, stats, call.hidden_grad, call.tp_group)
    return log_prob, entropy, detached, layout.pack(token_hidden, saved)


@torch.library.register_fake("mcore_ppo::head_forward")
def _head_forward_fake(
    hidden, weight, labels, temperature, temperature_value, given_statistics, ignore_index, vocab_start, vocab_size,
    backend, tp_group, hidden_grad, statistics, labels_in_range, grad_needed,
):  # fmt: skip
    mode = HiddenGrad(hidden_grad)
    stats = Statistics.from_key(statistics)
    layout = SavedLayout.of(labels, stats, mode, tp_group)
    backend_obj = backend_from_key(backend)
    reason = backend_obj.unsupported(hidden)
    if reason is not None:  # a backend named in a compiled region is checked here, where it resolves
        raise ValueError(f"backend={backend_obj.name!r} cannot run these inputs: {reason}")
    n = hidden.shape[0] * (group_size(group_from_key(tp_group)) if layout.gathered else 1)
    out_dtype = accumulation_dtype(hidden.dtype)

    def per_token(present: bool = True, dtype=out_dtype, shape=(n,)) -> torch.Tensor:
        return hidden.new_empty(shape if present else (0,), dtype=dtype)

    detached = per_token(bool(stats.detached), shape=(len(stats.detached), n))
    outputs = (per_token(shape=(n, *labels.shape[1:])), per_token(stats.entropy), detached)
    if not grad_needed:
        return *outputs, []
    token_hidden = hidden.new_empty((n, hidden.shape[1])) if layout.gathered else hidden
    fused = not layout.ids and backend_obj.fused_forward_for(token_hidden, weight)
    spec = backend_obj.residual_spec(
        token_hidden, weight, fused=fused, grad_needed=True, statistics=stats, row_temperature=temperature is not None
    )
    if given_statistics is not None:
        spec = ()  # no statistics pass: nothing kept
    ids = (per_token(dtype=torch.int64, shape=labels.shape), per_token(dtype=torch.bool, shape=labels.shape))
    saved = [
        *([token_hidden] if layout.gathered else []), per_token(), *([per_token()] if layout.entropy else []),
        per_token(dtype=torch.int64), per_token(dtype=torch.bool), *(ids if layout.ids else ()),
        *(hidden.new_empty(shape, dtype=dtype) for shape, dtype in spec),
    ]  # fmt: skip
    return *outputs, saved


@torch.library.impl(_LIB, "head_backward", "CompositeExplicitAutograd")
def _head_backward(
    grad_log_prob, grad_entropy, hidden, weight, lse, saved_entropy, local_labels, valid, local_ids, slot_ok, residual,
    temperature, temperature_value, main_grad, backend, tp_group, hidden_grad, need_hidden, need_weight,
):  # fmt: skip
    backend_obj = backend_from_key(backend)
    # Whether the backend's fused forward made the saved tensors (its backward may key its
    # launches on that): decided from the inputs, as the forward decided it.
    fused = local_ids is None and backend_obj.fused_forward_for(hidden, weight)
    saved = SavedTokens(
        local_labels, valid, lse, saved_entropy, tuple(residual), local_ids, slot_ok, fused_forward=fused
    )
    weight_grad, unset = None, False
    if need_weight and main_grad is not None:
        weight_grad = main_grad
    elif need_weight:
        weight_grad, unset = shard.weight_grad_buffer(weight, backend_obj)
    d_hidden, d_weight = shard.backward(
        grad_log_prob, grad_entropy, hidden, weight, saved, _temperature(temperature, temperature_value),
        backend=backend_obj, tp_group=group_from_key(tp_group), hidden_grad=HiddenGrad(hidden_grad),
        need_hidden=need_hidden, weight_grad=weight_grad, weight_grad_unset=unset,
    )  # fmt: skip
    d_hidden = _absent(hidden) if d_hidden is None else d_hidden
    if d_weight is None or main_grad is not None:
        return d_hidden, _absent(weight)
    return d_hidden, d_weight if d_weight.dtype == weight.dtype else d_weight.to(weight.dtype)


@torch.library.register_fake("mcore_ppo::head_backward")
def _head_backward_fake(
    grad_log_prob, grad_entropy, hidden, weight, lse, saved_entropy, local_labels, valid, local_ids, slot_ok, residual,
    temperature, temperature_value, main_grad, backend, tp_group, hidden_grad, need_hidden, need_weight,
):  # fmt: skip
    # Called only with an upstream gradient for an output the forward computed (see _backward):
    # d_hidden comes back where it is wanted, d_weight where it is wanted and not in main_grad.
    tp = group_size(group_from_key(tp_group))
    rows = hidden.shape[0] // tp if HiddenGrad(hidden_grad) is HiddenGrad.SEQUENCE_PARALLEL else hidden.shape[0]
    d_hidden = hidden.new_empty((rows, hidden.shape[1]) if need_hidden else (0,))
    return d_hidden, weight.new_empty(weight.shape if need_weight and main_grad is None else (0,))


def head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor | None,
    given_statistics: torch.Tensor | None,
    call: HeadCall,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(log_prob, entropy or None, detached or None)`` of one rank, differentiable once to
    ``hidden`` and ``weight`` (``d_hidden`` reduced over TP as ``call.hidden_grad`` says);
    ``detached`` (``[len(call.statistics.detached), n]``, the detached statistics) has no
    gradient. ``hidden [n, h]`` are token rows (this rank's shard of them under sequence
    parallelism), ``labels`` global int64 ``[n]`` or ``[n, k]``, ``temperature`` a per-token
    ``[n]`` tensor or None (``call.temperature_value`` then)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        log_prob, entropy, detached = HeadFunction.apply(hidden, weight, labels, temperature, given_statistics, call)
    else:
        log_prob, entropy, detached, _ = _run_forward(
            hidden, weight, labels, temperature, given_statistics, call, False
        )
    statistics = call.statistics
    return log_prob, entropy if statistics.entropy else None, detached if statistics.detached else None


def _forward_args(hidden, weight, labels, temperature, given_statistics, call: HeadCall, *, grad_needed: bool):
    return (
        hidden, weight, labels, temperature, call.temperature_value, given_statistics, call.ignore_index,
        call.vocab_start, call.vocab_size, call.backend, call.tp_group, call.hidden_grad.value, call.statistics.key,
        call.labels_in_range, grad_needed,
    )  # fmt: skip


def _dispatcher_needed(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a head call must go through the op rather than its implementation directly.

    The op is the boundary for whoever looks at ops: ``torch.compile`` tracing it, a Python
    dispatch or function mode (fake tensors, ``make_fx``, selective activation checkpointing,
    op counters), a tensor subclass that dispatches on its own, the profiler naming its range.
    With none of them an eager call runs the same implementation without the dispatcher's trip
    (its registered autograd wrapper and redispatch: about a fifth of the head's host work
    above its backend). torch has no public query for an active mode; these ``torch._C`` reads
    are the ones its own Python dispatch code makes."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch.autograd._profiler_enabled()
        or type(hidden).__torch_dispatch__ is not _PLAIN_DISPATCH
        or type(weight).__torch_dispatch__ is not _PLAIN_DISPATCH
    )


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _run_forward(hidden, weight, labels, temperature, given_statistics, call: HeadCall, grad_needed: bool):
    """``head_forward`` of the call: through the op where :func:`_dispatcher_needed`, else its
    implementation (autograd is the caller's: :class:`HeadFunction`, or none: ``hidden`` and
    ``weight`` need no gradient and the temperature comes detached). An output not asked for is
    None or, from the op, empty."""
    if _dispatcher_needed(hidden, weight):
        args = _forward_args(hidden, weight, labels, temperature, given_statistics, call, grad_needed=grad_needed)
        return torch.ops.mcore_ppo.head_forward.default(*args)
    return _forward(hidden, weight, labels, temperature, given_statistics, call, grad_needed)


class HeadFunction(torch.autograd.Function):
    """``head_forward`` with its backward, ``head_backward`` (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, given_statistics, call: HeadCall):
        log_prob, entropy, detached, saved = _run_forward(
            hidden, weight, labels, temperature, given_statistics, call, True
        )
        _save(ctx, hidden, weight, labels, temperature, given_statistics, detached, saved, call)
        return log_prob, entropy, detached

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy, _grad_detached):
        d_hidden, d_weight = _backward(ctx, grad_log_prob, grad_entropy)
        return d_hidden, d_weight, None, None, None, None


def _save(ctx, hidden, weight, labels, temperature, given_statistics, detached, saved, call: HeadCall) -> None:
    """What the backward needs: the tensors through ``save_for_backward`` (saved-tensor hooks see
    them), the call and the saved list's layout on ``ctx``."""
    layout = SavedLayout.of(labels, call.statistics, call.hidden_grad, call.tp_group)
    ctx.set_materialize_grads(False)
    ctx.call, ctx.layout = call, layout
    # Megatron's main_grad lives on the parameter itself; a saved-tensor hook may hand back another object.
    ctx.weight = weight if call.weight_grad is WeightGrad.MAIN_GRAD else None
    # Under sequence parallelism the backward reads the gathered rows (in ``saved``) only.
    ctx.save_for_backward(None if layout.gathered else hidden, weight, temperature, *saved)
    if detached is not None:
        ctx.mark_non_differentiable(detached)
    # The residual is consumed by the first backward (the buffer becomes dz in place): a second
    # one (retain_graph) recomputes instead.
    ctx.residual_consumed = False
    ctx.copy_residual = False


def _backward(ctx, grad_log_prob, grad_entropy):
    shard.refuse_double_backward()
    call: HeadCall = ctx.call
    layout: SavedLayout = ctx.layout
    hidden, weight, temperature, *saved = ctx.saved_tensors
    token_hidden, lse, entropy, local_labels, valid, local_ids, slot_ok, residual = layout.unpack(saved)
    if entropy is None:
        grad_entropy = None
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_hidden or need_weight) or (grad_log_prob is None and grad_entropy is None):
        return None, None
    if ctx.residual_consumed:
        residual = []  # the first backward turned the buffer into dz: recompute
    elif ctx.copy_residual:
        residual = [r.clone() for r in residual]
    ctx.residual_consumed = True
    main_grad = getattr(ctx.weight, "main_grad", None) if ctx.weight is not None and need_weight else None
    token_hidden = hidden if token_hidden is None else token_hidden
    args = (
        grad_log_prob, grad_entropy, token_hidden, weight, lse, entropy, local_labels, valid, local_ids, slot_ok,
        residual, temperature, call.temperature_value, main_grad, call.backend, call.tp_group, call.hidden_grad.value,
        need_hidden, need_weight,
    )  # fmt: skip
    if _dispatcher_needed(token_hidden, weight):
        d_hidden, d_weight = torch.ops.mcore_ppo.head_backward.default(*args)
    else:
        d_hidden, d_weight = _head_backward(*args)
    if not need_weight:
        d_weight = None
    elif main_grad is not None:
        d_weight = dummy_weight_grad(ctx.weight)
    return d_hidden if need_hidden else None, d_weight


def _setup_context(ctx, inputs, output):
    """``register_autograd``'s half of :class:`HeadFunction` (a direct call of the op)."""
    hidden, weight, labels, temperature, temperature_value, given_statistics, *rest, _grad_needed = inputs
    call = _call_of(temperature_value, *rest)
    _, _, detached, saved = output
    _save(ctx, hidden, weight, labels, temperature, given_statistics, detached, saved, call)
    # A direct caller holds the saved list (an output of the op): the backward must not turn the
    # residual it holds into dz, so it works on a copy.
    ctx.copy_residual = True


def _op_backward(ctx, grad_log_prob, grad_entropy, *_):
    d_hidden, d_weight = _backward(ctx, grad_log_prob, grad_entropy)
    return d_hidden, d_weight, *(None,) * 13


torch.library.register_autograd("mcore_ppo::head_forward", _op_backward, setup_context=_setup_context)


__all__ = ["HeadCall", "HeadFunction", "SavedLayout", "head"]
