"""Functional entry of the head for callers with tensors and a TP group (no Megatron model needed)."""

from __future__ import annotations

import torch

from mcore_ppo.backends.base import Backend
from mcore_ppo.head_call import attempt, run_head
from mcore_ppo.options import DEFAULT_LAYOUT, DEFAULT_OPTIONS, HeadOptions, call_options, megatron_layout
from mcore_ppo.parallel.groups import ProcessGroup, resolve_tp_group


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    options: HeadOptions | None = None,
    ignore_index: int | None = None,
    backend: str | Backend | None = None,
    return_entropy: bool | None = None,
    validate: bool | None = None,
    accumulate_into_main_grad: bool = False,
    return_sum_pi_squared: bool | None = None,
    precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token ``log p(label)`` and entropy of ``softmax(hidden @ W.T / temperature)``.

    The ``[tokens, V]`` logits are never materialised: each TP rank computes softmax
    statistics over its own vocab shard and the ranks combine them.

    Args:
        hidden: ``[s, b, h]`` (Megatron; ``[t, 1, h]`` for packed THD) or ``[n, h]``. With
            ``sequence_parallel`` the first dim is this rank's sequence shard ``s/tp``.
        weight: this rank's vocab shard ``[V/tp, h]``, rows ``[rank·V/tp, (rank+1)·V/tp)`` of
            the global vocab (Megatron's ``ColumnParallelLinear`` layout). Same dtype as hidden.
        labels: global vocab ids, ``[b, s]`` for 3-D hidden (``[1, t]`` packed) or ``[n]``,
            covering the whole (gathered) sequence; ``ignore_index`` marks tokens to skip. Any
            dtype of :data:`mcore_ppo.validation.LABEL_DTYPES`, compared in int64. With a
            trailing dim, ``[b, s, k]`` / ``[n, k]``: ``k`` ids per token (a teacher's top-k);
            the log-probs are then ``[..., k]`` (0 in an ignored slot; a token whose ``k``
            slots are all ignored is skipped) and the entropy per token. ``k = 1`` is the one
            label's path, at its speed.
        temperature: logits are divided by it; a Python number in ``[1e-4, inf)``
            (:data:`mcore_ppo.validation.MIN_TEMPERATURE` says why the floor), or a per-token
            floating-point tensor shaped like the labels' tokens or broadcastable to them
            (``[b, 1]``: one per sequence), on their device, values in the same range; token
            ``i``'s logits are divided by ``T_i``. The tensor gets no gradient.
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: hidden arrives sequence-sharded over TP; the head all-gathers it
            and reduce-scatters ``d_hidden`` back to this rank's shard.
        options: a :class:`~mcore_ppo.options.HeadOptions` (built and validated once, reused
            across calls); the four keywords below, ``return_sum_pi_squared`` and ``precision``,
            when given, replace its fields.
        ignore_index: label value of tokens whose outputs and gradients are zero (default -100).
        backend: ``"auto"`` (default), ``"torch"``, ``"triton"`` or a backend object, e.g.
            ``TritonBackend(TritonConfig(buffer_budget_bytes=...))`` (docs/kernels.md).
        return_entropy: False skips every bit of entropy work and returns ``(log_probs, None)``.
        validate: read the labels and a temperature tensor where that is free (CPU tensors:
            ValueError) and share the verdict over the TP group without a host sync
            (:class:`~mcore_ppo.options.HeadOptions` says when); elsewhere and with False, bad
            labels / temperatures give NaN outputs for their tokens. Default
            :data:`mcore_ppo.validation.VALIDATE_DEFAULT`.
        accumulate_into_main_grad: the weight gradient goes into ``weight.main_grad`` (fp32), as
            Megatron's gradient-accumulation fusion does; autograd then gets zeros.
        return_sum_pi_squared: True returns a third output, ``Σ_v softmax(z/T)_v²`` per token
            (verl's optimal token baseline ``w_t = 1 − 2π_t + Σπ²``), from the same pass and the
            same TP all-reduce; fp32, in ``[1/V, 1]``, 0 for ignored tokens, detached (no
            gradient flows from it). Works with ``return_entropy=False``.
        precision: how fp32 ``hidden`` and ``weight`` are multiplied: ``"auto"`` (default) and
            ``"ieee"`` IEEE fp32; ``"fp32_faithful"`` three fp16 products per product on the
            triton backend, fp32 accuracy at tensor-core speed (docs/kernels.md, "Numerics"). 16-bit
            inputs are unaffected.

    Returns:
        ``(log_probs, entropy)``, fp32 (fp64 with ``k`` ids and fp64 inputs), shaped like
        ``labels`` (the entropy per token), identical on every TP rank (``entropy`` None with
        ``return_entropy=False``). Gradients flow to ``hidden`` (reduced over TP exactly once)
        and to ``weight``. With ``return_sum_pi_squared``: ``(log_probs, entropy,
        sum_pi_squared)``, the third per token like ``entropy``.

    Raises:
        TypeError: an argument of the wrong type (naming it).
        ValueError: a bad value or shape (naming it), a backend that cannot run these inputs,
            or another TP rank's refusal of its own inputs.
    """
    return _call(
        hidden, weight, labels, temperature, tp_group, sequence_parallel, options, ignore_index, backend,
        return_entropy, validate, accumulate_into_main_grad, return_sum_pi_squared, precision, ids=None,
    )  # fmt: skip


def fused_log_probs_at(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    options: HeadOptions | None = None,
    ignore_index: int | None = None,
    backend: str | Backend | None = None,
    return_entropy: bool | None = None,
    validate: bool | None = None,
    accumulate_into_main_grad: bool = False,
    return_sum_pi_squared: bool | None = None,
    precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A student's ``log q`` at ``k`` ids per token (e.g. a teacher's top-k from
    :func:`mcore_ppo.fused_topk`), and its entropy: :func:`fused_log_probs_and_entropy` with
    ``labels`` that must carry the trailing ``k`` dim (``[b, s, k]`` for hidden ``[s, b, h]``,
    ``[n, k]`` for ``[n, h]``, ``k >= 1``; under CP this rank's tokens). The same arguments,
    checks, layouts and gradients; ``log_probs`` ``[..., k]``, ``entropy`` (and with
    ``return_sum_pi_squared`` ``sum_pi_squared``) per token."""
    return _call(
        hidden, weight, labels, temperature, tp_group, sequence_parallel, options, ignore_index, backend,
        return_entropy, validate, accumulate_into_main_grad, return_sum_pi_squared, precision, ids=True,
    )  # fmt: skip


def _call(
    hidden, weight, labels, temperature, tp_group, sequence_parallel, options, ignore_index, backend, return_entropy,
    validate, accumulate_into_main_grad, return_sum_pi_squared, precision, *, ids: bool | None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Both functions' call: their own argument checks (shared as ``prior_error``), then the head."""
    (options, layout), error = attempt(
        lambda: (
            call_options(
                options,
                ignore_index=ignore_index,
                backend=backend,
                return_entropy=return_entropy,
                validate=validate,
                return_sum_pi_squared=return_sum_pi_squared,
                precision=precision,
            ),
            megatron_layout(sequence_parallel, accumulate_into_main_grad),
        ),
        (DEFAULT_OPTIONS, DEFAULT_LAYOUT),
    )
    return run_head(
        hidden, weight, labels, temperature, options, tp_group=resolve_tp_group(tp_group), layout=layout, ids=ids,
        prior_error=error,
    )  # fmt: skip
