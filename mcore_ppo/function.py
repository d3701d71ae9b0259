"""The autograd Function of the head, shared by every per-shard backend.

Forward (one rank, its vocab shard ``[vocab_start, vocab_start + v)``):
  1. local statistics ``(m, s, u, y)`` from the backend, fp32, nothing ``[n, v]`` kept unless
     the backend returns a residual for its backward (the triton buffer);
  2. the cross-rank combine (:func:`parallel.combine_shard_statistics`): MAX, then one SUM;
  3. ``log_prob = y - lse`` and ``entropy = H``, zero for ignored tokens.
A backend with ``head_forward`` (:class:`~mcore_ppo.backends.base.FusedHeadBackend`: the
triton backend) runs the three steps itself, the label preparation and step 3 inside its
kernels, with the same results; the generic path (:func:`_generic_forward`) runs otherwise.
Saved for backward: the inputs and the fp32 per-token ``lse`` and ``entropy`` (saved tensors;
no entropy when it is off), the per-token temperature when there is one, and the backend's
residual (on ``ctx``, handed to the one backward that consumes it).

Backward: the backend returns this rank's *partial* ``d_hidden`` (fp32, cast once at the end)
and ``d_weight``. The partial ``d_hidden`` is summed over TP by the mapping that wraps
``hidden`` outside this Function (:mod:`parallel.mappings`), or by the caller (verl's
contract), so it is reduced exactly once, whatever the layout.

Both directions run with autocast off for the inputs' device (:func:`autocast_off`): inside a
``torch.autocast`` region the head computes exactly as outside it, in its inputs' dtype with
fp32 statistics (autocast would otherwise run the torch backend's logit GEMMs in bf16). On CPU
the backward runs on the thread that called ``backward()``, so a backward called inside an
autocast region would see it too. The backward is first-order only: with
``create_graph=True`` it raises (:data:`NO_DOUBLE_BACKWARD`) rather than return a graph whose
second derivatives would be wrong. :func:`outputs_head` gives a backend that computes whole
outputs with its own autograd (Liger) the same two guarantees.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_ppo.backends.base import Backend, GradientRequest, HeadForward, SavedTokens
from parallel.combine import combine_shard_statistics
from parallel.ranks import ProcessGroup, group_size

NO_DOUBLE_BACKWARD = (
    "mcore_ppo's fused PPO head is differentiable once: backward(create_graph=True) through it "
    "(double backward: Hessian-vector products, gradgradcheck, torch.autograd.functional.hessian) is not "
    "supported, since its backward is not itself differentiable; take higher-order derivatives on a "
    "logits path (log_softmax of the full logits) instead"
)


_NOTHING_TO_DISABLE = contextlib.nullcontext()


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device``'s type: a no-op where it is not on (or does not exist,
    e.g. meta), which is most calls, and costs no context of its own there."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NOTHING_TO_DISABLE


def _refuse_double_backward() -> None:
    # Autograd runs a backward with grad mode on exactly when create_graph=True.
    if torch.is_grad_enabled():
        raise NotImplementedError(NO_DOUBLE_BACKWARD)


@dataclass(frozen=True)
class ShardPlan:
    """Everything one call of the Function needs besides its tensors.

    Attributes:
        backend: the per-shard backend (stateless: one may serve every call).
        temperature: python float > 0 (a per-token tensor, given to :func:`shard_head`, overrides it).
        ignore_index: label value of skipped tokens.
        vocab_start: the first global vocab id of this rank's shard.
        vocab_size: the global vocab size (every rank's shard together).
        tp_group: the group the statistics are combined over (None: one rank).
        accumulate_into_main_grad: the weight gradient goes into ``weight.main_grad`` (fp32),
            Megatron's gradient-accumulation fusion.
        return_entropy: False: no entropy work anywhere; the second output is None.
        labels_checked: every label is known to be in ``[0, vocab_size)`` or ``ignore_index``
            (the caller validated them); False: a label outside gets a NaN log-prob here.
    """

    backend: Backend
    temperature: float
    ignore_index: int
    vocab_start: int
    vocab_size: int
    tp_group: ProcessGroup | None = None
    accumulate_into_main_grad: bool = False
    return_entropy: bool = True
    labels_checked: bool = False


def shard_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_prob [n], entropy [n] or None)``, fp32, for ``hidden [n, h]``, this rank's
    ``weight [v, h]`` and global int64 ``labels [n]``; differentiable once (this rank's partial
    ``d_hidden``). ``temperature``: per-token ``[n]`` (fp32, fp64 for fp64 inputs, contiguous,
    validated), used instead of ``plan.temperature``; it gets no gradient."""
    # Decided here, where grad mode is still visible: a backend keeps backward buffers only
    # when a backward can follow.
    grad_needed = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if temperature is not None:
        temperature = temperature.detach()
    if not grad_needed:
        # No graph to record: the forward alone, without the autograd Function's own host cost
        # (its outputs would carry no gradient either way).
        with autocast_off(hidden.device):
            log_prob, entropy, _ = _head_forward(hidden, weight, labels, plan, False, temperature)
        return log_prob, entropy
    return FusedPPOHeadFunction.apply(hidden, weight, labels, plan, grad_needed, temperature)


@functools.lru_cache(maxsize=64)
def _max_entropy(vocab_size: int, dtype: torch.dtype) -> float:
    """``log V`` rounded *down* to ``dtype``, as a python float exact in ``dtype``.

    Computed on the host (no device work, no sync) so ``entropy <= log V`` holds exactly
    whatever way the clamp converts its scalar.
    """
    log_v = math.log(vocab_size)
    bound = torch.tensor(log_v, dtype=dtype)
    if bound.item() > log_v:
        bound = torch.nextafter(bound, torch.tensor(-math.inf, dtype=dtype))
    return bound.item()


def weight_grad_buffer(
    weight: torch.Tensor, accumulate_into_main_grad: bool, backend: Backend, *, backend_writes_rows: bool = True
) -> tuple[torch.Tensor, bool]:
    """``(buffer, unset)``: where this shard's ``d_weight`` goes, and whether it was left unfilled.

    Megatron's ``main_grad`` when asked for and present. Else, for a backend that forms each row
    of ``d_W`` in one fp32-accumulated GEMM (``Backend.weight_grad_in_weight_dtype``) and here
    forms all of them (``backend_writes_rows``), a buffer in the weight's dtype (half the memory,
    no cast), left unfilled when the backend writes its rows (``Backend.writes_weight_grad``).
    Else fp32 (or wider) zeros.
    """
    main_grad = getattr(weight, "main_grad", None) if accumulate_into_main_grad else None
    if main_grad is not None:
        return main_grad, False
    if backend_writes_rows and getattr(backend, "weight_grad_in_weight_dtype", False):
        if getattr(backend, "writes_weight_grad", False):
            return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device), False
    fp32_or_wider = torch.promote_types(weight.dtype, torch.float32)
    return torch.zeros(weight.shape, dtype=fp32_or_wider, device=weight.device), False


def _combine(m, s, u, y, *, tp_group: ProcessGroup):
    return combine_shard_statistics(m, s, u, y, tp_group)


def _head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    grad_needed: bool,
    row_temperature: torch.Tensor | None,
) -> HeadForward:
    """The forward's outputs and what its backward needs: the backend's ``head_forward`` where
    it has one and takes the case, else :func:`_generic_forward`."""
    temperature = plan.temperature if row_temperature is None else row_temperature
    fused = getattr(plan.backend, "head_forward", None)
    if fused is not None:
        combine = None
        if plan.tp_group is not None and group_size(plan.tp_group) > 1:
            combine = functools.partial(_combine, tp_group=plan.tp_group)
        result = fused(
            hidden,
            weight,
            labels,
            temperature,
            ignore_index=plan.ignore_index,
            vocab_start=plan.vocab_start,
            vocab_size=plan.vocab_size,
            labels_checked=plan.labels_checked,
            grad_needed=grad_needed,
            with_entropy=plan.return_entropy,
            max_entropy=_max_entropy(plan.vocab_size, torch.float32),
            combine=combine,
        )
        if result is not None:
            return result
    return _generic_forward(hidden, weight, labels, plan, grad_needed, temperature)


def _generic_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    grad_needed: bool,
    temperature: float | torch.Tensor,
) -> HeadForward:
    """The forward over the :class:`Backend` protocol: labels prepared and outputs finished by
    torch ops around ``shard_statistics`` (any backend; what ``head_forward`` fuses)."""
    # Compared in int64: in a narrower dtype ignore_index would wrap (-100 is 156 in uint8).
    labels = labels.long()
    valid = labels != plan.ignore_index
    if plan.labels_checked and plan.vocab_start == 0 and weight.shape[0] == plan.vocab_size:
        # One shard holding the whole vocab and labels known to lie in it: every valid label
        # is its own local row (each small op costs tens of microseconds of host time).
        local_labels = torch.where(valid, labels, -1)
    else:
        local_labels = labels - plan.vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(in_shard, local_labels, -1)

    # Passed only when off: a backend object written before the option keeps working.
    entropy_off = {} if plan.return_entropy else {"with_entropy": False}
    stats = plan.backend.shard_statistics(
        hidden, weight, local_labels, valid, temperature, grad_needed=grad_needed, **entropy_off
    )
    m, s, u, y = stats.tensors()
    lse, entropy, label_logit = combine_shard_statistics(m, s, u if plan.return_entropy else None, y, plan.tp_group)

    # Rounding can push log p a hair above 0 or H a hair below 0; the math forbids both.
    log_prob = torch.where(valid, (label_logit - lse).clamp_(max=0.0), 0.0)
    if not plan.labels_checked:
        # A label outside [0, vocab_size) that was not caught by validation (validate=False)
        # poisons its log-prob instead of returning a plausible number.
        out_of_range = valid & ((labels < 0) | (labels >= plan.vocab_size))
        log_prob = log_prob.masked_fill(out_of_range, torch.nan)
    if entropy is None:
        entropy_out = None
    else:
        # Near-uniform logits: H rounds to within an ulp of log V, possibly above it.
        max_entropy = _max_entropy(plan.vocab_size, entropy.dtype)
        entropy_out = torch.where(valid, entropy.clamp(min=0.0, max=max_entropy), 0.0)
    return HeadForward(log_prob, entropy_out, SavedTokens(local_labels, valid, lse, entropy, stats.residual))


class FusedPPOHeadFunction(torch.autograd.Function):
    """``(hidden [n,h], weight [v,h], labels [n], plan, grad_needed, temperature [n] or None)
    → (log_prob [n], entropy [n] or None)``, fp32.

    ``labels`` are global vocab ids (or ``plan.ignore_index``); this rank owns rows
    ``[plan.vocab_start, plan.vocab_start + v)`` of the global vocab. Call it through
    :func:`shard_head`, which decides ``grad_needed``.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        plan: ShardPlan,
        grad_needed: bool,
        temperature: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.set_materialize_grads(False)
        ctx.device = hidden.device
        with autocast_off(hidden.device):
            return FusedPPOHeadFunction._forward(ctx, hidden, weight, labels, plan, grad_needed, temperature)

    @staticmethod
    def _forward(ctx, hidden, weight, labels, plan: ShardPlan, grad_needed: bool, row_temperature):
        log_prob, entropy_out, saved = _head_forward(hidden, weight, labels, plan, grad_needed, row_temperature)
        ctx.save_for_backward(
            hidden, weight, saved.local_labels, saved.valid, saved.lse, saved.entropy, row_temperature
        )
        ctx.plan = plan
        # Not a saved tensor: the one backward that uses it takes it (see backward).
        ctx.residual = saved.residual
        return log_prob, entropy_out

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        _refuse_double_backward()
        with autocast_off(ctx.device):
            return FusedPPOHeadFunction._backward(ctx, grad_log_prob, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, local_labels, valid, lse, entropy, row_temperature = ctx.saved_tensors
        plan: ShardPlan = ctx.plan
        # Taken, not read: the buffer is freed with this backward (a second one, with
        # retain_graph, recomputes), and the backend may overwrite it in place.
        residual, ctx.residual = ctx.residual, None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 4
        if (grad_log_prob is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, *nones

        main_grad = plan.accumulate_into_main_grad and hasattr(weight, "main_grad")
        weight_grad, unset = None, False
        if need_weight:
            weight_grad, unset = weight_grad_buffer(weight, plan.accumulate_into_main_grad, plan.backend)
        d_hidden, d_weight = plan.backend.shard_gradients(
            hidden,
            weight,
            SavedTokens(local_labels, valid, lse, entropy, residual),
            GradientRequest(
                grad_log_prob,
                grad_entropy if entropy is not None else None,
                need_hidden,
                weight_grad,
                weight_grad_unset=unset,
            ),
            temperature=plan.temperature if row_temperature is None else row_temperature,
        )
        if d_hidden is not None:
            d_hidden = d_hidden.to(hidden.dtype)
        if d_weight is not None:
            if main_grad:
                # Megatron's convention (ColumnParallelLinear with gradient accumulation
                # fusion): the gradient is already in main_grad; hand DDP's hook a dummy.
                weight.grad_added_to_main_grad = True
                d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            else:
                d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, *nones


def outputs_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    compute: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute(hidden, weight)`` (a backend with its own autograd, e.g. Liger's) with this
    Function's guarantees: autocast off in its forward and backward, and a clear error for a
    double backward. Under no_grad, or without inputs that need a gradient, it is called as it is."""
    with autocast_off(hidden.device):
        if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
            return compute(hidden, weight)
    return _OutputsFunction.apply(hidden, weight, compute)


class _OutputsFunction(torch.autograd.Function):
    """Runs ``compute``'s own autograd graph inside this node (the pattern of reentrant
    checkpointing), so that its backward can be run with autocast off and refused under
    ``create_graph``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, compute):
        ctx.set_materialize_grads(False)
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in (hidden, weight))
        with torch.enable_grad(), autocast_off(hidden.device):
            outputs = compute(*inputs)
        ctx.graph = (inputs, outputs)
        return tuple(None if out is None else out.detach() for out in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        _refuse_double_backward()
        (inputs, outputs), ctx.graph = ctx.graph, None
        wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
        pairs = [(out, g) for out, g in zip(outputs, grads, strict=True) if g is not None and out is not None]
        result: list[torch.Tensor | None] = [None, None, None]
        if not pairs or not wanted:
            return tuple(result)
        with autocast_off(inputs[0].device):
            got = torch.autograd.grad(
                [out for out, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs], allow_unused=True
            )
        for i, grad in zip(wanted, got, strict=True):
            result[i] = grad
        return tuple(result)
