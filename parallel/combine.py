"""Cross-rank combine of per-shard softmax statistics.

Each rank holds, per token and over its own vocab shard (``z`` are the tempered logits):

    m = max_j z_j
    s = Σ_j exp(z_j - m)
    u = Σ_j exp(z_j - m) · (z_j - m)        (entropy term, relative to the shard max)
    y = z_label if the label is in the shard, else 0

``u`` is kept relative to the shard's own max rather than as ``Σ exp(z-m)·z``: for logits of
size 1e4 the absolute form makes the entropy ``lse - Tz/S`` a difference of two numbers near
1e4 and loses three digits; the relative form keeps the entropy exact to fp32 rounding.

The same rescaling merges statistics of two vocab chunks inside one rank, so the backends
use :func:`rescale_statistics` too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.ranks import ProcessGroup, group_size


def rescale_statistics(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, new_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Express ``(s, u)`` taken relative to ``m`` relative to ``new_max >= m`` instead.

    A shard or chunk with no entries (``m = -inf``, ``s = 0``) contributes exactly zero.
    """
    shift = m - new_max  # <= 0, or NaN where both are -inf (an empty part: masked below)
    empty = s == 0
    scale = torch.exp(shift).masked_fill(empty, 0.0)
    return s * scale, (u + s * shift.masked_fill(empty, 0.0)) * scale


def _rescale_factor(m: torch.Tensor, s: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``exp(m - new_max)``, exactly 0 for an empty part (``s = 0``: the shift may be NaN there)."""
    # masked_fill, not where(s == 0, zeros_like(...), ...): the same values in fewer ops.
    return torch.exp(m - new_max).masked_fill(s == 0, 0.0)


def merge_statistics(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge two ``(m, s, u)`` triples over disjoint vocab parts (online softmax)."""
    new_max = torch.maximum(a[0], b[0])
    sa, ua = rescale_statistics(*a, new_max)
    sb, ub = rescale_statistics(*b, new_max)
    return new_max, sa + sb, ua + ub


def combine_shard_statistics(
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor | None,
    y: torch.Tensor,
    tp_group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Combine per-shard statistics over the TP group into ``(lse, entropy, label_logit)``.

    Two collectives: an all-reduce MAX of ``m``, then one all-reduce SUM of the packed
    ``[s, u, y]`` rescaled to the global max. All inputs are fp32 ``[n]``; so are the outputs.
    ``u`` None (the entropy is off): the SUM packs only ``[s, y]`` and ``entropy`` is None.
    """
    if group_size(tp_group) == 1:
        # One shard: its statistics are already relative to its own max (rescaling them to it
        # is the identity, ~10 small kernels per call); nothing to reduce.
        global_max, sum_exp, entropy_term, label_logit = m, s, u, y
    else:
        global_max = m.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        if u is None:
            s_scaled = s * _rescale_factor(m, s, global_max)
            packed = torch.stack([s_scaled, y])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
            (sum_exp, label_logit), entropy_term = packed.unbind(0), None
        else:
            s_scaled, u_scaled = rescale_statistics(m, s, u, global_max)
            packed = torch.stack([s_scaled, u_scaled, y])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
            sum_exp, entropy_term, label_logit = packed.unbind(0)
    log_sum_exp = torch.log(sum_exp)
    lse = global_max + log_sum_exp
    if entropy_term is None:
        return lse, None, label_logit
    # H = -Σ p (z - lse) = lse - E[z] = log S - U / S   (U relative to the global max)
    entropy = log_sum_exp - entropy_term / sum_exp
    return lse, entropy, label_logit
