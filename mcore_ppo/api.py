"""Functional entry of the head for callers with tensors and a TP group (no Megatron model needed)."""

from __future__ import annotations

import torch

from mcore_ppo.backends.base import Backend
from mcore_ppo.distill.student import fused_log_probs_at
from mcore_ppo.pipeline import call_options, run_head
from parallel.groups import ProcessGroup, resolve_tp_group


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    backend: str | Backend = "auto",
    return_entropy: bool = True,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
            trailing dim, ``[b, s, k]`` / ``[n, k]``: ``k`` ids per token (a teacher's top-k),
            computed by :func:`mcore_ppo.distill.student.fused_log_probs_at`, whose log-probs are
            ``[..., k]`` (the entropy per token).
        temperature: logits are divided by it; a Python number in ``[1e-4, inf)``
            (:data:`mcore_ppo.validation.MIN_TEMPERATURE` says why the floor), or a per-token
            floating-point tensor shaped like ``labels`` or broadcastable to them (``[b, 1]``:
            one per sequence), on their device, values in the same range; token ``i``'s logits
            are divided by ``T_i``. The tensor gets no gradient (it is detached). See
            :func:`mcore_ppo.pipeline.run_head` for how its values are checked.
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: hidden arrives sequence-sharded over TP; the head all-gathers it
            and reduce-scatters ``d_hidden`` back to this rank's shard.
        ignore_index: label value of tokens whose outputs and gradients are zero.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"liger"`` or a backend object, e.g.
            ``TritonBackend(buffer_budget_bytes=...)`` to size the triton backend's probability
            buffer (:mod:`mcore_ppo.backends`, docs/kernels.md).
        return_entropy: False skips every bit of entropy work and returns ``(log_probs, None)``.
        validate: check the labels' range and a temperature tensor's values (ValueError), on
            every device; one host sync on CUDA. False for CUDA graphs and host-bound loops:
            then bad labels / temperatures give NaN outputs for their tokens. None: the
            default, :data:`mcore_ppo.validation.VALIDATE_DEFAULT` (True unless
            ``MCORE_PPO_VALIDATE=0``). See :class:`mcore_ppo.pipeline.HeadOptions`.

    Returns:
        ``(log_probs, entropy)``, fp32, shaped like ``labels`` and identical on every TP rank
        (``entropy`` None with ``return_entropy=False``).
        Gradients flow to ``hidden`` (reduced over TP exactly once) and to ``weight``.
    """
    if isinstance(labels, torch.Tensor) and isinstance(hidden, torch.Tensor) and labels.dim() == hidden.dim() in (2, 3):
        return fused_log_probs_at(
            hidden, weight, labels, temperature=temperature, tp_group=tp_group, sequence_parallel=sequence_parallel,
            ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate,
        )  # fmt: skip
    options, row_temperature = call_options(
        temperature, ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate
    )
    return run_head(
        hidden,
        weight,
        labels,
        options,
        tp_group=resolve_tp_group(tp_group),
        sequence_parallel=sequence_parallel,
        temperature=row_temperature,
    )
