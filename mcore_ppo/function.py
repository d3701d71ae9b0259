"""The autograd Function of the head, shared by every backend.

Forward (one rank, its vocab shard ``[vocab_start, vocab_start + v)``):
  1. local statistics ``(m, s, u, y)`` from the backend, fp32, nothing ``[n, v]`` kept;
  2. the cross-rank combine (:func:`parallel.combine_shard_statistics`): MAX, then one SUM;
  3. ``log_prob = y - lse`` and ``entropy = H``, zero for ignored tokens.
Saved for backward: the inputs and the fp32 per-token ``lse`` and ``entropy``.

Backward: the backend recomputes the logits shard by shard and returns this rank's *partial*
``d_hidden`` (fp32, cast once at the end) and ``d_weight``. The partial ``d_hidden`` is summed
over TP by the mapping that wraps ``hidden`` outside this Function (see
:mod:`parallel.mappings`), so it is reduced exactly once, whatever the layout.
"""

from __future__ import annotations

import functools
import math

import torch

from mcore_ppo.backends.base import Backend
from parallel.combine import combine_shard_statistics
from parallel.groups import ProcessGroup


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


def _weight_grad_buffer(weight: torch.Tensor, accumulate_into_main_grad: bool, backend: Backend) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None) if accumulate_into_main_grad else None
    if main_grad is not None:
        return main_grad
    # A backend that forms each d_W row in one fp32-accumulated GEMM may take a buffer in the
    # weight's dtype (see Backend.weight_grad_in_weight_dtype): half the memory, no cast.
    if getattr(backend, "weight_grad_in_weight_dtype", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)


class FusedPPOHeadFunction(torch.autograd.Function):
    """``(hidden [n,h], weight [v,h], labels [n]) → (log_prob [n], entropy [n])``, fp32.

    ``labels`` are global vocab ids (or ``ignore_index``); this rank owns rows
    ``[vocab_start, vocab_start + v)`` of the global vocab of size ``vocab_size``.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        ignore_index: int,
        vocab_start: int,
        vocab_size: int,
        tp_group: ProcessGroup | None,
        backend: Backend,
        accumulate_into_main_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        valid = labels != ignore_index
        local_labels = labels.long() - vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(in_shard, local_labels, torch.full_like(local_labels, -1))

        m, s, u, y = backend.shard_statistics(hidden, weight, local_labels, valid, temperature)
        lse, entropy, label_logit = combine_shard_statistics(m, s, u, y, tp_group)

        zero = torch.zeros_like(lse)
        # Rounding can push log p a hair above 0 or H a hair below 0; the math forbids both.
        log_prob = torch.where(valid, (label_logit - lse).clamp(max=0.0), zero)
        # A label outside [0, vocab_size) that was not caught by validation (CUDA without
        # MCORE_PPO_VALIDATE=1) poisons its log-prob instead of returning a plausible number.
        out_of_range = valid & ((labels < 0) | (labels >= vocab_size))
        log_prob = torch.where(out_of_range, torch.full_like(log_prob, torch.nan), log_prob)
        # Near-uniform logits: H rounds to within an ulp of log V, possibly above it.
        entropy_out = torch.where(valid, entropy.clamp(min=0.0, max=_max_entropy(vocab_size, entropy.dtype)), zero)

        ctx.save_for_backward(hidden, weight, local_labels, valid, lse, entropy)
        ctx.temperature = temperature
        ctx.backend = backend
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        return log_prob, entropy_out

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, local_labels, valid, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 8
        if (grad_log_prob is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, *nones

        main_grad = ctx.accumulate_into_main_grad and hasattr(weight, "main_grad")
        weight_grad = _weight_grad_buffer(weight, ctx.accumulate_into_main_grad, ctx.backend) if need_weight else None
        d_hidden, d_weight = ctx.backend.shard_gradients(
            hidden,
            weight,
            local_labels,
            valid,
            ctx.temperature,
            lse,
            entropy,
            grad_log_prob,
            grad_entropy,
            need_hidden,
            weight_grad,
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
