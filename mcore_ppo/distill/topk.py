"""A teacher's top-k over the tensor-parallel vocab shards, without the ``[tokens, V]`` logits.

Per token, with ``z = hidden @ W.T / T`` over the global vocab and ``p = softmax(z)``, returns
the global ids of the ``k`` most likely tokens, their ``log p`` and the log of the probability
mass outside them. Each TP rank reduces its own shard, one bounded block of logits at a time
(:data:`TOKEN_CHUNK` × :data:`VOCAB_CHUNK`): per block the ``k`` largest (``torch.topk`` plus a
deterministic repair of ties at the k-th value), merged with the rank's running candidates; every
entry that is not (or stops being) a candidate is folded into the softmax statistics ``(m, s)`` of
the shard's rest. The ranks then merge (:func:`parallel.topk.merge_topk_over_ranks`).

No gradient: the teacher is not trained, so the call runs under ``torch.no_grad()`` and its
outputs never require grad, whatever ``hidden`` and ``weight`` do.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mcore_ppo import validation
from mcore_ppo.function import autocast_off
from parallel.groups import resolve_tp_group
from parallel.mappings import all_gather_first_dim
from parallel.ranks import ProcessGroup, group_rank, group_size
from parallel.topk import fold_into_statistics, merge_topk_over_ranks, select_topk

#: Largest ``k`` accepted: a top-k teacher is a sparse summary (verl's default is 128), and
#: every rank all-gathers ``k`` candidates per token from every other rank.
MAX_TOPK = 128
#: Block of logits held at once, ``[TOKEN_CHUNK, VOCAB_CHUNK]`` fp32 (32 MiB), read at each call.
TOKEN_CHUNK = 2048
VOCAB_CHUNK = 4096


class TopK(NamedTuple):
    """Per-token top-k of the teacher, in the layout of the call (see :func:`fused_topk`).

    Attributes:
        ids: int64 ``[..., k]`` global vocab ids, most likely first, equal probabilities by
            ascending id; ``ignore_index`` in every slot of an ignored token.
        log_probs: ``[..., k]`` ``log p`` of those ids (fp32; fp64 for fp64 inputs); 0 for an
            ignored token.
        tail_log_mass: ``[...]`` ``log Σ_{j ∉ top-k} p_j`` (-inf when the top-k hold the whole
            vocab); 0 for an ignored token.
    """

    ids: torch.Tensor
    log_probs: torch.Tensor
    tail_log_mass: torch.Tensor


def check_k(k: object, vocab_size: int | None = None) -> int:
    """``k`` is an int (bool is not accepted) in ``[1, MAX_TOPK]`` and, given ``vocab_size``, ``<= vocab_size``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {validation.type_name(k)}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"k must be in [1, {MAX_TOPK}] (MAX_TOPK), got {k}")
    if vocab_size is not None and k > vocab_size:
        raise ValueError(f"k must be <= the global vocab size {vocab_size}, got k={k}")
    return k


def fused_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> TopK:
    """Per-token top-``k`` ids, log-probs and tail mass of ``softmax(hidden @ W.T / temperature)``.

    Runs under ``torch.no_grad()``: no gradient reaches ``hidden`` or ``weight``.

    Args:
        hidden: ``[s, b, h]`` (Megatron; ``[t, 1, h]`` packed THD) or ``[n, h]``. With
            ``sequence_parallel`` the first dim is this rank's sequence shard ``s/tp``; it is
            all-gathered and the outputs cover the whole sequence.
        weight: this rank's vocab shard ``[V/tp, h]``, rows ``[rank·V/tp, (rank+1)·V/tp)`` of
            the global vocab, the same dtype as ``hidden``.
        k: how many ids per token, an int in ``[1, MAX_TOPK]`` and ``<= V``.
        temperature: the logits are divided by it; a Python number in ``[1e-4, inf)``
            (:data:`mcore_ppo.validation.MIN_TEMPERATURE`).
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: ``hidden`` arrives sequence-sharded over TP.
        labels: optional, shaped as for the head (``[b, s]``, ``[1, t]``, ``[n]``, the whole
            sequence): only which entries equal ``ignore_index`` is read. Those tokens get
            ``ids = ignore_index``, ``log_probs = 0``, ``tail_log_mass = 0``. None: every token
            counts.
        ignore_index: the label value of tokens to skip.

    Returns:
        :class:`TopK` ``(ids, log_probs, tail_log_mass)``: ``[b, s, k]`` / ``[b, s]`` for hidden
        ``[s, b, h]`` (``[1, t, k]`` packed), ``[n, k]`` / ``[n]`` for ``[n, h]``; identical on
        every TP rank. ``log_probs`` and ``tail_log_mass`` are fp32 (fp64 for fp64 inputs).

    Raises:
        TypeError: ``k`` not an int, non-tensor inputs, a non-float ``hidden``, ``weight`` of
            another dtype, ``labels`` not an integer tensor, a flag that is not a bool.
        ValueError: ``k`` out of range, shapes that do not fit a layout, unequal weight shards,
            a bad temperature or ``ignore_index``.
    """
    with torch.no_grad():
        return _fused_topk(hidden, weight, k, temperature, tp_group, sequence_parallel, labels, ignore_index)


def _fused_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    labels: torch.Tensor | None,
    ignore_index: int,
) -> TopK:
    k = check_k(k)
    temperature = validation.check_temperature(temperature)
    validation.check_ignore_index(ignore_index)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {validation.type_name(sequence_parallel)}")
    tp_group = resolve_tp_group(tp_group)
    validation.check_process_group(tp_group)
    tp_size = group_size(tp_group)
    validation.check_tensor("hidden", hidden)
    validation.check_tensor("weight", weight)
    token_labels = labels if labels is not None else _all_tokens(hidden, tp_size, sequence_parallel)
    validation.check_tensors(hidden, weight, token_labels)
    # Shapes may be wrong on one rank only: the shard-size collective carries that to every rank.
    layout_error = None
    try:
        validation.check_layout(hidden, weight, token_labels, tp_size, sequence_parallel)
    except ValueError as err:
        layout_error = err
    validation.check_equal_shards(weight, tp_group, layout_error)
    check_k(k, weight.shape[0] * tp_size)

    if sequence_parallel and tp_size > 1:
        hidden = all_gather_first_dim(hidden, tp_group)
    tokens = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    with autocast_off(hidden.device):
        values, ids, rest_max, rest_sum = _shard_topk(
            tokens, weight, k, temperature, vocab_start=group_rank(tp_group) * weight.shape[0]
        )
        top_values, top_ids, lse, tail_lse = merge_topk_over_ranks(values, ids, rest_max, rest_sum, k, tp_group)
    log_probs = top_values - lse[:, None]
    tail_log_mass = tail_lse - lse
    if labels is not None:
        valid = _token_order(labels.long(), labels.dim() == 2) != ignore_index
        top_ids = torch.where(valid[:, None], top_ids, torch.full_like(top_ids, ignore_index))
        log_probs = torch.where(valid[:, None], log_probs, torch.zeros_like(log_probs))
        tail_log_mass = torch.where(valid, tail_log_mass, torch.zeros_like(tail_log_mass))
    if hidden.dim() == 3:
        seq, batch = hidden.shape[:2]
        return TopK(
            top_ids.view(seq, batch, k).transpose(0, 1).contiguous(),
            log_probs.view(seq, batch, k).transpose(0, 1).contiguous(),
            tail_log_mass.view(seq, batch).t().contiguous(),
        )
    return TopK(top_ids, log_probs, tail_log_mass)


def _all_tokens(hidden: torch.Tensor, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """Labels of the call's layout with no token ignored, for the head's layout checks."""
    if hidden.dim() not in (2, 3):
        return torch.zeros(0, dtype=torch.int64, device=hidden.device)  # check_layout names hidden
    seq = hidden.shape[0] * (tp_size if sequence_parallel and tp_size > 1 else 1)
    shape = (hidden.shape[1], seq) if hidden.dim() == 3 else (seq,)
    return torch.zeros(shape, dtype=torch.int64, device=hidden.device)


def _token_order(values: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """Per-token ``values`` (labels' layout) in the tokens' order: ``[b, s]`` is sequence-major."""
    return values.t().reshape(-1) if batch_first else values.reshape(-1)


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


_MM_OUT_DTYPE = {"ok": True}  # torch.mm(..., out_dtype=) on this build's CUDA (probed once)


def _tempered_logits(x: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x @ w.T / T`` in the accumulation dtype (fp32; fp64 for fp64 inputs), a fresh tensor."""
    acc = torch.promote_types(x.dtype, torch.float32)
    if x.is_cuda and x.dtype != acc and _MM_OUT_DTYPE["ok"]:
        # One cuBLAS GEMM with 16-bit inputs and an fp32 output: no upcast copies.
        try:
            return torch.mm(x, w.t(), out_dtype=acc).div_(temperature)
        except (RuntimeError, TypeError):
            _MM_OUT_DTYPE["ok"] = False
    return torch.mm(x.to(acc), w.to(acc).t()).div_(temperature)


def _chunk_topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``z [n, c]`` per row and their columns, ties to the smaller column.

    ``torch.topk`` returns the right *values*, but among entries equal to the k-th value it may
    return any of them. Those slots are re-filled with the first columns holding that value:
    a running count of equal entries along the row is non-decreasing, so ``searchsorted`` finds
    the column of the 1st, 2nd, ... equal entry.
    """
    values, cols = torch.topk(z, k, dim=1)
    kth = values[:, -1:]
    above = (values > kth).sum(dim=1, keepdim=True)  # every entry above the k-th value is in
    equal_count = (z == kth).cumsum(dim=1, dtype=torch.int32)
    slot = torch.arange(k, device=z.device, dtype=torch.int32)[None, :]
    nth_equal = (slot - above.to(torch.int32) + 1).clamp(min=1)
    tie_cols = torch.searchsorted(equal_count, nth_equal).clamp(max=z.shape[1] - 1)
    cols = torch.where(slot >= above, tie_cols, cols)
    return z.gather(1, cols), cols


def _shard_topk(
    tokens: torch.Tensor, weight: torch.Tensor, k: int, temperature: float, *, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's candidates ``(values [n, c], ids [n, c])`` with ``c = min(k, V/tp)`` and the
    statistics ``(m [n], s [n])`` of the rest of its shard, one logits block at a time."""
    n, v = tokens.shape[0], weight.shape[0]
    acc = torch.promote_types(tokens.dtype, torch.float32)
    device = tokens.device
    c = min(k, v)
    values = torch.empty(n, c, dtype=acc, device=device)
    ids = torch.empty(n, c, dtype=torch.int64, device=device)
    rest_max = torch.empty(n, dtype=acc, device=device)
    rest_sum = torch.empty(n, dtype=acc, device=device)
    token_chunk, vocab_chunk = TOKEN_CHUNK, VOCAB_CHUNK
    for t0, t1 in _chunks(n, token_chunk):
        x = tokens[t0:t1]
        m = torch.full((t1 - t0,), -torch.inf, dtype=acc, device=device)
        s = torch.zeros(t1 - t0, dtype=acc, device=device)
        run_values = run_ids = None
        for v0, v1 in _chunks(v, vocab_chunk):
            z = _tempered_logits(x, weight[v0:v1], temperature)
            chunk_values, cols = _chunk_topk(z, min(k, v1 - v0))
            m, s = fold_into_statistics(m, s, z.scatter_(1, cols, -torch.inf))
            chunk_ids = cols.to(torch.int64) + (vocab_start + v0)
            if run_values is None:
                run_values, run_ids = chunk_values, chunk_ids
            else:
                run_values, run_ids, dropped = select_topk(
                    torch.cat([run_values, chunk_values], dim=1), torch.cat([run_ids, chunk_ids], dim=1), k
                )
                m, s = fold_into_statistics(m, s, dropped)
        values[t0:t1], ids[t0:t1], rest_max[t0:t1], rest_sum[t0:t1] = run_values, run_ids, m, s
    return values, ids, rest_max, rest_sum
