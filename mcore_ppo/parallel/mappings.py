"""Autograd-aware collectives that place the one reduction of ``d_hidden`` over TP.

The head's autograd Function returns each rank's *partial* ``d_hidden`` (its own vocab
shard's contribution). Exactly one of these mappings wraps the hidden states before the
Function, and its backward is where the partials are summed:

- SP on:  :func:`gather_sequence_parallel` — all-gather along the sequence (first) dim in
  forward, reduce-scatter in backward (TP sum and SP scatter in one collective).
- SP off: :func:`reduce_grad_over_tp` — identity in forward, all-reduce in backward (the
  mapping of Megatron's ``copy_to_tensor_model_parallel_region``).

Both are written here rather than taken from Megatron. Megatron's SP gather allocates its
output on ``torch.cuda.current_device()``, which breaks CPU tensors. Its all-reduce mapping
would fit, but importing it would tie the head's core to megatron-core (the core
runs with torch alone); our copy is the same math and also reduces a non-contiguous gradient,
which Megatron's ``_reduce`` all-reduces into a temporary copy and drops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_ppo.parallel.ranks import ProcessGroup, group_size

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_first_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (no autograd)."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(out, tensor, group=group)
    return out


def reduce_scatter_first_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's slice of dim 0 (no autograd)."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _reduce_scatter_single(out, tensor, group=group)
    return out


class _GatherSequenceParallel(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_first_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_first_dim(grad, ctx.group), None


def gather_sequence_parallel(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather sequence-parallel ``tensor`` ([s/tp, ...] → [s, ...]); backward reduce-scatters."""
    if group_size(group) == 1:
        return tensor
    return _GatherSequenceParallel.apply(tensor, group)


class _ReduceGradOverTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce SUM over the group (our own, not Megatron's: module doc)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_grad_over_tp(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity in forward; all-reduce of the gradient over ``group`` in backward."""
    if group_size(group) == 1:
        return tensor
    return _ReduceGradOverTP.apply(tensor, group)
