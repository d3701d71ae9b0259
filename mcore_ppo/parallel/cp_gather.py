"""Gather per-token values from every context-parallel rank back into global sequence order.

Each CP rank holds its tokens in Megatron's load-balanced order (chunks ``r`` and ``2cp-1-r`` of
every sequence: :func:`mcore_ppo.parallel.context_parallel.cp_token_index`). :func:`gather_from_cp`
all-gathers them and puts every value at its global position, for padded batches and for
packed ones (``cu_seqlens``), with autograd.

Backward convention (NeMo-RL's ``AllGatherCPTensor``, ``nemo_rl/distributed/model_utils.py``):
every CP rank computes the same loss on the gathered values, so the upstream gradients are
summed over CP before each rank keeps its own positions; Megatron's DDP then averages the model's
gradients over DP × CP, which divides that factor out again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_ppo.parallel.context_parallel import cp_token_index, sequence_bounds
from mcore_ppo.parallel.mappings import all_gather_first_dim
from mcore_ppo.parallel.ranks import ProcessGroup, group_rank, group_size


class _GatherFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: ProcessGroup, seq_dim: int, bounds: list[int]) -> torch.Tensor:
        cp_size, cp_rank = group_size(group), group_rank(group)
        order = [i for rank in range(cp_size) for i in cp_token_index(bounds, cp_size, rank)]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        gathered = all_gather_first_dim(local.movedim(seq_dim, 0), group)
        ctx.group, ctx.seq_dim = group, seq_dim
        ctx.own = torch.tensor(cp_token_index(bounds, cp_size, cp_rank), dtype=torch.long, device=local.device)
        return gathered.index_select(0, inverse.to(local.device)).movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # the module doc's convention
        return grad.index_select(ctx.seq_dim, ctx.own), None, None, None


def gather_from_cp(
    local: torch.Tensor,
    group: ProcessGroup | None,
    *,
    seq_dim: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """``local`` (this CP rank's tokens along ``seq_dim``) from every rank, in global order.

    Args:
        local: this rank's values, its tokens in Megatron's load-balanced order along ``seq_dim``.
        group: the CP group (None or one rank: ``local`` is returned as it is).
        seq_dim: the sequence dimension of ``local``.
        cu_seqlens: packed batches: the *global* cumulative sequence lengths (each a multiple of
            ``2·cp``); None: one sequence per row (a padded batch).

    Returns:
        ``local`` with ``seq_dim`` grown ``cp`` times, every value at its global position;
        differentiable (backward: the module doc's convention).
    """
    cp_size = group_size(group)
    if cp_size == 1:
        return local
    seq_dim %= local.dim()
    total = local.shape[seq_dim] * cp_size
    bounds = [0, total] if cu_seqlens is None else sequence_bounds(cu_seqlens, total)
    return _GatherFromCP.apply(local, group, seq_dim, bounds)
