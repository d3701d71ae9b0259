"""Functional entry of the head: layouts, SP/TP wrapping, validation and backend dispatch."""

from __future__ import annotations

import torch

from mcore_ppo import validation
from mcore_ppo.backends import resolve_backend
from mcore_ppo.function import FusedPPOHeadFunction
from parallel.groups import ProcessGroup, group_rank, group_size, resolve_tp_group
from parallel.mappings import gather_sequence_parallel, reduce_grad_over_tp


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    backend: str = "auto",
    buffer_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log p(label)`` and entropy of ``softmax(hidden @ W.T / temperature)``.

    The ``[tokens, V]`` logits are never materialised: each TP rank computes softmax
    statistics over its own vocab shard and the ranks combine them.

    Args:
        hidden: ``[s, b, h]`` (Megatron; ``[t, 1, h]`` for packed THD) or ``[n, h]``. With
            ``sequence_parallel`` the first dim is this rank's sequence shard ``s/tp``.
        weight: this rank's vocab shard ``[V/tp, h]``, rows ``[rank·V/tp, (rank+1)·V/tp)`` of
            the global vocab (Megatron's ``ColumnParallelLinear`` layout). Same dtype as hidden.
        labels: global vocab ids, ``[b, s]`` for 3-D hidden (``[1, t]`` packed) or ``[n]``,
            covering the whole (gathered) sequence; ``ignore_index`` marks tokens to skip.
        temperature: logits are divided by it; finite and > 0.
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: hidden arrives sequence-sharded over TP; the head all-gathers it
            and reduce-scatters ``d_hidden`` back to this rank's shard.
        ignore_index: label value of tokens whose outputs and gradients are zero.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"liger"``.
        buffer_budget_bytes: bytes this rank may hold in the ``triton`` backend's probability
            buffer (issue 6). When a gradient will be needed (grad mode on and ``hidden`` or
            ``weight`` requires grad) and ``n·V/tp`` values of the input dtype (bf16 in
            training) plus the fp32 tile maxima fit in it, the forward keeps that buffer of
            per-tile probabilities until the backward, which forms ``dz`` from it instead of
            recomputing the logits: three GEMMs instead of four. Decided per call from shapes
            (no host sync); over the budget the head recomputes as usual. None: the
            environment variable ``MCORE_PPO_BUFFER_BUDGET_BYTES``, else the backend default
            (1 GiB, chosen by measurement: docs/kernels.md); 0: off. Only the ``triton`` backend uses it (also when
            ``auto`` picks it); the others ignore it. The budget is per call: outputs of several
            calls kept before one backward hold one buffer each.

    Returns:
        ``(log_probs, entropy)``, fp32, shaped like ``labels`` and identical on every TP rank.
        Gradients flow to ``hidden`` (reduced over TP exactly once) and to ``weight``.
    """
    return compute_log_probs_and_entropy(
        hidden,
        weight,
        labels,
        temperature=temperature,
        tp_group=resolve_tp_group(tp_group),
        sequence_parallel=sequence_parallel,
        ignore_index=ignore_index,
        backend=backend,
        buffer_budget_bytes=buffer_budget_bytes,
    )


def compute_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    ignore_index: int,
    backend: str,
    accumulate_into_main_grad: bool = False,
    buffer_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_log_probs_and_entropy` with the TP group already resolved (the head's path).

    ``accumulate_into_main_grad`` writes the weight gradient into ``weight.main_grad`` (fp32)
    as Megatron's gradient-accumulation fusion does. ``buffer_budget_bytes`` as there.
    """
    validation.check_tensors(hidden, weight, labels, ignore_index)
    temperature = validation.check_temperature(temperature)
    buffer_budget_bytes = validation.check_buffer_budget_bytes(buffer_budget_bytes)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    tp_size = group_size(tp_group)
    # Shapes may be wrong on one rank only: the shard-size collective carries that to every rank.
    layout_error = None
    try:
        validation.check_layout(hidden, weight, labels, tp_size, sequence_parallel)
    except ValueError as err:
        layout_error = err
    validation.check_equal_shards(weight, tp_group, layout_error)
    vocab_size = weight.shape[0] * tp_size
    validation.check_label_range(labels, vocab_size, ignore_index)
    impl = resolve_backend(backend, hidden.device, buffer_budget_bytes=buffer_budget_bytes)
    if getattr(impl, "computes_outputs", False):
        return _whole_head_outputs(impl, hidden, weight, labels, temperature, tp_group, sequence_parallel, ignore_index)

    if hasattr(impl, "grad_needed"):  # lets a backend keep backward buffers only when they will be used
        impl.grad_needed = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)

    # The one TP reduction of d_hidden lives in this wrapper's backward.
    if sequence_parallel and tp_size > 1:
        hidden = gather_sequence_parallel(hidden, tp_group)
    else:
        hidden = reduce_grad_over_tp(hidden, tp_group)

    # Tokens in Megatron's sequence-major order: hidden [s, b, h] -> [s·b, h], labels [b, s] -> [s·b].
    tokens_hidden = hidden.reshape(-1, hidden.shape[-1])
    tokens_labels = labels.t().reshape(-1) if labels.dim() == 2 else labels
    log_probs, entropy = FusedPPOHeadFunction.apply(
        tokens_hidden,
        weight,
        tokens_labels,
        temperature,
        ignore_index,
        group_rank(tp_group) * weight.shape[0],
        vocab_size,
        tp_group,
        impl,
        accumulate_into_main_grad,
    )
    if labels.dim() == 2:
        seq, batch = labels.shape[1], labels.shape[0]
        log_probs = log_probs.view(seq, batch).t().contiguous()
        entropy = entropy.view(seq, batch).t().contiguous()
    return log_probs, entropy


def _whole_head_outputs(impl, hidden, weight, labels, temperature, tp_group, sequence_parallel, ignore_index):
    """A backend with its own autograd and TP handling (Liger): no Function, no TP mapping here."""
    reason = impl.unsupported(group_size(tp_group), sequence_parallel, hidden)
    if reason is not None:
        raise ValueError(f"backend={impl.name!r} cannot run this case: {reason}")
    tokens_hidden = hidden.reshape(-1, hidden.shape[-1])
    tokens_labels = labels.t().reshape(-1) if labels.dim() == 2 else labels
    log_probs, entropy = impl.log_probs_and_entropy(
        tokens_hidden, weight, tokens_labels, temperature=temperature, ignore_index=ignore_index, tp_group=tp_group
    )
    if labels.dim() == 2:
        seq, batch = labels.shape[1], labels.shape[0]
        log_probs = log_probs.view(seq, batch).t().contiguous()
        entropy = entropy.view(seq, batch).t().contiguous()
    return log_probs, entropy
