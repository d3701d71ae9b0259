"""The collectives of the head's TP layouts, on the inputs' device: the all-gather of the
sequence-parallel token rows and the reduce-scatter of their gradient (the TP sum and the SP
scatter in one collective), used inside the head's ops (:mod:`mcore_ppo.shard`).

Both are written here rather than taken from Megatron: Megatron's SP gather allocates its output
on ``torch.cuda.current_device()``, which breaks CPU tensors, and importing it would tie the
head's core to megatron-core (the core runs with torch alone).
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
