"""Host side of the teacher's top-k on the head's statistics kernel (:mod:`mcore_ppo.kernels.topk`).

One rank's shard pass in three steps, each row's result exact (the same ids as the torch path):

1. the head's statistics pass (``stats_kernel`` with ``TOPK_C``) over every row: per (row, logits
   tile) its ``C`` largest entries and its rest's ``(m, s)``, beside the statistics the caller
   asks for (the ``lse``, the entropy, Σπ²: one read of the vocab for the top-k and the head);
2. the selection: each row's top ``min(k, V/tp)`` of its tiles' candidates, in the tie rule's
   order, and the rest summed from its own terms;
3. the few *full* tiles (every candidate in the top, its rest reaching the top's last value: it
   may hide more of the top) recomputed whole and merged in.

``C`` comes from :func:`~mcore_ppo.distill.topk_config.candidates_per_tile`: the expected full
tiles per row on random logits against the cost of one more candidate.
No host sync anywhere: a row has at most ``k // C`` full tiles, so their recompute has fixed
slots and runs whether or not a tile is full.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mcore_ppo.backends.triton_host import (
    GemmConfig,
    descriptor_ok,
    interpreting,
    kernel_flags,
    merge_options,
    merge_splits,
    operands_by_tma,
)
from mcore_ppo.backends.triton_launch import BoundLauncher, Launcher
from mcore_ppo.distill.topk_config import DEFAULT_CONFIG, TopKConfig, candidates_per_tile, full_tiles_cap
from mcore_ppo.numerics import Numerics, cdiv, chunks, inverse_temperature, next_power_of_two, rowmajor
from mcore_ppo.statistics import Statistics

#: What the kernel reduces beside the top-k when the caller asks for no statistics.
_SUM_EXP = Statistics.named([])

#: Dtypes the kernels take (fp64 stays on the torch path).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Shard = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ShardPass(NamedTuple):
    """One rank's shard pass: its top candidates, the statistics of its rest, and (when asked
    for) the head's statistics of the whole shard."""

    values: torch.Tensor  # [n, c] fp32, largest first
    ids: torch.Tensor  # [n, c] int64 global ids
    rest_max: torch.Tensor  # [n] the rest's max
    rest_sum: torch.Tensor  # [n] and Σ exp(z - max) over it
    planes: torch.Tensor | None  # [statistics.n_planes, n]: the shard's max, then each term's sum


# The top-k's launches carry no site key: each takes Triton's own dispatch (the launcher counts them).
_LAUNCHER = Launcher()
Inverse = tuple[float, torch.Tensor, bool]


def _flags(tokens: torch.Tensor, cfg: GemmConfig) -> dict:
    """The GEMM flags of the teacher's top-k: its operands' own numerics (``precision="auto"``)."""
    return kernel_flags(tokens, cfg, Numerics.of(tokens.dtype, "auto"))


def runnable(hidden: torch.Tensor) -> bool:
    """The kernels can run these inputs here: a kernel dtype, a CUDA tensor or the interpreter,
    and triton installed."""
    return hidden.dtype in TRITON_DTYPES and (hidden.is_cuda or interpreting()) and _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def shard_topk_triton(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    *,
    vocab_start: int,
    config: TopKConfig,
    statistics: Statistics | None = None,
) -> ShardPass:
    """The torch shard pass's outputs (``c = min(k, V/tp)`` candidates with global ids, the
    rest's ``(m, s)``, and ``statistics``' planes of the shard when given) from the head's
    statistics kernel with its top-k on, token chunk by token chunk: as many rows per launch as
    keep its scratch within ``config.scratch_bytes``."""
    n, v = tokens.shape[0], weight.shape[0]
    c = min(k, v)
    device = tokens.device
    tokens, weight = rowmajor(tokens), rowmajor(weight)
    cfg = config.gemm(tokens.dtype)
    launch = _LAUNCHER.bound()
    # Per row: the tiles' candidates and rests, the slots of its full tiles' recompute, and its
    # place in the full pairs' lists by tile (one int32 per tile).
    num_tiles = cdiv(v, cfg.block_n)
    candidates = num_tiles * (8 * candidates_per_tile(num_tiles, c, config) + 8)
    per_row = candidates + full_tiles_cap(num_tiles, c, config) * cfg.block_n * 4 + num_tiles * 4
    chunk = max(cfg.block_m, config.scratch_bytes // per_row // cfg.block_m * cfg.block_m)
    if 0 < n <= chunk:  # one launch: its outputs are the shard's
        out = _triton_chunk(tokens, weight, k, temperature, cfg, config, statistics, launch)
        if vocab_start:
            out.ids.add_(vocab_start)
        return out
    values = torch.empty(n, c, dtype=torch.float32, device=device)
    ids = torch.empty(n, c, dtype=torch.int64, device=device)
    rest = torch.empty(2, n, dtype=torch.float32, device=device)
    planes = None if statistics is None else torch.empty(statistics.n_planes, n, dtype=torch.float32, device=device)
    for t0, t1 in chunks(n, chunk):
        row_t = temperature[t0:t1] if isinstance(temperature, torch.Tensor) else temperature
        out = _triton_chunk(tokens[t0:t1], weight, k, row_t, cfg, config, statistics, launch)
        values[t0:t1], ids[t0:t1], rest[0, t0:t1], rest[1, t0:t1] = out[:4]
        if planes is not None:
            planes[:, t0:t1] = out.planes
    ids += vocab_start
    return ShardPass(values, ids, rest[0], rest[1], planes)


class _Tiles(NamedTuple):
    """The kernel's per-(row, tile) outputs (see :mod:`mcore_ppo.kernels.topk`)."""

    values: torch.Tensor  # [n, tiles · C] fp32, per tile largest first
    cols: torch.Tensor  # [n, tiles · C] int32 shard columns
    rest_m: torch.Tensor  # [n, tiles] the tile's other entries: max
    rest_s: torch.Tensor  # [n, tiles] and Σ exp(z - max)


def _triton_chunk(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    cfg: GemmConfig,
    config: TopKConfig,
    statistics: Statistics | None,
    launch: BoundLauncher,
) -> ShardPass:
    """One launch of the statistics kernel over ``tokens [n, h]`` (``temperature`` a float or
    ``T [n]``), every row valid, with ``C`` candidates per tile: the top ``min(k, V)`` in the tie
    rule's order, shard-local ids, the rest's ``(m, s)``, and ``statistics``' planes merged over
    the vocab splits (None: not asked for; the kernel reduces ``sum_exp`` alone then)."""
    from mcore_ppo import kernels

    n, h = tokens.shape
    v = weight.shape[0]
    device = tokens.device
    num_tiles = cdiv(v, cfg.block_n)
    splits = cdiv(num_tiles, cfg.tiles_per_split) if config.splits is None else max(1, min(config.splits, num_tiles))
    tiles_per_split = cdiv(num_tiles, splits)
    splits = cdiv(num_tiles, tiles_per_split)
    c = candidates_per_tile(num_tiles, min(k, v), config)
    reduced = _SUM_EXP if statistics is None else statistics
    values = torch.empty(n, num_tiles * c, dtype=torch.float32, device=device)
    cols = torch.empty(n, num_tiles * c, dtype=torch.int32, device=device)
    rest = torch.empty(2, n, num_tiles, dtype=torch.float32, device=device)
    parts = torch.empty(reduced.n_planes, splits, n, dtype=torch.float32, device=device)
    # Every row counts; the pass has no labels (the kernel reads none under TOPK_C).
    perm = torch.arange(n, dtype=torch.int32, device=device)
    count = torch.full((1,), n, dtype=torch.int32, device=device)
    use_tma = operands_by_tma(tokens, weight, cfg)
    if use_tma and not (tokens.is_contiguous() and descriptor_ok(tokens)):
        tokens = tokens.contiguous()  # the kernel's row descriptor reads [n, h] contiguous rows
    # A float temperature's never-read row pointer is the rest buffer itself (a view costs host time).
    inv_temp, inv_temp_rows, row_temp = inverse_temperature(temperature, rest)
    launch(
        kernels.stats_kernel,
        (cdiv(n, cfg.block_m) * splits,),
        (tokens, tokens, weight, perm, count, perm, parts, rest, rest, rest, n, v, h, tokens.stride(0),
         weight.stride(0), splits, inv_temp, num_tiles, inv_temp_rows, values, cols, rest, rest, rest),
        dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TILES_PER_SPLIT=tiles_per_split,
            GROUP_M=cfg.group_m, USE_TMA=use_tma, STORE_P=False, BUF_TMA=False, DIRECT_ROWS=False,
            **_flags(tokens, cfg), ROW_TEMP=row_temp, **reduced.kernel_options(), TOPK_C=c, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **config.register_cap(),
        ),
    )  # fmt: skip
    planes = None
    if statistics is not None:
        planes = merge_splits(parts, perm, count, launch, options=merge_options(statistics))
    tiles = _Tiles(values, cols, rest[0], rest[1])
    inverse = (inv_temp, inv_temp_rows, row_temp)  # the recompute takes the same roundings
    top = _select_from_tiles(tokens, weight, tiles, min(k, v), inverse, cfg, config, launch)
    return ShardPass(*top, planes)


def _select_from_tiles(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    tiles: _Tiles,
    c_out: int,
    inverse: Inverse,
    cfg: GemmConfig,
    config: TopKConfig,
    launch: BoundLauncher,
) -> Shard:
    """The exact top ``c_out`` of a shard from its tiles' candidates, and the rest's ``(m, s)``;
    ``inverse``: the statistics kernel's :func:`~mcore_ppo.numerics.inverse_temperature`, for the
    recompute.

    :func:`~mcore_ppo.kernels.topk.select_top_kernel` takes each row's top ``c_out`` of the
    candidates in the tie rule's order; its last value ``b`` bounds the true top ``c_out`` from
    below. A tile's unkept entries are at most its rest's max, so only *full* tiles (rest max
    ``>= b``, every candidate in the top) can hide one: those (row, tile) pairs are recomputed
    whole (:func:`_recompute_full_tiles`) and merged in place of the tile's candidates
    (:func:`_merge_full_tiles`). The rest is summed from its own terms, each row in a fixed
    order: the unselected candidates and the tiles' rests outside full tiles, then the entries
    the merge drops. No host sync: a row has at most ``c_out // C`` full tiles, so their pairs
    have fixed slots (``[n, cap]``), and the recompute and the merge run whether or not any
    tile is full (a row or work item without one returns at once).
    """
    from mcore_ppo.kernels.topk import select_top_kernel

    n, width = tiles.values.shape
    values, cols = tiles.values, tiles.cols
    if width < c_out:  # a tiny shard, fewer candidates than wanted: the bound is -inf below
        pad = c_out - width
        values = torch.cat([values, values.new_full((n, pad), -torch.inf)], dim=1)
        cols = torch.cat([cols, cols.new_zeros(n, pad)], dim=1)
        width = c_out
    num_tiles = tiles.rest_m.shape[1]
    cap = full_tiles_cap(num_tiles, c_out, config)
    device = values.device
    top_values = torch.empty(n, c_out, dtype=torch.float32, device=device)
    top_cols = torch.empty(n, c_out, dtype=torch.int64, device=device)
    full = torch.empty(n, num_tiles, dtype=torch.int8, device=device)
    full_rows = torch.empty(n, dtype=torch.int32, device=device)
    full_list = torch.empty(n, max(cap, 1), dtype=torch.int32, device=device)
    rest_m = torch.empty(n, dtype=torch.float32, device=device)
    rest_s = torch.empty_like(rest_m)
    block_w = next_power_of_two(width)
    block_r = config.select_rows()
    by_sort = config.keys_by_sort()
    # On a GPU a warp per 512 candidates, up to 4 (the fastest on the H200 at 375, 2970 and 5120).
    launch(
        select_top_kernel,
        (cdiv(n, block_r),),
        (values, cols, tiles.rest_m, tiles.rest_s, top_values, top_cols, full, full_rows, full_list, rest_m, rest_s,
         n, width, c_out, num_tiles, max(cap, 1), width, 0),
        dict(
            C=candidates_per_tile(num_tiles, c_out, config), BLOCK_R=block_r, BLOCK_W=block_w,
            BLOCK_T=next_power_of_two(num_tiles), TOP=next_power_of_two(c_out), BY_SORT=by_sort,
            num_warps=max(1, min(4, block_w // 512)),
        ),
    )  # fmt: skip
    if cap and n:
        # The rest so far holds every entry outside full tiles that ranks after the top's last;
        # the merge folds in the top's and the full tiles' entries that drop out of it.
        recomputed = _recompute_full_tiles(
            tokens, weight, full, full_list.shape[1], inverse, cfg, config.recompute_block(), launch
        )
        _merge_full_tiles(
            top_values, top_cols, full, full_rows, full_list, recomputed, rest_m, rest_s, weight, cfg, by_sort, launch
        )
    return top_values, top_cols, rest_m, rest_s


def select_merged(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' merge by the selection kernel (:data:`mcore_ppo.parallel.topk.SelectTop`):
    each row's top ``k`` of ``values [n, ranks, c]`` (fp32) and their ``ids [n, ranks, c]``
    (int32 or int64, the same strides), and the log-sum-exp of the rest, for every rank's
    candidates in the tie rule's order (this pass's output). The kernel reads them where they
    are (each rank's ``c`` contiguous; the all-gather's layout, no copy into rows) and, among
    equal values, takes them by position, which is then the ids' order (a rank's ids are below
    the next rank's). One launch: the whole row as one tile with no rest, so no tile is full."""
    from mcore_ppo.kernels.topk import select_top_kernel

    n, ranks, per_rank = values.shape
    if values.stride(2) != 1 or ids.stride() != values.stride():
        raise ValueError(
            "select_merged needs each rank's candidates contiguous and ids laid out as values, got strides "
            f"{values.stride()} and {ids.stride()}"
        )
    width = ranks * per_rank
    device = values.device
    top_values = torch.empty(n, k, dtype=torch.float32, device=device)
    top_ids = torch.empty(n, k, dtype=torch.int64, device=device)
    no_rest_max = torch.full((n, 1), -math.inf, dtype=torch.float32, device=device)
    no_rest_sum = torch.zeros(n, 1, dtype=torch.float32, device=device)
    full = torch.empty(n, 1, dtype=torch.int8, device=device)
    full_rows = torch.empty(n, dtype=torch.int32, device=device)
    full_list = torch.empty(n, 1, dtype=torch.int32, device=device)
    rest = torch.empty(2, n, dtype=torch.float32, device=device)
    block_w = next_power_of_two(width)
    block_r = DEFAULT_CONFIG.select_rows()
    if not n:
        return top_values, top_ids, rest[0]
    _LAUNCHER.bound()(
        select_top_kernel,
        (cdiv(n, block_r),),
        (values, ids, no_rest_max, no_rest_sum, top_values, top_ids, full, full_rows, full_list, rest[0], rest[1],
         n, width, k, 1, 1, values.stride(0), values.stride(1)),
        dict(
            C=width, BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_T=1, TOP=next_power_of_two(k),
            BY_SORT=DEFAULT_CONFIG.keys_by_sort(), PART=per_rank, num_warps=max(1, min(4, block_w // 512)),
        ),
    )  # fmt: skip
    return top_values, top_ids, rest[0] + torch.log(rest[1])


def _recompute_full_tiles(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    full: torch.Tensor,
    cap: int,
    inverse: Inverse,
    cfg: GemmConfig,
    block: int,
    launch: BoundLauncher,
) -> torch.Tensor:
    """``z [n·cap, BLOCK_N]``: slot ``r·cap + j`` holds row ``r``'s whole ``j``-th full tile
    (``full [n, tiles]``: 0, or 1 + that place ``j``; ``-inf`` past the shard), as the tiles
    kernel computes it (with its ``inverse`` temperature); other slots are left unwritten. Two
    launches and no host sync: the pairs listed by tile, then the tiles recomputed, each in work
    items of at most ``block`` rows, on a grid of the most items the slots could need (those
    past the last find no pairs)."""
    from mcore_ppo.kernels.topk import full_pairs_kernel, tile_rows_kernel

    n, h = tokens.shape
    v = weight.shape[0]
    slots = n * cap
    device = tokens.device
    num_tiles = full.shape[1]
    counts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    pair_slot = torch.empty(num_tiles, n, dtype=torch.int32, device=device)
    launch(
        full_pairs_kernel,
        (num_tiles,),
        (full, counts, pair_slot, n, num_tiles, cap),
        dict(BLOCK_R=16 if interpreting() else 4096, num_warps=8),
    )
    z = torch.empty(slots, cfg.block_n, dtype=torch.float32, device=device)
    inv_temp, inv_temp_rows, row_temp = inverse
    launch(
        tile_rows_kernel,
        (cdiv(slots, block) + min(num_tiles, slots),),
        (tokens, weight, counts, pair_slot, z, n, v, h, tokens.stride(0), weight.stride(0), num_tiles, cap,
         inv_temp, inv_temp_rows),
        dict(
            BLOCK_M=block, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_T=next_power_of_two(num_tiles),
            num_warps=min(4, cfg.num_warps), num_stages=cfg.num_stages, **_flags(tokens, cfg),
            **({"ROW_TEMP": True} if row_temp else {}),
        ),
    )  # fmt: skip
    return z


def _merge_full_tiles(
    top_values: torch.Tensor,
    top_cols: torch.Tensor,
    full: torch.Tensor,
    full_rows: torch.Tensor,
    full_list: torch.Tensor,
    recomputed: torch.Tensor,
    rest_m: torch.Tensor,
    rest_s: torch.Tensor,
    weight: torch.Tensor,
    cfg: GemmConfig,
    by_sort: bool,
    launch: BoundLauncher,
) -> None:
    """In place, for the rows with full tiles: the top over the entries outside full tiles and the
    recomputed tiles' (in the tie rule's order), and the entries that drop out of it folded into
    the rest (:func:`~mcore_ppo.kernels.topk.merge_full_kernel`, one program per row; a row
    without a full tile returns at once)."""
    from mcore_ppo.kernels.topk import merge_full_kernel

    n, c_out = top_values.shape
    top = next_power_of_two(c_out)
    launch(
        merge_full_kernel,
        (n,),
        (top_values, top_cols, full, full_rows, full_list, recomputed, rest_m, rest_s, n, weight.shape[0], c_out,
         full.shape[1], full_list.shape[1]),
        dict(BLOCK_N=cfg.block_n, TOP=top, BLOCK_U=next_power_of_two(top + cfg.block_n), BY_SORT=by_sort),
    )  # fmt: skip
