"""The contract every backend of the head implements.

A backend computes, for one rank's vocab shard, the per-token softmax statistics of the
tempered logits ``z = hidden @ weight.T / T`` and, in the backward, this shard's gradient
contributions. It never communicates: the cross-rank combine and the ``d_hidden`` reduction
live in :mod:`parallel` and in the autograd Function.

Arguments shared by both methods:
    hidden: ``[n, h]`` activations (any float dtype; the backend computes in fp32).
    weight: ``[v, h]`` this rank's vocab shard.
    local_labels: ``[n]`` int64, the label's row in this shard, or -1 where the label is
        ignored or owned by another rank.
    valid: ``[n]`` bool, False for ignored tokens (their outputs and gradients are zero, and
        a backend may skip their GEMM work).
    temperature: python float > 0.
"""

from __future__ import annotations

from typing import Protocol

import torch

from parallel.groups import ProcessGroup


class Backend(Protocol):
    """Per-shard statistics and gradients of the fused head."""

    name: str
    # Optional (default False): True lets the Function pass a zero ``weight_grad`` in the
    # weight's own dtype when Megatron's main_grad is not used. Only for backends that form
    # every row of d_W in a single fp32-accumulated reduction over all tokens (one rounding).
    weight_grad_in_weight_dtype: bool

    def shard_statistics(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 ``[n]`` tensors ``(m, s, u, y)``: shard max, Σexp(z-m), Σexp(z-m)(z-m), z_label (0 if not here)."""
        ...

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: float,
        lse: torch.Tensor,
        entropy: torch.Tensor,
        grad_log_prob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        need_hidden_grad: bool,
        weight_grad: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This shard's ``(d_hidden, d_weight)`` in fp32 (``d_hidden`` may come already rounded
        once to ``hidden``'s dtype, from fp32 accumulation, when that saves the backend a pass).

        ``lse`` and ``entropy`` are the combined (global) fp32 values per token; the upstream
        gradients are per token (``None`` = that output is unused). ``d_hidden`` is this
        shard's partial sum (the caller reduces it over TP). ``weight_grad`` is None when no
        weight gradient is needed, else an fp32 ``[v, h]`` buffer to accumulate into (zeros,
        or Megatron's ``main_grad``), which is returned.
        """
        ...


class OutputsBackend(Protocol):
    """A backend that computes whole outputs with its own autograd and TP handling (Liger).

    :func:`mcore_ppo.pipeline.run_head` calls it in place of the head's autograd Function and
    wraps ``hidden`` in no TP mapping: its backward must return the ``d_hidden`` the entry
    point promises (reduced over TP, unless it reports the case unsupported).
    """

    name: str
    computes_outputs: bool  # True: this protocol, not the per-shard one

    def unsupported(
        self, tp_size: int, sequence_parallel: bool, hidden: torch.Tensor, *, reduce_hidden_grad: bool = True
    ) -> str | None:
        """Why this case cannot run here (the pipeline raises ValueError with it), or None."""
        ...

    def log_probs_and_entropy(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float,
        ignore_index: int,
        tp_group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(log_prob [n], entropy [n])`` for ``hidden [n, h]`` and global ``labels [n]``."""
        ...
