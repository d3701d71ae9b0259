"""The torch shard pass of the top-k (:mod:`mcore_ppo.distill.topk`'s ``impl="torch"``): the CPU
and fp64 path and the exactness reference of :mod:`mcore_ppo.distill.topk_triton`.

One rank's shard, one logits block of ``token_chunk × vocab_chunk`` at a time: per block the
``k`` largest (``torch.topk`` plus a deterministic repair of ties at the k-th value), merged
with the rank's running candidates; every entry that is not (or stops being) a candidate is
folded into the softmax statistics ``(m, s)`` of the shard's rest.
"""

from __future__ import annotations

import torch

from mcore_ppo.backends.fp32_gemms import fp32_output_gemms
from mcore_ppo.distill.topk_config import TopKConfig
from mcore_ppo.distill.topk_triton import ShardPass
from mcore_ppo.numerics import accumulation_dtype, chunks
from mcore_ppo.parallel.topk import fold_into_statistics, select_topk
from mcore_ppo.statistics import Statistics

__all__ = ["shard_topk_torch"]


def shard_topk_torch(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    *,
    vocab_start: int,
    config: TopKConfig,
    statistics: Statistics | None = None,
) -> ShardPass:
    """This rank's candidates ``(values [n, c], ids [n, c])`` with ``c = min(k, V/tp)``, the
    statistics ``(m [n], s [n])`` of the rest of its shard and, given ``statistics``, their planes
    over the whole shard (:meth:`Statistics.chunk <mcore_ppo.statistics.Statistics.chunk>` of each
    block, merged), one logits block of ``config.token_chunk × config.vocab_chunk`` at a time.
    ``temperature``: a float or ``T [n]`` per token (the accumulation dtype)."""
    n, v = tokens.shape[0], weight.shape[0]
    acc = accumulation_dtype(tokens.dtype)
    device = tokens.device
    c = min(k, v)
    values = torch.empty(n, c, dtype=acc, device=device)
    ids = torch.empty(n, c, dtype=torch.int64, device=device)
    rest_max = torch.empty(n, dtype=acc, device=device)
    rest_sum = torch.empty(n, dtype=acc, device=device)
    planes = None if statistics is None else torch.empty(statistics.n_planes, n, dtype=acc, device=device)
    for t0, t1 in chunks(n, config.token_chunk):
        x = tokens[t0:t1]
        rows_t = temperature[t0:t1, None] if isinstance(temperature, torch.Tensor) else temperature
        m = torch.full((t1 - t0,), -torch.inf, dtype=acc, device=device)
        s = torch.zeros(t1 - t0, dtype=acc, device=device)
        run_values = run_ids = whole = None
        for v0, v1 in chunks(v, config.vocab_chunk):
            z = _tempered_logits(x, weight[v0:v1], rows_t)
            if statistics is not None:
                part = statistics.chunk(z)
                whole = part if whole is None else statistics.merge(whole, part)
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
        if planes is not None:
            planes[0, t0:t1], planes[1:, t0:t1] = whole
    return ShardPass(values, ids, rest_max, rest_sum, planes)


def _tempered_logits(x: torch.Tensor, w: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``x @ w.T / T`` in the accumulation dtype (fp32; fp64 for fp64 inputs), a fresh tensor;
    ``T`` a float or the rows' ``[c, 1]`` column."""
    acc = accumulation_dtype(x.dtype)
    # One cuBLAS GEMM with 16-bit inputs and an fp32 output where this torch has it (decided
    # once, by capability: an error of the real product, out of memory above all, propagates);
    # else the operands upcast first, the same fp32 products.
    if x.is_cuda and x.dtype != acc and fp32_output_gemms(x.device.type)[0]:
        return torch.mm(x, w.t(), out_dtype=acc).div_(temperature)
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
