"""Teacher top-k kernels: the exact top ``K`` of each row from its logit tiles' candidates.

The candidates come from the head's statistics pass (:func:`mcore_ppo.kernels.forward.stats_kernel`
with ``TOPK_C = C``): per (row, ``[BLOCK_M, BLOCK_N]`` tile of ``z = x @ W.T / T``) the tile's ``C``
largest entries (value, column), largest first, equal values by the smaller column (the tie
rule), and ``(m, s)`` of the tile's other entries (``m`` their max, ``s = Σ exp(z - m)``): the
tail mass is then a sum of its own terms, never a difference of totals. Every output is a pure
function of its tile: no atomics, the same bits on every run.

``select_top_kernel`` takes each row's top ``K`` of all its tiles' candidates (one program per
row, a bisection over the values' bits, no sort of the candidates) and sums the row's rest from
its own terms. Any entry of the top ``K`` that a tile did not keep lies in a tile whose rest's
max reaches the candidates' ``K``-th and whose candidates all made the top (a *full* tile: at
most ``K // C`` per row). Those few (row, tile) pairs are listed by tile
(``full_pairs_kernel``), recomputed whole by ``tile_rows_kernel`` (one weight tile serves up to
``BLOCK_M`` gathered rows) and merged into the row's top by ``merge_full_kernel`` (one sort by a
packed int64 key per tile).

``ROW_TEMP`` (constexpr, default off) reads ``1/T`` per row from ``inv_temp_ptr`` (fp32, each the
rounding of the exact ``1/T_i``) instead of the scalar ``inv_temp``, as the head's kernels do.
"""

import triton
import triton.language as tl

from mcore_ppo.kernels.common import key_col, key_value, order_key, ordered_bits, tile_dot, value_of_bits

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["N", "num_tiles", "CAP"])
def full_pairs_kernel(full_ptr, counts_ptr, pair_slot_ptr, N, num_tiles, CAP, BLOCK_R: tl.constexpr):
    """The full (row, tile) pairs grouped by tile, one program per tile: the rows whose tile
    ``t`` is full (``full [N, num_tiles]``, int8: 0, or 1 + the tile's place ``j`` among the
    row's full tiles), ascending, as their slots ``r·CAP + j`` into ``pair_slot [num_tiles, N]``,
    and their count into ``counts [num_tiles]``. A count per tile and a fixed order, without
    atomics: the same lists on every run."""
    t = tl.program_id(0)
    count = tl.zeros((), tl.int32)
    for r0 in range(0, N, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        place = tl.load(full_ptr + rows.to(tl.int64) * num_tiles + t, mask=rows < N, other=0).to(tl.int32) - 1
        flag = place >= 0
        pair = count + tl.cumsum(flag.to(tl.int32), 0) - 1
        tl.store(pair_slot_ptr + t.to(tl.int64) * N + pair, rows * CAP + place, mask=flag & (place < CAP))
        count += tl.sum(flag.to(tl.int32), 0)
    tl.store(counts_ptr + t, count)


@triton.jit(do_not_specialize=["N", "V", "num_tiles", "CAP"], do_not_specialize_on_alignment=["inv_temp_ptr"])
def tile_rows_kernel(
    x_ptr,
    w_ptr,
    counts_ptr,
    pair_slot_ptr,
    out_ptr,
    N,
    V,
    H,
    stride_x,
    stride_w,
    num_tiles,
    CAP,
    inv_temp,
    inv_temp_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT: tl.constexpr,
    ROW_TEMP: tl.constexpr = False,
):
    """Whole tiles for listed rows (:func:`full_pairs_kernel`'s lists): work items run tile by
    tile, ``ceil(counts[t] / BLOCK_M)`` for tile ``t``, each over ``BLOCK_M`` of its pairs (one
    weight tile serves them all); the grid may hold more items than that, which return at once.
    Writes ``z`` of each pair's row over the tile's ``BLOCK_N`` columns to row ``slot`` of
    ``out [N·CAP, BLOCK_N]`` (``-inf`` past ``V``), computed as the statistics kernel's candidates
    are (the same tiles, K order and roundings: the same bits)."""
    item = tl.program_id(0)
    tiles = tl.arange(0, BLOCK_T)
    counts = tl.load(counts_ptr + tiles, mask=tiles < num_tiles, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    tile = tl.sum((ends <= item).to(tl.int32), 0)  # the tile whose items reach past this one
    if tile < num_tiles:
        own = tiles == tile
        start = (item - tl.sum(tl.where(own, ends - blocks, 0), 0)) * BLOCK_M
        pairs = start + tl.arange(0, BLOCK_M)
        pair_ok = pairs < tl.sum(tl.where(own, counts, 0), 0)
        slots = tl.load(pair_slot_ptr + tile.to(tl.int64) * N + pairs, mask=pair_ok, other=0)
        rows = slots // CAP
        local = tl.arange(0, BLOCK_N)
        n0 = tile * BLOCK_N
        offs_n = n0 + local
        col_ok = offs_n < V
        acc = tile_dot(
            x_ptr, w_ptr, x_ptr, w_ptr, rows, tl.minimum(offs_n, V - 1), 0, n0, H, stride_x, stride_w, x_ptr,
            w_ptr, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, DOT, False,
        )  # fmt: skip
        # z₂ = acc·(1/T)·log2 e, then z₂·ln 2: the statistics kernel's candidates, bit for bit.
        if ROW_TEMP:
            scale2 = (tl.load(inv_temp_ptr + rows) * LOG2E)[:, None]
        else:
            scale2 = inv_temp * LOG2E
        z = tl.where(col_ok[None, :], (acc * scale2) * LN2, float("-inf"))
        dest = slots.to(tl.int64)[:, None] * BLOCK_N + local[None, :]
        tl.store(out_ptr + dest, z, mask=pair_ok[:, None])


# The strides unspecialised: told their divisibility, Triton 3.6 vectorises the candidates' loads
# into a layout whose tl.cumsum it fails to lower (scripts/compile_check.sh).
@triton.jit(do_not_specialize=["N", "W", "K", "num_tiles", "CAP", "stride_row", "stride_part"])
def select_top_kernel(
    cand_v_ptr,
    cand_c_ptr,
    rest_m_ptr,
    rest_s_ptr,
    top_v_ptr,
    top_c_ptr,
    full_ptr,
    full_rows_ptr,
    full_list_ptr,
    m_out_ptr,
    s_out_ptr,
    N,
    W,
    K,
    num_tiles,
    CAP,
    stride_row,
    stride_part,
    C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TOP: tl.constexpr,
    BY_SORT: tl.constexpr = True,
    PART: tl.constexpr = 0,
):
    """Each row's top ``K`` of its ``W`` candidates (``cand_v`` / ``cand_c`` ``[N, W]``, tile by
    tile, each tile's ``C`` in the tie rule's order), with the tiles' rests ``(rest_m, rest_s)``
    ``[N, num_tiles]``. ``BLOCK_R`` rows per program, each row whole in registers.

    The candidates are read at ``row · stride_row + position`` (``stride_row = W``: rows
    contiguous), or with ``PART`` as ``[N, W / PART, PART]`` at ``row · stride_row + (position //
    PART) · stride_part + position % PART``: the ranks' candidates where the all-gather left
    them (each rank's ``PART`` of a row contiguous), with no copy into rows. ``cand_c`` may be
    int32 or int64; ``top_c`` is int64.

    The ``K``-th largest value is found by bisection over its order-preserving int32 bits (at
    most 32 counting passes); equal values at it are taken by position, which for equal values
    is the columns' order (tiles in order, each tile's candidates by the tie rule). Writes the
    top in the tie rule's order to ``top_v`` / ``top_c`` ``[N, K]`` (int64 shard columns); the
    *full* tiles (rest max ``>=`` the top's last value and every candidate in the top: they may
    hide more of the top; at most ``K // C`` per row) to ``full [N, num_tiles]`` (int8: 0, or
    1 + the tile's place among the row's full tiles), their count to ``full_rows [N]`` and
    their tiles, ascending, to ``full_list [N, CAP]`` (int32, ``CAP >= min(num_tiles, K //
    C)``); and the ``(m, s)`` of the entries outside the top and outside full tiles
    (unselected candidates, then the tiles' rests) to ``m_out`` / ``s_out``: a fixed reduction
    order, the same bits on every run."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    r = rows.to(tl.int64)[:, None]
    pos = tl.arange(0, BLOCK_W)[None, :]
    present = row_ok[:, None] & (pos < W)
    v = tl.load(cand_v_ptr + _at(r, pos, stride_row, stride_part, PART), mask=present, other=float("-inf"))
    # Absent slots rank below every entry (-inf's bits are above the smallest int32).
    u = tl.where(present, ordered_bits(v), -2147483648)
    # lo: the K-th largest, by bisection; a row stops early at a threshold with exactly K
    # entries at or above it (the K-th is then their smallest), which random logits reach in
    # about half of the 32 steps.
    lo = tl.full((BLOCK_R,), -2147483648, tl.int64)
    hi = tl.full((BLOCK_R,), 2147483647, tl.int64)
    active = row_ok
    while tl.max(active.to(tl.int32), 0) > 0:
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum((u >= mid.to(tl.int32)[:, None]).to(tl.int32), 1)
        lo = tl.where(active & (count >= K), mid, lo)
        hi = tl.where(active & (count < K), mid - 1, hi)
        active = active & (count != K) & (hi > lo)
    at_least = present & (u >= lo.to(tl.int32)[:, None])
    kth = tl.min(tl.where(at_least, u, 2147483647), 1)[:, None]
    chosen = at_least
    # The last position taken among the values equal to the K-th (all of them when none is left out).
    cutoff = tl.full((BLOCK_R,), BLOCK_W, tl.int32)
    excess = tl.sum(at_least.to(tl.int32), 1) - K
    if tl.max(excess, 0) > 0:  # equal values at the K-th beyond the places left: by position
        tied = present & (u == kth)
        places = tl.sum(tied.to(tl.int32), 1) - excess
        chosen = (u > kth) | (tied & (tl.cumsum(tied.to(tl.int32), 1) <= places[:, None]))
        cutoff = tl.max(tl.where(chosen & tied, pos, -1), 1)
    bound = value_of_bits(kth)

    # A tile can hide an entry of the top only if its rest reaches the bound and all its C
    # candidates are in the top: were one left out, every hidden entry would rank after it
    # (smaller, or equal with a larger column), so after the whole top. Each full tile thus
    # holds C entries of the top: at most K // C full tiles per row, whatever the ties. A
    # tile's candidates are all in the top when its last one is (the tie rule's order).
    tiles = tl.arange(0, BLOCK_T)[None, :]
    tile_ok = row_ok[:, None] & (tiles < num_tiles)
    rm = tl.load(rest_m_ptr + r * num_tiles + tiles, mask=tile_ok, other=float("-inf"))
    rs = tl.load(rest_s_ptr + r * num_tiles + tiles, mask=tile_ok, other=0.0)
    last = tiles * C + (C - 1)
    last_v = tl.load(cand_v_ptr + _at(r, last, stride_row, stride_part, PART), mask=tile_ok, other=float("-inf"))
    last_u = ordered_bits(last_v)
    last_in_top = (last_u > kth) | ((last_u == kth) & (last <= cutoff[:, None]))
    full = (rm >= bound) & (rm > float("-inf")) & last_in_top & tile_ok
    full_count = tl.sum(full.to(tl.int32), 1)
    slot = tl.cumsum(full.to(tl.int32), 1) - 1
    tl.store(full_ptr + r * num_tiles + tiles, tl.where(full, slot + 1, 0).to(tl.int8), mask=tile_ok)
    tl.store(full_rows_ptr + rows, full_count, mask=row_ok)
    tl.store(full_list_ptr + r * CAP + slot, tiles, mask=full & (slot < CAP))

    # The rest: unselected candidates outside full tiles, then the other tiles' rests.
    loose = present & ~chosen
    if tl.max(full_count, 0) > 0:  # rare: each candidate's tile looked up
        tl.debug_barrier()  # the flags just stored
        own_tile = r * num_tiles + tl.minimum(pos // C, num_tiles - 1)
        loose = loose & (tl.load(full_ptr + own_tile, mask=present, other=0) == 0)
    loose = tl.where(loose, v, float("-inf"))
    rm = tl.where(full, float("-inf"), rm)
    m = tl.maximum(tl.max(loose, 1), tl.max(rm, 1))
    ref = tl.where(m == float("-inf"), 0.0, m)[:, None]
    s = tl.sum(tl.exp2((loose - ref) * LOG2E), 1) + tl.sum(rs * tl.exp2((rm - ref) * LOG2E), 1)
    tl.store(m_out_ptr + rows, m, mask=row_ok)
    tl.store(s_out_ptr + rows, s, mask=row_ok)

    # The top in the tie rule's order: staged by position, reloaded, ordered by (value, position).
    slot = tl.cumsum(chosen.to(tl.int32), 1) - 1
    tl.store(top_v_ptr + r * K + slot, v, mask=chosen)
    tl.store(top_c_ptr + r * K + slot, pos.to(tl.int64), mask=chosen)
    tl.debug_barrier()
    offs = tl.arange(0, TOP)[None, :]
    in_top = row_ok[:, None] & (offs < K)
    staged_v = tl.load(top_v_ptr + r * K + offs, mask=in_top, other=float("-inf"))
    staged_p = tl.load(top_c_ptr + r * K + offs, mask=in_top, other=0)
    key = tl.where(in_top, order_key(staged_v, staged_p), -9223372036854775807 - 1)
    key = _descending(key, BY_SORT)
    col = tl.load(cand_c_ptr + _at(r, key_col(key), stride_row, stride_part, PART), mask=in_top, other=0)
    tl.debug_barrier()
    tl.store(top_v_ptr + r * K + offs, key_value(key), mask=in_top)
    tl.store(top_c_ptr + r * K + offs, col.to(tl.int64), mask=in_top)


@triton.jit
def _at(r, pos, stride_row, stride_part, PART: tl.constexpr):
    """The offset of row ``r``'s candidate at ``pos`` (:func:`select_top_kernel`'s layouts)."""
    if PART:
        return r * stride_row + (pos // PART).to(tl.int64) * stride_part + pos % PART
    return r * stride_row + pos


@triton.jit
def _descending(key, BY_SORT: tl.constexpr):
    """Each row of distinct int64 ``key [rows, cols]`` in descending order: by ``tl.sort``, or
    (``BY_SORT`` off) slot ``i`` takes the key with ``i`` larger ones, by two reductions over
    ``[rows, cols, cols]``: the same order, far cheaper than a sort in the interpreter."""
    if BY_SORT:
        return tl.sort(key, 1, descending=True)
    slots = tl.arange(0, key.shape[1])
    rank = tl.sum((key[:, None, :] > key[:, :, None]).to(tl.int32), 2)
    match = rank[:, None, :] == slots[None, :, None]
    return tl.max(tl.where(match, key[:, None, :], -9223372036854775807 - 1), 2)


@triton.jit(do_not_specialize=["N", "V", "K", "num_tiles", "CAP"])
def merge_full_kernel(
    top_v_ptr,
    top_c_ptr,
    full_ptr,
    full_rows_ptr,
    full_list_ptr,
    z_ptr,
    rest_m_ptr,
    rest_s_ptr,
    N,
    V,
    K,
    num_tiles,
    CAP,
    BLOCK_N: tl.constexpr,
    TOP: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BY_SORT: tl.constexpr = True,
):
    """Row ``r``'s top ``K`` (``top_v`` / ``top_c`` ``[N, K]``, in any order) merged, in place,
    with the whole recomputed tiles of its ``full_rows[r]`` full pairs: pair ``p`` in
    ``[r·CAP, r·CAP + full_rows[r])`` is tile ``full_list[p]`` (``[N, CAP]`` flat), its values
    ``z [p, BLOCK_N]``. The row's entries that lie in full tiles (``full [N, num_tiles]``, int8)
    give way to the tiles' own. Writes the top in the tie rule's order,
    and folds every merged entry that drops out into the row's ``(rest_m, rest_s)``. A row with
    no full tile returns at once. Each step orders ``TOP`` kept keys and one tile's by one int64
    key (``BLOCK_U >= TOP + BLOCK_N``), in a fixed order: the same bits on every run; by
    ``tl.sort`` (``BY_SORT``), or by counting each key's larger ones (the same result).
    Invalid keys are the smallest int64, which no entry's key is (its top 32 bits would be a
    NaN's)."""
    r = tl.program_id(0)
    start = r.to(tl.int64) * CAP
    end = start + tl.load(full_rows_ptr + r)
    if end > start:
        offs = tl.arange(0, BLOCK_U)
        in_top = offs < K
        base = r.to(tl.int64) * K
        value = tl.load(top_v_ptr + base + offs, mask=in_top, other=float("-inf"))
        col = tl.load(top_c_ptr + base + offs, mask=in_top, other=0)
        in_full = tl.load(full_ptr + r.to(tl.int64) * num_tiles + col // BLOCK_N, mask=in_top, other=1) != 0
        valid = in_top & ~in_full
        key = tl.where(valid, order_key(value, col), 0)
        m = tl.load(rest_m_ptr + r)
        s = tl.load(rest_s_ptr + r)
        j = offs - TOP
        in_tile = (j >= 0) & (j < BLOCK_N)
        for p in range(start, end):
            tile = tl.load(full_list_ptr + p)
            tile_col = tile * BLOCK_N + j
            from_tile = in_tile & (tile_col < V)
            z = tl.load(z_ptr + p * BLOCK_N + j, mask=from_tile, other=float("-inf"))
            key = tl.where(from_tile, order_key(z, tile_col), key)
            valid = valid | from_tile
            # The valid keys in descending order first: the others hold the smallest int64.
            key = tl.where(valid, key, -9223372036854775807 - 1)
            key = tl.reshape(_descending(tl.reshape(key, (1, BLOCK_U)), BY_SORT), (BLOCK_U,))
            valid = key != -9223372036854775807 - 1
            drop = valid & (offs >= K)
            dropped = tl.where(drop, key_value(key), float("-inf"))
            m_new = tl.maximum(m, tl.max(dropped, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2((m - ref) * LOG2E) + tl.sum(tl.exp2((dropped - ref) * LOG2E), 0)
            m = m_new
            valid = valid & (offs < K)
        tl.store(top_v_ptr + base + offs, key_value(key), mask=in_top)
        tl.store(top_c_ptr + base + offs, key_col(key), mask=in_top)
        tl.store(rest_m_ptr + r, m)
        tl.store(rest_s_ptr + r, s)
