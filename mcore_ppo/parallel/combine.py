"""Cross-rank combine of per-shard softmax statistics.

Each rank holds, per token and over its own vocab shard (``z`` are the tempered logits):

    m = max_j z_j
    s = Σ_j exp(z_j - m)
    u = Σ_j exp(z_j - m) · (z_j - m)        (entropy term, relative to the shard max)
    y = z_label if the label is in the shard, else 0
    q = Σ_j exp(2(z_j - m))                (optional: Σπ², relative to the shard max)

``u`` is kept relative to the shard's own max rather than as ``Σ exp(z-m)·z``: for logits of
size 1e4 the absolute form makes the entropy ``lse - Tz/S`` a difference of two numbers near
1e4 and loses three digits; the relative form keeps the entropy exact to fp32 rounding.

``q`` (asked only for Σπ², verl's optimal token baseline) rescales by the square of ``s``'s
factor, ``q·e^(2(m - M))``, and ``Σ_j π_j² = Q / S²`` with both relative to the global max ``M``:
``Q ≥ 1`` and ``S ≥ 1`` (the argmax contributes 1 to each), so nothing under- or overflows.

The same rescaling merges statistics of two vocab chunks inside one rank, so the backends
use :func:`rescale_statistics` too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_ppo.parallel.ranks import ProcessGroup, group_size


def rescale_statistics(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, new_max: torch.Tensor, q: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Express ``(s, u)`` taken relative to ``m`` relative to ``new_max >= m`` instead; with
    ``q`` (Σπ²'s sum) ``(s, u, q)``, ``q`` by the squared factor.

    A shard or chunk with no entries (``m = -inf``, ``s = 0``) contributes exactly zero.
    """
    shift = m - new_max  # <= 0, or NaN where both are -inf (an empty part: masked below)
    empty = s == 0
    scale = torch.exp(shift).masked_fill(empty, 0.0)
    rescaled = s * scale, (u + s * shift.masked_fill(empty, 0.0)) * scale
    return rescaled if q is None else (*rescaled, q * (scale * scale))


def _rescale_factor(m: torch.Tensor, s: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``exp(m - new_max)``, exactly 0 for an empty part (``s = 0``: the shift may be NaN there)."""
    # masked_fill, not where(s == 0, zeros_like(...), ...): the same values in fewer ops.
    return torch.exp(m - new_max).masked_fill(s == 0, 0.0)


def merge_statistics(
    a: tuple[torch.Tensor, ...],
    b: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    """Merge two ``(m, s, u)`` triples over disjoint vocab parts (online softmax); with a fourth
    element ``q`` (Σπ²'s sum) in both, ``(m, s, u, q)``, ``q`` rescaled by the squared factor."""
    new_max = torch.maximum(a[0], b[0])
    rescaled_a = rescale_statistics(*a[:3], new_max, *a[3:])
    rescaled_b = rescale_statistics(*b[:3], new_max, *b[3:])
    return new_max, *(x + y for x, y in zip(rescaled_a, rescaled_b, strict=True))


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


def combine_shard_statistics(
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor | None,
    y: torch.Tensor,
    tp_group: ProcessGroup | None,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Combine per-shard statistics over the TP group into ``(lse, entropy, label_logit)``, and
    with ``q`` given ``(lse, entropy, label_logit, sum_pi_squared)``.

    Two collectives: an all-reduce MAX of ``m``, then one all-reduce SUM of the packed
    ``[s, u, y]`` (with ``q``: ``[s, u, y, q]``) rescaled to the global max. All inputs are
    fp32 ``[n]``; so are the outputs. ``u`` None (the entropy is off): the SUM packs no ``u``
    and ``entropy`` is None. ``sum_pi_squared = Q / S²`` is not clamped here (the caller clamps
    it to ``[1/V, 1]`` and zeroes ignored tokens).
    """
    if group_size(tp_group) == 1:
        # One shard: its statistics are already relative to its own max (rescaling them to it
        # is the identity, ~10 small kernels per call); nothing to reduce.
        global_max, sum_exp, entropy_term, label_logit, square_sum = m, s, u, y, q
    else:

        def sums_relative_to(global_max: torch.Tensor) -> torch.Tensor:
            if u is None:
                factor = _rescale_factor(m, s, global_max)
                rows = [s * factor, y] + ([] if q is None else [q * (factor * factor)])
            else:
                s_scaled, u_scaled, *q_scaled = rescale_statistics(m, s, u, global_max, q)
                rows = [s_scaled, u_scaled, y, *q_scaled]
            return torch.stack(rows)

        global_max, packed = reduce_shard_statistics(m.clone(), sums_relative_to, tp_group)
        sums = list(packed.unbind(0))
        square_sum = sums.pop() if q is not None else None
        sum_exp, label_logit = sums[0], sums[-1]
        entropy_term = sums[1] if u is not None else None
    log_sum_exp = torch.log(sum_exp)
    lse = global_max + log_sum_exp
    entropy = None
    if entropy_term is not None:
        # H = -Σ p (z - lse) = lse - E[z] = log S - U / S   (U relative to the global max)
        entropy = log_sum_exp - entropy_term / sum_exp
    if q is None:
        return lse, entropy, label_logit
    # Σ π² = Σ e^(2(z - M)) / S² = Q / S²   (Q and S relative to the global max)
    return lse, entropy, label_logit, square_sum / (sum_exp * sum_exp)
