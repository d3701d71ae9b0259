"""Deterministic top-k selection and its merge across the tensor-parallel vocab shards.

Each rank holds, per token, ``c`` candidates of its vocab shard (values and their *global* ids)
and the softmax statistics ``(m, s)`` of every other entry of its shard (``m`` their max, ``s``
``Σ exp(z - m)``; ``m = -inf``, ``s = 0`` when there is none). :func:`merge_topk_over_ranks`
all-gathers the candidates (one collective), keeps the global top ``k`` on every rank by the same
rule, folds the candidates it drops into the rest, and combines the rest's statistics over the
group with :func:`mcore_ppo.parallel.combine.combine_log_sum_exp` (the head's MAX, then SUM). Every
quantity is a sum of its own terms, never a difference: the tail mass ``Σ_{j ∉ top-k} p_j`` stays
exact to rounding however small it is.

Tie rule, the same on every rank and run: larger value first, and among equal values the smaller
global id (:func:`select_topk`). ``torch.topk`` alone does not promise which of several equal
entries it returns, so the selection ranks fp32 entries by keys that hold the id too (no two
equal) and sorts other dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mcore_ppo.parallel.combine import combine_log_sum_exp, rescale_factor
from mcore_ppo.parallel.mappings import all_gather_first_dim
from mcore_ppo.parallel.ranks import ProcessGroup, group_size

__all__ = ["SelectTop", "fold_into_statistics", "merge_topk_over_ranks", "select_topk", "select_topk_lse"]

#: A selection of the ranks' merge: ``(values [n, ranks, c], ids [n, ranks, c], k)`` (every
#: rank's candidates, as the all-gather left them: views, each rank's ``c`` contiguous; fp32
#: values come with int32 ids) to ``(top_values [n, k'], top_ids [n, k'] int64, dropped_lse
#: [n])`` by the tie rule (module doc), ``dropped_lse`` the log-sum-exp of the entries left out
#: (``-inf`` where none is). :func:`select_topk_lse` is the reference; a backend may bring its
#: own for candidates it knows to be in the tie rule's order.
SelectTop = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


#: Ids below this fit the low half of an fp32 entry's order key (:func:`_order_keys`).
_KEY_IDS = 1 << 32
_LOW_BITS = _KEY_IDS - 1


def _order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One int64 per fp32 entry whose order is the tie rule's: the value's bits, made monotonic
    as a signed int (negative floats' low 31 bits flipped; -0 counted as +0), in the high half,
    and ``2^32 - 1 - id`` (the smaller id the larger key) in the low half. Distinct ids give
    distinct keys, so ``torch.topk`` of the keys has no tie to break. The same transform as the
    kernels' ``ordered_bits`` / ``order_key`` (``mcore_ppo/kernels/common.py``), in torch ops:
    this package may not import the kernels."""
    bits = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0 becomes +0
    high = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return high * _KEY_IDS + (_LOW_BITS - ids)


def _key_values(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` of :func:`_order_keys`' keys."""
    high = keys >> 32  # arithmetic: the signed high half
    bits = torch.where(high < 0, high ^ 0x7FFFFFFF, high)
    return bits.to(torch.int32).view(torch.float32), _LOW_BITS - (keys & _LOW_BITS)


def select_topk(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``values [n, c]`` per row, by the tie rule (module doc).

    ``ids [n, c]`` are distinct within a row (global vocab ids). Returns ``(top_values [n, k'],
    top_ids [n, k'], dropped_values)`` with ``k' = min(k, c)``, the top entries in descending
    order, equal values by ascending id; ``dropped_values`` holds the other entries' values:
    ``[n, c - k']`` of them, or for fp32 values ``[n, c]`` with ``-inf`` in the kept entries'
    places (both add the same to a log-sum-exp or :func:`fold_into_statistics`).

    fp32 values with ids below 2^32 (any vocabulary) are selected by ``torch.topk`` of one
    int64 key per entry (:func:`_order_keys`): no sort of the ``c`` entries, no gather. Other
    dtypes sort.
    """
    kept = min(k, values.shape[-1])
    if values.dtype == torch.float32 and kept < values.shape[-1]:
        keys = _order_keys(values, ids)
        top_keys = keys.topk(kept, dim=-1, sorted=True).values
        top_values, top_ids = _key_values(top_keys)
        dropped = values.masked_fill(keys >= top_keys[..., -1:], -math.inf)
        return top_values, top_ids.to(ids.dtype), dropped
    by_id = ids.argsort(dim=-1)  # ids are distinct: no tie to break here
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    # A stable sort keeps ascending ids among equal values.
    values, order = values.sort(stable=True, dim=-1, descending=True)
    ids = ids.gather(-1, order)
    return values[..., :kept], ids[..., :kept], values[..., kept:]


def select_topk_lse(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`select_topk` of every rank's candidates side by side (``[n, ranks, c]``, or rows
    ``[n, c]``) with the entries it leaves out summed: ``(top_values, top_ids (int64),
    dropped_lse [n])`` (:data:`SelectTop`)."""
    top_values, top_ids, dropped = select_topk(values.flatten(1), ids.flatten(1).to(torch.int64), k)
    return top_values, top_ids, torch.logsumexp(dropped, dim=-1)  # -inf over no entry


def fold_into_statistics(m: torch.Tensor, s: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, s)`` of a set of entries extended by ``values [n, c]`` (``-inf`` entries add nothing).

    ``m [n]`` is the set's max and ``s [n] = Σ exp(z - m)``; an empty set is ``(-inf, 0)``.
    """
    if values.shape[-1] == 0:
        return m, s
    m_new = values.amax(dim=-1)
    # A row of only -inf has m = -inf: shift by 0 there so exp gives 0 rather than NaN.
    shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    s_new = torch.exp(values - shift[:, None]).sum(dim=-1)
    top = torch.maximum(m, m_new)
    merged = s * rescale_factor(m, s, top) + s_new * rescale_factor(m_new, s_new, top)
    return top, merged


def _gather_candidates(
    values: torch.Tensor, ids: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``[n, c]`` candidates side by side, ``[n, world, c]``, in one all-gather.

    Values and ids travel together in one tensor: fp32 values with their ids' int32 bits beside
    them (a collective moves bytes, so the bits arrive as sent; ids fit: no device holds a shard
    of 2**31 rows), returned as views of what the all-gather wrote (int32 ids); other values as
    fp64 with the ids converted (exact below 2**53), converted back.
    """
    world = group_size(group)
    if world == 1:
        return values.unsqueeze(1), ids.unsqueeze(1)
    if values.dtype == torch.float32:
        packed = torch.stack([values, ids.to(torch.int32).view(torch.float32)])
    else:
        packed = torch.stack([values.to(torch.float64), ids.to(torch.float64)])
    gathered = all_gather_first_dim(packed.unsqueeze(0), group)  # [world, 2, n, c]
    by_row = gathered.permute(1, 2, 0, 3)  # [2, n, world, c]: a view
    if values.dtype == torch.float32:
        return by_row[0], by_row[1].view(torch.int32)
    return by_row[0].to(values.dtype), by_row[1].to(ids.dtype)


def merge_topk_over_ranks(
    values: torch.Tensor,
    ids: torch.Tensor,
    rest_max: torch.Tensor,
    rest_sum: torch.Tensor,
    k: int,
    group: ProcessGroup | None,
    *,
    presorted: bool = False,
    select: SelectTop = select_topk_lse,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global top ``k`` and the log-sum-exps of everything and of the tail, on every rank.

    Args:
        values, ids: this rank's ``[n, c]`` candidates (the same ``c`` on every rank) and their
            global ids; the global top ``k`` must lie among the union of every rank's candidates.
        rest_max, rest_sum: ``[n]`` statistics ``(m, s)`` of this rank's non-candidate entries.
        k: how many to keep (``k <= world · c``).
        group: the TP group (None: one rank).
        presorted: the candidates are already in the tie rule's order (one rank only needs no
            selection then: with ``c == k`` they are the top ``k``).
        select: how the top ``k`` of every rank's candidates side by side (``[n, world, c]``)
            is taken (:data:`SelectTop`).

    Returns:
        ``(top_values [n, k], top_ids [n, k], lse [n], tail_lse [n])``: the top entries by the
        tie rule, ``log Σ_j exp(z_j)`` over the whole vocab, and the same sum over the entries
        outside the top ``k`` (``-inf`` when there are none), identical on every rank.
    """
    dropped_lse = None
    if presorted and group_size(group) == 1:
        top_values, top_ids = values[:, :k], ids[:, :k]
        if values.shape[-1] > k:
            dropped_lse = torch.logsumexp(values[:, k:], dim=-1)
    else:
        top_values, top_ids, dropped_lse = select(*_gather_candidates(values, ids, group), k)
    # The rest of every shard, combined exactly as the head combines its statistics.
    rest_lse = combine_log_sum_exp(rest_max, rest_sum, group)
    # Candidates dropped by the merge are the same on every rank: fold them in after the combine.
    tail_lse = rest_lse if dropped_lse is None else torch.logaddexp(rest_lse, dropped_lse)
    lse = torch.logaddexp(torch.logsumexp(top_values, dim=-1), tail_lse)
    return top_values, top_ids, lse, tail_lse
