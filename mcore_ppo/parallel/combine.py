"""Cross-rank combine of per-shard softmax statistics: the collectives and their order.

Each rank holds, per token, the max ``m`` of its vocab shard's tempered logits and sums taken
relative to it. Combining them over the TP group is two collectives, the same on every rank and
for every caller: an all-reduce MAX of ``m`` (the global max ``M``), then one all-reduce SUM of
the sums re-expressed relative to ``M``. What the sums are, and how each one is re-expressed,
is the caller's (:class:`mcore_ppo.statistics.Statistics` for the head; the triton backend
packs them in one kernel); this module owns the order of the collectives, and the log-sum-exp
of ``(m, s)`` pairs that the teacher's top-k combines the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_ppo.parallel.ranks import ProcessGroup, group_size


def rescale_factor(m: torch.Tensor, s: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``exp(m - new_max)``, exactly 0 for an empty part (``s = 0``: the shift may be NaN there)."""
    # masked_fill, not where(s == 0, zeros_like(...), ...): the same values in fewer ops.
    return torch.exp(m - new_max).masked_fill(s == 0, 0.0)


def reduce_shard_statistics(
    shard_max: torch.Tensor,
    sums_relative_to: Callable[[torch.Tensor], torch.Tensor],
    tp_group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's two collectives, for every caller: all-reduce MAX of ``shard_max`` (fp32
    ``[n]``, in place: it becomes the global max ``M``), then all-reduce SUM of
    ``sums_relative_to(M)``, the caller's fp32 ``[rows, n]`` sums rescaled to ``M`` (in place).
    Returns ``(M, summed)``.

    The caller owns the packing and the rescale, so a backend may do both in one kernel (the
    triton backend merges its splits straight to ``M``) while the order of the collectives, which
    every TP rank must share, lives here. One rank: no collective, ``M`` is the shard's max.
    """
    reduce = group_size(tp_group) > 1
    if reduce:
        dist.all_reduce(shard_max, op=dist.ReduceOp.MAX, group=tp_group)
    summed = sums_relative_to(shard_max)
    if reduce:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=tp_group)
    return shard_max, summed


def combine_log_sum_exp(m: torch.Tensor, s: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """``log Σ_j e^(z_j)`` over every rank's entries, from each rank's ``(m, s = Σ e^(z - m))``
    (``(-inf, 0)`` for a rank with none), fp32 ``[n]``, identical on every rank."""
    if group_size(tp_group) > 1:
        m, summed = reduce_shard_statistics(m.clone(), lambda top: (s * rescale_factor(m, s, top))[None], tp_group)
        s = summed[0]
    return m + torch.log(s)
