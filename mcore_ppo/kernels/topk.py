"""Teacher top-k kernel: fused ``x @ W.T / T`` tiles, a per-row threshold filter, rest statistics.

``topk_filter_kernel``: one program per (block of ``BLOCK_M`` rows, vocab split). It computes
each ``[BLOCK_M, BLOCK_N]`` logit tile in fp32 registers (the head's ``tile_dot``) and keeps, per
(split, row), in global memory:

- a candidate buffer of ``CAP`` slots (values ``z`` and local column ids) holding every entry
  of the split that can still be among its ``K`` best;
- ``theta``: a threshold such that at least ``K`` buffered entries are ``>= theta``. Later
  tiles hold larger column ids, which lose every tie, so an entry ``z <= theta`` of a later tile
  can never enter the top ``K``: only ``z > theta`` is appended;
- the softmax statistics ``(m, s)`` (base 2: ``m = max z₂``, ``s = Σ 2^(z₂-m)``, ``z₂ = z·log2 e``)
  of every entry that is *not* a candidate: filtered entries as they stream by, and entries the
  compaction drops. The tail mass is then a sum of its own terms, never a difference of totals.

Appended entries take their slots from the row's counter by atomic increments, so their order
within a tile varies from run to run; every result is made independent of that order (the
compaction's bisection counts, its fold sums in fixed point, the host sorts by key), so the
outputs are the same bits on every run.

When a row's buffer could not take another full tile (``count > CAP - BLOCK_N``), the program
compacts its rows (:func:`compact_rows`): per row a bisection on the value finds the largest
``theta`` with at least ``K`` buffered entries ``>= theta``; entries below it are folded into
``(m, s)`` and the rest are moved to the front of the buffer. With ``theta`` near the k-th
value, a row appends about ``K·BLOCK_N/seen`` entries per tile, so compactions grow rare
(roughly one each time the columns seen grow e-fold for the largest ``K``). At the end a final
compaction leaves at most ``KOUT`` entries where the values allow it.

A row whose buffer overflows (exact ties at the threshold can keep more than ``CAP - BLOCK_N``
entries) keeps counting past ``CAP`` without writing there: its count is the host's signal to
recompute that row by the torch path. The host selects the
exact top ``K`` of the buffered entries of all splits by the packed key (value, then smaller id)
and folds the other ones into the rest.

``ROW_TEMP`` (constexpr, default off: the scalar variant has no per-row load) reads ``1/T`` per row
from ``inv_temp_ptr`` (a per-token temperature, fp32, each the rounding of the exact ``1/T_i``)
instead of the scalar ``inv_temp``, as the head's kernels do. A positive per-row factor keeps
every row's order, so the filter and the tie rule are unchanged.

Every row's state lives in global memory across a compaction (the compaction walks the
program's rows in groups of ``ROW_GROUP``, which cannot index the block's register vectors);
``tl.debug_barrier`` orders the program's own stores and loads around it.
"""

import triton
import triton.language as tl

from mcore_ppo.kernels.common import grouped_tile, tile_dot

LOG2E = tl.constexpr(1.4426950408889634)
FIXED_ONE = tl.constexpr(1099511627776.0)  # 2**40


@triton.jit
def _fold(m, s, z2):
    """``(m, s)`` (base 2) extended by the entries of ``z2 [rows, cols]`` (``-inf`` adds nothing)."""
    m_new = tl.maximum(m, tl.max(z2, 1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp2(m - ref) + tl.sum(tl.exp2(z2 - ref[:, None]), 1)
    return m_new, s


@triton.jit
def compact_rows(
    buf_v_ptr,
    buf_i_ptr,
    cnt_ptr,
    theta_ptr,
    m_ptr,
    s_ptr,
    state0,
    row_start,
    N,
    K,
    target,
    BLOCK_M: tl.constexpr,
    CAP: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    BISECT: tl.constexpr,
):
    """Compact the buffers of rows ``row_start ..`` whose count exceeds ``target`` (and fits ``CAP``).

    Per row: ``theta`` = the largest value found by ``BISECT`` halvings with at least ``K``
    buffered entries ``>= theta``; entries below it are folded into ``(m, s)``, the others move
    to the front (in their order). State ``(count, theta, m, s)`` is read and written at
    ``state0 + row``.
    """
    offs_c = tl.arange(0, CAP)
    # The program's buffers as one base pointer and int32 offsets (BLOCK_M · CAP < 2**31).
    prog_v = buf_v_ptr + (state0 + row_start).to(tl.int64) * CAP
    prog_i = buf_i_ptr + (state0 + row_start).to(tl.int64) * CAP
    for g in range(0, BLOCK_M, ROW_GROUP):
        local = g + tl.arange(0, ROW_GROUP)
        r = row_start + local
        r_ok = r < N
        st = state0 + r
        c = tl.load(cnt_ptr + st, mask=r_ok, other=0)
        theta = tl.load(theta_ptr + st, mask=r_ok, other=float("-inf"))
        m = tl.load(m_ptr + st, mask=r_ok, other=float("-inf"))
        s = tl.load(s_ptr + st, mask=r_ok, other=0.0)
        need = (c > target) & (c > K) & (c <= CAP) & r_ok
        if tl.max(need.to(tl.int32), 0) > 0:
            valid = (offs_c[None, :] < c[:, None]) & need[:, None]
            slot = local[:, None] * CAP + offs_c[None, :]
            v = tl.load(prog_v + slot, mask=valid, other=float("-inf"))
            ids = tl.load(prog_i + slot, mask=valid, other=0)
            # Rows left alone bisect [0, 0] (no inf - inf).
            hi = tl.where(need, tl.max(v, 1), 0.0)
            lo = tl.where(need, tl.min(tl.where(valid, v, float("inf")), 1), 0.0)
            # Invariant: at least K entries >= lo; fewer than K entries >= hi unless the top ties.
            top_ties = tl.sum((v >= hi[:, None]).to(tl.int32), 1) >= K
            lo = tl.where(top_ties, hi, lo)
            for _ in tl.static_range(BISECT):
                mid = lo + (hi - lo) * 0.5
                ok = tl.sum((v >= mid[:, None]).to(tl.int32), 1) >= K
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            new_theta = tl.where(need, tl.maximum(lo, theta), theta)
            keep = valid & (v >= new_theta[:, None])
            # The buffer's order varies from run to run (atomic slots): the dropped entries'
            # sum is taken in 2^-40 fixed point, whose integer sum is the same in any order.
            d2 = tl.where(valid & ~keep, v * LOG2E, float("-inf"))
            m_new = tl.maximum(m, tl.max(d2, 1))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            fixed = (tl.exp2(d2 - ref[:, None]) * FIXED_ONE).to(tl.int64)
            s = s * tl.exp2(m - ref) + tl.sum(fixed, 1).to(tl.float32) * (1.0 / FIXED_ONE)
            m = m_new
            k_int = keep.to(tl.int32)
            pos = tl.cumsum(k_int, 1) - k_int
            dest = local[:, None] * CAP + pos
            # Every thread has read its entries before any is overwritten.
            tl.debug_barrier()
            tl.store(prog_v + dest, v, mask=keep)
            tl.store(prog_i + dest, ids, mask=keep)
            tl.store(cnt_ptr + st, tl.where(need, tl.sum(k_int, 1), c), mask=r_ok)
            tl.store(theta_ptr + st, new_theta, mask=r_ok)
            tl.store(m_ptr + st, m, mask=r_ok)
            tl.store(s_ptr + st, s, mask=r_ok)


@triton.jit(
    # One compile per dtype and tile config: these only bound loops and masks.
    do_not_specialize=["N", "V", "num_splits", "tiles_per_split", "K", "KOUT"],
    do_not_specialize_on_alignment=["cnt_ptr", "theta_ptr", "m_ptr", "s_ptr", "inv_temp_ptr"],
)
def topk_filter_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    buf_v_ptr,
    buf_i_ptr,
    cnt_ptr,
    theta_ptr,
    m_ptr,
    s_ptr,
    N,
    V,
    H,
    stride_x,
    stride_w,
    num_splits,
    tiles_per_split,
    inv_temp,
    K,
    KOUT,
    inv_temp_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    CAP: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    BISECT_MID: tl.constexpr,
    BISECT_FINAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    ROW_TEMP: tl.constexpr = False,
):
    """Per-(split, row) candidate buffer, count, threshold and rest ``(m, s)``; see the module doc.

    Outputs (``[num_splits, N]`` state, ``[num_splits, N, CAP]`` buffers): ``cnt`` entries of
    the buffer are valid (``cnt > CAP``: overflowed); ``m`` is in base-2 units.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    state0 = pid_n * N
    st = state0 + offs_m
    # The program's buffers as one base pointer and int32 offsets (BLOCK_M · CAP < 2**31):
    # half the registers of per-entry 64-bit addresses in the tile's scatter.
    prog_v = buf_v_ptr + (state0 + row0).to(tl.int64) * CAP
    prog_i = buf_i_ptr + (state0 + row0).to(tl.int64) * CAP
    local = tl.arange(0, BLOCK_M) * CAP
    if ROW_TEMP:
        inv_t = tl.load(inv_temp_ptr + rows)[:, None]  # rows are clamped into [0, N)
    else:
        inv_t = inv_temp

    # Rows past N never append (theta = inf): no per-entry row mask in the loop.
    theta = tl.where(row_ok, float("-inf"), float("inf"))
    cnt = tl.zeros((BLOCK_M,), tl.int32)
    m_r = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_r = tl.zeros((BLOCK_M,), tl.float32)
    split_lo = pid_n * tiles_per_split * BLOCK_N
    n_tiles = tl.minimum(tiles_per_split, tl.cdiv(V - split_lo, BLOCK_N))
    for t in range(0, n_tiles):
        n0 = split_lo + t * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < V
        acc = tile_dot(
            x_ptr,
            w_ptr,
            x_desc,
            w_desc,
            rows,
            tl.minimum(offs_n, V - 1),
            row0,
            n0,
            H,
            stride_x,
            stride_w,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST,
            DOT_IEEE,
            USE_TMA,
        )
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        emit = z > theta[:, None]
        m_r, s_r = _fold(m_r, s_r, tl.where(emit, float("-inf"), z * LOG2E))
        # A slot per appended entry from the row's counter (a prefix sum over the tile would
        # hold several more [BLOCK_M, BLOCK_N] values in registers and spill). The order within
        # a tile is then arbitrary; nothing downstream depends on it (module doc).
        pos = tl.atomic_add(tl.broadcast_to((cnt_ptr + st)[:, None], (BLOCK_M, BLOCK_N)), 1, mask=emit, sem="relaxed")
        fits = emit & (pos < CAP)  # else the row has overflowed: counted, not stored
        dest = local[:, None] + pos
        tl.store(prog_v + dest, z, mask=fits)
        tl.store(prog_i + dest, offs_n[None, :], mask=fits)
        cnt += tl.sum(emit.to(tl.int32), 1)
        if tl.max(tl.where(cnt <= CAP, cnt, 0), 0) > CAP - BLOCK_N:  # overflowed rows: nothing to do
            # The counters in memory are the atomics' (complete after the barrier), not stored here.
            tl.store(theta_ptr + st, theta, mask=row_ok)
            tl.store(m_ptr + st, m_r, mask=row_ok)
            tl.store(s_ptr + st, s_r, mask=row_ok)
            tl.debug_barrier()
            compact_rows(
                buf_v_ptr, buf_i_ptr, cnt_ptr, theta_ptr, m_ptr, s_ptr, state0, row0, N, K, K,
                BLOCK_M, CAP, ROW_GROUP, BISECT_MID,
            )  # fmt: skip
            tl.debug_barrier()
            cnt = tl.load(cnt_ptr + st, mask=row_ok, other=0)
            theta = tl.load(theta_ptr + st, mask=row_ok, other=float("inf"))
            m_r = tl.load(m_ptr + st, mask=row_ok, other=float("-inf"))
            s_r = tl.load(s_ptr + st, mask=row_ok, other=0.0)

    tl.store(theta_ptr + st, theta, mask=row_ok)
    tl.store(m_ptr + st, m_r, mask=row_ok)
    tl.store(s_ptr + st, s_r, mask=row_ok)
    tl.debug_barrier()
    compact_rows(
        buf_v_ptr, buf_i_ptr, cnt_ptr, theta_ptr, m_ptr, s_ptr, state0, row0, N, K, KOUT,
        BLOCK_M, CAP, ROW_GROUP, BISECT_FINAL,
    )  # fmt: skip
