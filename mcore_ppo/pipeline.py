"""The one path from every entry point to the head's kernels.

:func:`mcore_ppo.fused_log_probs_and_entropy`, the
:class:`~mcore_ppo.head.VocabParallelFusedPPOHead` module and verl's
:func:`~mcore_ppo.integrations.verl.kernel.linear_cross_entropy` each build a :class:`HeadOptions` and call
:func:`run_head`. It validates the tensors, resolves the backend, places the one TP reduction of
``d_hidden`` (or leaves it to the caller, as verl's contract does), and runs either the head's
autograd Function or a backend that computes whole outputs with its own autograd (Liger),
through :func:`mcore_ppo.function.outputs_head` (autocast off, no double backward).
A new framework adapter belongs beside those entry points and calls :func:`run_head` too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from mcore_ppo import validation
from mcore_ppo.backends import Backend, check_backend, resolve_backend
from mcore_ppo.function import ShardPlan, outputs_head, shard_head
from parallel.mappings import gather_sequence_parallel, reduce_grad_over_tp
from parallel.ranks import ProcessGroup, group_rank, group_size


@dataclass(frozen=True, kw_only=True)
class HeadOptions:
    """What the caller chooses about the head, validated once when the object is built.

    Attributes:
        temperature: the logits are divided by it; a Python number in ``[MIN_TEMPERATURE, inf)``
            (1e-4, :data:`mcore_ppo.validation.MIN_TEMPERATURE`), kept as float.
        ignore_index: label value of tokens whose log-prob and entropy are 0 and which get no
            gradient (prompt tokens, padding); an int that fits in int64.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"liger"`` (see
            :func:`mcore_ppo.backends.resolve_backend`), or a backend object built by the
            caller, used as it is: ``TritonBackend(buffer_budget_bytes=...)`` is how the
            triton backend's probability buffer is sized (docs/kernels.md).
        return_entropy: False: the entropy is not computed (the kernels skip its sums, the TP
            combine packs two values per token instead of three, the backward its term) and
            the head returns ``(log_probs, None)``. True (default): ``(log_probs, entropy)``.
        validate: True (default): the values of the inputs are checked on every device:
            labels in ``[0, V)`` or ``ignore_index``, a temperature tensor's values in
            ``[MIN_TEMPERATURE, inf)``; a bad one raises ValueError. On CUDA this costs one
            host synchronisation per call. False: nothing is read back (for CUDA graphs and
            host-bound loops); then a token with a bad label gets a NaN log-prob and one with a
            bad temperature NaN outputs, on CPU and CUDA alike, never a plausible number. The
            default is :data:`mcore_ppo.validation.VALIDATE_DEFAULT` (``MCORE_PPO_VALIDATE=0``
            at import turns it off; docs/design.md).

    A per-token temperature (a tensor shaped like the labels) is not an option but an input of
    the call: ``run_head(..., temperature=tensor)`` overrides ``temperature`` here.

    Raises:
        TypeError: a field of the wrong type (bool is not an int here; return_entropy and
            validate must be bools).
        ValueError: a temperature outside ``[MIN_TEMPERATURE, inf)``, an ``ignore_index``
            beyond int64, or an unknown backend name.
    """

    temperature: float = 1.0
    ignore_index: int = -100
    backend: str | Backend = "auto"
    return_entropy: bool = True
    validate: bool = validation.VALIDATE_DEFAULT

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", validation.check_temperature(self.temperature))
        if not isinstance(self.return_entropy, bool):
            raise TypeError(f"return_entropy must be a bool, got {validation.type_name(self.return_entropy)}")
        # None is the entry points' "not given": the documented default.
        object.__setattr__(self, "validate", validation.resolve_validate(self.validate))
        validation.check_ignore_index(self.ignore_index)
        check_backend(self.backend)


def call_options(
    temperature: float | torch.Tensor,
    *,
    ignore_index: int,
    backend: str | Backend,
    return_entropy: bool,
    validate: bool | None,
) -> tuple[HeadOptions, torch.Tensor | None]:
    """An entry point's arguments as :class:`HeadOptions` and the per-call temperature tensor.

    A number goes into the options; a tensor is returned for :func:`run_head`'s ``temperature``
    (the options then hold 1.0, unused). ``validate=None`` is the documented default."""
    row_temperature = temperature if isinstance(temperature, torch.Tensor) else None
    number = 1.0 if row_temperature is not None else temperature
    plain = (
        type(number) in (int, float)
        and type(ignore_index) is int
        and type(backend) is str
        and type(return_entropy) is bool
        and (validate is None or type(validate) is bool)
    )
    if plain:  # the common call: built and validated once per distinct set of values
        validate = validation.VALIDATE_DEFAULT if validate is None else validate
        return _options(number, ignore_index, backend, return_entropy, validate), row_temperature
    options = HeadOptions(
        temperature=number,
        ignore_index=ignore_index,
        backend=backend,
        return_entropy=return_entropy,
        validate=validate,
    )
    return options, row_temperature


@functools.lru_cache(maxsize=64, typed=True)
def _options(temperature: float, ignore_index: int, backend: str, return_entropy: bool, validate: bool) -> HeadOptions:
    # Frozen, so one object serves every call with these values; a bad value raises each time
    # (an exception is not cached).
    return HeadOptions(
        temperature=temperature,
        ignore_index=ignore_index,
        backend=backend,
        return_entropy=return_entropy,
        validate=validate,
    )


def run_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    options: HeadOptions,
    *,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool = False,
    reduce_hidden_grad: bool = True,
    flat_labels: bool = False,
    accumulate_into_main_grad: bool = False,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(log_probs, entropy)`` of ``softmax(hidden @ weight.T / T)`` over the TP-sharded vocab.

    Args:
        hidden, weight, labels: as for :func:`mcore_ppo.fused_log_probs_and_entropy`, or, with
            ``flat_labels``, as for verl's ``linear_cross_entropy``.
        options: the caller's :class:`HeadOptions`.
        tp_group: the TP group, already resolved (None: one rank).
        sequence_parallel: ``hidden`` is this rank's sequence shard; it is all-gathered here
            and ``d_hidden`` reduce-scattered back.
        reduce_hidden_grad: True: ``d_hidden`` is summed over TP here, exactly once (the SP
            reduce-scatter, else an all-reduce). False: every rank gets its own vocab shard's
            partial ``d_hidden`` and the caller reduces it (verl's contract).
        flat_labels: False: Megatron's pairing, hidden ``[s, b, h]`` with labels ``[b, s]`` (or
            ``[n, h]`` with ``[n]``), outputs shaped like labels. True: verl's, hidden
            ``[..., h]`` and labels of the same ``N`` tokens in their own memory order, outputs
            ``[N]``.
        accumulate_into_main_grad: write the weight gradient into ``weight.main_grad`` (fp32),
            as Megatron's gradient-accumulation fusion does.
        temperature: a per-token temperature that overrides ``options.temperature``: a
            floating-point tensor on the labels' device, shaped like ``labels`` or broadcastable
            to them (``[b, 1]``: one per sequence of ``[b, s]`` labels); with ``flat_labels``
            also any shape of ``N`` elements, in the labels' memory order. It covers the same
            tokens as ``labels`` (the whole gathered sequence under SP, this rank's CP part:
            split it like the labels, :func:`parallel.split_temperature_for_cp`). Token ``i``'s
            logits are divided by ``T_i``. It gets no gradient (a tensor that requires grad is
            detached). Its values must lie in ``[MIN_TEMPERATURE, inf)``: checked (ValueError)
            with ``options.validate`` (one host sync on CUDA, shared with the label check);
            without it a token with a bad temperature gets NaN outputs, on every device.

    Returns:
        fp32 ``(log_probs, entropy)``, identical on every TP rank; zero where labels equal
        ``options.ignore_index``. ``entropy`` is None when ``options.return_entropy`` is False.
    """
    validation.check_tensors(hidden, weight, labels)
    validation.check_process_group(tp_group)
    # int64 from here on: ignore_index and the vocab bounds are compared in it (no wrap-around).
    if labels.dtype != torch.int64:
        labels = labels.long()
    flags = {
        "sequence_parallel": sequence_parallel,
        "reduce_hidden_grad": reduce_hidden_grad,
        "flat_labels": flat_labels,
        "accumulate_into_main_grad": accumulate_into_main_grad,
    }
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {validation.type_name(flag)}")
    if sequence_parallel and not reduce_hidden_grad:
        raise ValueError("sequence_parallel needs reduce_hidden_grad: the SP gather's backward is the TP reduction")
    tp_size = group_size(tp_group)
    # Shapes may be wrong on one rank only: the shard-size collective carries that to every rank.
    layout_error = None
    try:
        if flat_labels:
            validation.check_flat_layout(hidden, weight, labels, tp_size)
        else:
            validation.check_layout(hidden, weight, labels, tp_size, sequence_parallel)
    except ValueError as err:
        layout_error = err
    validation.check_equal_shards(weight, tp_group, layout_error)
    vocab_size = weight.shape[0] * tp_size
    if temperature is not None and not isinstance(temperature, torch.Tensor):
        # A number here is the float option of this one call.
        options = dataclasses.replace(options, temperature=temperature)
        temperature = None
    row_temperature, bad_temperature = _row_temperature(
        temperature, labels, hidden.dtype, flat_labels, vocab_size, options
    )
    scale = options.temperature if row_temperature is None else row_temperature
    impl = resolve_backend(options.backend, hidden.device)

    if getattr(impl, "computes_outputs", False):
        # Its own autograd and TP handling (Liger): no Function and no TP mapping here.
        per_token = {} if row_temperature is None else {"per_token_temperature": True}
        reason = impl.unsupported(
            tp_size, sequence_parallel, hidden, reduce_hidden_grad=reduce_hidden_grad, **per_token
        )
        if reason is not None:
            raise ValueError(f"backend={impl.name!r} cannot run this case: {reason}")
        tokens_hidden, tokens_labels = _tokens(hidden, labels, flat_labels)
        outputs = outputs_head(
            tokens_hidden,
            weight,
            functools.partial(
                impl.log_probs_and_entropy,
                labels=tokens_labels,
                temperature=scale,
                ignore_index=options.ignore_index,
                tp_group=tp_group,
                return_entropy=options.return_entropy,
            ),
        )
        return _finish(outputs, labels, flat_labels, bad_temperature)

    if reduce_hidden_grad:
        # The one TP reduction of d_hidden lives in this mapping's backward.
        if sequence_parallel and tp_size > 1:
            hidden = gather_sequence_parallel(hidden, tp_group)
        else:
            hidden = reduce_grad_over_tp(hidden, tp_group)
    tokens_hidden, tokens_labels = _tokens(hidden, labels, flat_labels)
    plan = ShardPlan(
        backend=impl,
        temperature=options.temperature,
        ignore_index=options.ignore_index,
        vocab_start=group_rank(tp_group) * weight.shape[0],
        vocab_size=vocab_size,
        tp_group=tp_group,
        accumulate_into_main_grad=accumulate_into_main_grad,
        return_entropy=options.return_entropy,
        labels_checked=options.validate,
    )
    outputs = shard_head(tokens_hidden, weight, tokens_labels, plan, row_temperature)
    return _finish(outputs, labels, flat_labels, bad_temperature)


def _row_temperature(
    temperature: torch.Tensor | None,
    labels: torch.Tensor,
    dtype: torch.dtype,
    flat_labels: bool,
    vocab_size: int,
    options: HeadOptions,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(T [n], bad [n] or None)``: the per-token temperature in token order, contiguous, in the
    backends' accumulation dtype (fp32; fp64 for fp64 inputs), after the value checks.

    With ``options.validate`` the labels and the temperature values are checked together (one
    host sync on CUDA) and ``bad`` is None. Without it nothing is read back: bad temperatures
    are replaced by 1 and flagged in ``bad``, whose tokens get NaN outputs (:func:`_finish`)."""
    if temperature is None:
        if options.validate:
            validation.check_label_range(labels, vocab_size, options.ignore_index)
        return None, None
    expanded = validation.check_temperature_tensor(temperature, labels, flat_labels=flat_labels)
    values = _token_values(expanded, labels, flat_labels)
    bad = validation.bad_temperatures(values)
    if options.validate:
        validation.check_label_range(labels, vocab_size, options.ignore_index, bad_temperature=bad, temperature=values)
    rows = values.to(torch.promote_types(dtype, torch.float32)).contiguous()
    if options.validate:
        return rows, None
    return torch.where(bad, torch.ones((), dtype=rows.dtype, device=rows.device), rows), bad


def _finish(
    outputs: tuple[torch.Tensor, torch.Tensor | None],
    labels: torch.Tensor,
    flat_labels: bool,
    bad_temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-order outputs back in the labels' layout, NaN where a temperature was bad."""
    log_probs, entropy = outputs
    if bad_temperature is not None:
        log_probs = log_probs.masked_fill(bad_temperature, torch.nan)
        entropy = None if entropy is None else entropy.masked_fill(bad_temperature, torch.nan)
    entropy = None if entropy is None else _like_labels(entropy, labels, flat_labels)
    return _like_labels(log_probs, labels, flat_labels), entropy


def _token_values(values: torch.Tensor, labels: torch.Tensor, flat_labels: bool) -> torch.Tensor:
    """Per-token ``values`` shaped like ``labels`` in the token order of :func:`_tokens`."""
    if labels.dim() == 2 and not flat_labels:
        return values.t().reshape(-1)
    return values.reshape(-1)


def _tokens(hidden: torch.Tensor, labels: torch.Tensor, flat_labels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [n, h]`` and ``labels [n]`` token by token. Megatron's tokens are sequence-major:
    hidden ``[s, b, h] -> [s·b, h]`` pairs with labels ``[b, s]`` transposed."""
    # Already in token form, a tensor is used as it is: a view costs host time (autograd metadata).
    tokens_hidden = hidden if hidden.dim() == 2 else hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    if labels.dim() == 2 and not flat_labels:
        return tokens_hidden, labels.t().reshape(-1)
    return tokens_hidden, labels if labels.dim() == 1 else labels.reshape(-1)


def _like_labels(values: torch.Tensor, labels: torch.Tensor, flat_labels: bool) -> torch.Tensor:
    """Per-token ``values [n]`` back in the labels' layout (``[b, s]`` from sequence-major)."""
    if labels.dim() != 2 or flat_labels:
        return values
    batch, seq = labels.shape
    return values.view(seq, batch).t().contiguous()
