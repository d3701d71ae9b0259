"""Forward kernels: fused ``x @ W.T / T`` tiles with online softmax statistics.

``stats_kernel``: one program per (block of compacted valid rows, vocab split of
``TILES_PER_SPLIT × BLOCK_N`` columns). It accumulates each ``[BLOCK_M, BLOCK_N]`` logit tile
in fp32 and folds it into per-row running statistics in registers, in base-2 units
(``z₂ = z·log2 e``, so the exponential is one ``exp2``):

    m = max z₂,   s = Σ 2^(z₂-m),   u = Σ 2^(z₂-m)·(z₂-m)

and stores them per (split, row) converted back to natural units (``m·ln2``, ``s``,
``u·ln2``) into the planes of one partials buffer (``parts_ptr``: the packed layout of
:mod:`mcore_ppo.statistics`, m in plane 0, s in plane 1, each further term in the plane its
constexpr names). The label's logit is stored by the split that holds it. Logits never reach memory. Rows are visited
through ``perm`` (valid rows first; with ``USE_TMA`` the copy engine reads them through a
descriptor the program builds itself: in place in the original where its block's valid rows
are consecutive there, ``DIRECT_ROWS``, else from the host's gathered copy, in one launch); a
program whose rows all lie past the device-side valid count exits before any GEMM work, so
ignored tokens cost nothing and the host never learns the count.

``ROW_TEMP`` reads ``1/T`` per row from ``inv_temp_ptr`` (a per-token temperature) instead of
the scalar ``inv_temp``. Each term of :class:`mcore_ppo.statistics.Statistics` beyond ``s`` is a
plane constexpr here, 0 when the call does not ask for it (its code is compiled out), and its
lines in these kernels are the term's whole kernel side: ``U_PLANE`` the entropy's ``u``
(default 2: on); ``Q_PLANE`` Σπ²'s ``q = Σ 2^(2(z₂-m)) = Σ exp(2(z-m))`` beside ``s``, rescaled by
the square of ``s``'s factor (unit-free like ``s``; default 0: off), whose output the finish
kernels write into row ``Q_OUT`` of the detached outputs.

``TOPK_C`` (default 0: off; not with ``STORE_P``) is the teacher's and the student's top-k
(:mod:`mcore_ppo.kernels.topk` selects from what it writes): per (row, tile) the tile's ``C``
largest entries, taken out of the tile in place by ``C`` max-reductions (value ``z₂·ln 2``,
shard column; equal values by the smaller column), into ``cand_v`` / ``cand_c`` ``[N, tiles, C]``,
and the rest's ``(m, s)`` relative to its own max into ``rest [2, N, tiles]`` (the tail's terms
summed as they are, however far below the top). The rest's sums, rescaled to the running max and
completed by the candidates' own terms, are the statistics: one ``exp2`` per logit for both. The
pass has no labels.

``merge_splits_kernel``: per token, merges the split partials (online-softmax rescaling, as
:meth:`mcore_ppo.statistics.Statistics.merge`) into the shard's planes; ignored tokens get
``(m, s, u, q) = (0, 1, 0, 1)`` (each term's ``empty``) so that downstream ``log`` stays finite.
``merge_finish_kernel`` does that and the outputs' epilogue in one launch on one shard. Over TP,
around :func:`mcore_ppo.parallel.combine.reduce_shard_statistics`' all-reduce MAX and SUM:
``split_max_kernel`` (the shard's max), ``merge_to_max_kernel`` (the splits merged straight to the
group's max, packed for the SUM) and ``finish_kernel`` (the outputs from the sums).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from mcore_ppo.kernels.common import grouped_tile, tile_dot
from mcore_ppo.kernels.compact import contiguous_block

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(
    do_not_specialize=["N"],
    do_not_specialize_on_alignment=[
        "perm_ptr",
        "count_ptr",
        "labels_ptr",
        "parts_ptr",
        "y_ptr",
        "tmax_ptr",
        "inv_temp_ptr",
        "cand_v_ptr",
        "cand_c_ptr",
        "rest_ptr",
        "x_unscale_ptr",
        "w_unscale_ptr",
    ],
)
def stats_kernel(
    x_ptr,
    xg_ptr,
    w_ptr,
    perm_ptr,
    count_ptr,
    labels_ptr,
    parts_ptr,
    y_ptr,
    buf_ptr,
    tmax_ptr,
    N,
    V,
    H,
    stride_x,
    stride_w,
    num_splits,
    inv_temp,
    n_tiles_v,
    inv_temp_ptr,
    cand_v_ptr,
    cand_c_ptr,
    rest_ptr,
    x_unscale_ptr,
    w_unscale_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    STORE_P: tl.constexpr,
    BUF_TMA: tl.constexpr,
    DIRECT_ROWS: tl.constexpr,
    ROW_TEMP: tl.constexpr = False,
    U_PLANE: tl.constexpr = 2,
    Q_PLANE: tl.constexpr = 0,
    TOPK_C: tl.constexpr = 0,
    PARTS: tl.constexpr = False,
):
    """Per-(split, row) partials (m, s and the terms whose planes are nonzero) and the label
    logit ``y``; with ``TOPK_C`` also each (row, tile)'s top-k candidates and rest (module doc)."""
    tl.static_assert(not (TOPK_C and STORE_P), "the top-k candidates are not kept beside the buffer")
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:
        return
    row0 = pid_m * BLOCK_M
    if USE_TMA:
        # The descriptors are built here, per program, from plain pointers (a host descriptor
        # would be encoded again by Triton's launcher on every launch; the scratch they live in
        # comes from the allocator the launcher installs). The rows' descriptor reads in place
        # in the original hidden when the block's valid rows are consecutive there (DIRECT_ROWS;
        # every block when nothing is ignored), else from the host's gathered copy (contiguous,
        # compacted order): one launch and one pipelined K loop for both kinds of block.
        w_desc = tl.make_tensor_descriptor(w_ptr, [V, H], [stride_w, 1], [BLOCK_N, BLOCK_K])
        if DIRECT_ROWS:
            direct, first = contiguous_block(perm_ptr, count, N, row0, BLOCK_M)
            row0 = tl.where(direct, first, row0)
            x_base = tl.where(direct, x_ptr, xg_ptr)
            x_stride = tl.where(direct, stride_x, H)
        else:
            x_base = xg_ptr
            x_stride = H
        x_desc = tl.make_tensor_descriptor(x_base, [N, H], [x_stride, 1], [BLOCK_M, BLOCK_K])
    else:
        x_desc = x_ptr
        w_desc = w_ptr
    if BUF_TMA:
        buf_desc = tl.make_tensor_descriptor(buf_ptr, [N, V], [V, 1], [BLOCK_M, BLOCK_N])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    rows = tl.load(perm_ptr + offs_m, mask=offs_m < N, other=0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int32)

    if ROW_TEMP:
        inv_t = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
        scale2 = (inv_t * LOG2E)[:, None]
    else:
        inv_t = inv_temp
        scale2 = inv_temp * LOG2E
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    u_i = tl.zeros((BLOCK_M,), tl.float32)
    q_i = tl.zeros((BLOCK_M,), tl.float32)
    y_i = tl.zeros((BLOCK_M,), tl.float32)
    split_lo = pid_n * TILES_PER_SPLIT * BLOCK_N
    n_tiles = tl.minimum(TILES_PER_SPLIT, tl.cdiv(V - split_lo, BLOCK_N))
    # Not flattened with the K loop (tl.range(flatten=True)): measured 13-15 % slower (docs/kernels.md).
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
            x_unscale_ptr,
            w_unscale_ptr,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST,
            DOT,
            USE_TMA,
            PARTS,
        )
        # The label first, so that acc is dead (overwritten by z2) before the statistics. The
        # top-k pass has none (its registers go to the candidates: no spill on sm_90).
        if not TOPK_C:
            has_label = (labels >= n0) & (labels < n0 + BLOCK_N)
            if tl.max(has_label.to(tl.int32), 0) > 0:  # ~1 tile in 5 at V=152k: skip the select elsewhere
                hit = offs_n[None, :] == labels[:, None]
                y_i += tl.sum(tl.where(hit, acc, 0.0), 1)
        z2 = tl.where(col_ok[None, :], acc * scale2, float("-inf"))
        if STORE_P:
            # Budgeted buffer (docs/kernels.md): 2^(z₂ - tile max) in bf16 (p keeps bf16 *relative*
            # precision) and the fp32 tile max; the tile's statistics come from the same values.
            t_max = tl.max(z2, 1)
            d = z2 - t_max[:, None]
            e = tl.exp2(d)
            # Rows in compacted order (the program's own rows, valid first): one contiguous
            # block, so the copy engine can store it asynchronously. Rows past the valid count
            # are stored too (garbage from ignored rows); the backward never reads them.
            if BUF_TMA:
                buf_desc.store([pid_m * BLOCK_M, n0], e.to(buf_ptr.dtype.element_ty))
            else:
                buf_ptrs = buf_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
                tl.store(buf_ptrs, e.to(buf_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tl.store(tmax_ptr + offs_m.to(tl.int64) * n_tiles_v + n0 // BLOCK_N, t_max, mask=row_ok)
            s_t = tl.sum(e, 1)
            if U_PLANE:
                u_t = tl.sum(tl.where(col_ok[None, :], e * d, 0.0), 1)
            m_new = tl.maximum(m_i, t_max)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(t_max - m_new)
            if U_PLANE:
                shift = tl.where(s_i > 0, m_i - m_new, 0.0)
                u_i = alpha * (u_i + s_i * shift) + beta * (u_t + s_t * (t_max - m_new))
            if Q_PLANE:
                q_i = alpha * alpha * q_i + beta * beta * tl.sum(e * e, 1)
            s_i = alpha * s_i + beta * s_t
            m_i = m_new
        else:
            if TOPK_C:
                # The candidates out of the tile first; the rest's sums relative to its own max
                # (its exact (m, s) for the tail), then rescaled to the running max and
                # completed by the candidates' own terms: one exponential per entry.
                z2, m_new, s_c, u_c, q_c, rest_m2 = _tile_candidates(
                    z2, m_i, rows, row_ok, n0, V, n_tiles_v, cand_v_ptr, cand_c_ptr, BLOCK_M, BLOCK_N, TOPK_C
                )
                ref = tl.where(rest_m2 == float("-inf"), m_new, rest_m2)  # an empty rest: every e is 0
                d = z2 - ref[:, None]
                e = tl.exp2(d)
                rest_s = tl.sum(e, 1)
                rest = rows.to(tl.int64) * n_tiles_v + n0 // BLOCK_N
                tl.store(rest_ptr + rest, rest_m2 * LN2, mask=row_ok)
                tl.store(rest_ptr + N.to(tl.int64) * n_tiles_v + rest, rest_s, mask=row_ok)
                # Relative to m_new the rest's terms scale by f = 2^g (g <= 0); where f underflows
                # they are below 2^-126 of the max's own term: nothing an fp32 sum keeps.
                g = ref - m_new
                f = tl.exp2(g)
                alpha = tl.exp2(m_i - m_new)
                if U_PLANE:
                    shift = tl.where(s_i > 0, m_i - m_new, 0.0)
                    u_r = tl.sum(tl.where(e > 0, e * d, 0.0), 1)  # 0·(-inf) at the candidates: 0
                    u_i = alpha * (u_i + s_i * shift) + (f * (u_r + g * rest_s) + u_c)
                if Q_PLANE:
                    q_i = alpha * alpha * q_i + (f * f * tl.sum(e * e, 1) + q_c)
                s_i = alpha * s_i + (f * rest_s + s_c)
                m_i = m_new
            else:
                m_new = tl.maximum(m_i, tl.max(z2, 1))  # finite: every tile has a valid column
                d = z2 - m_new[:, None]
                e = tl.exp2(d)
                if U_PLANE:
                    eu = tl.where(col_ok[None, :], e * d, 0.0)
                alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
                if U_PLANE:
                    shift = tl.where(s_i > 0, m_i - m_new, 0.0)
                    u_i = alpha * (u_i + s_i * shift) + tl.sum(eu, 1)
                if Q_PLANE:
                    q_i = alpha * alpha * q_i + tl.sum(e * e, 1)
                s_i = alpha * s_i + tl.sum(e, 1)
                m_i = m_new

    # The partials' planes in one buffer, each [splits, N]: m, s, then each term at its plane.
    plane = N.to(tl.int64) * num_splits  # N is never specialised (num_splits = 1 is a constant)
    part = parts_ptr + pid_n * N + offs_m
    tl.store(part, m_i * LN2, mask=row_ok)
    tl.store(part + plane, s_i, mask=row_ok)
    if U_PLANE:
        tl.store(part + U_PLANE * plane, u_i * LN2, mask=row_ok)
    if Q_PLANE:
        tl.store(part + Q_PLANE * plane, q_i, mask=row_ok)
    split_hi = split_lo + TILES_PER_SPLIT * BLOCK_N
    if not TOPK_C:
        mine = row_ok & (labels >= split_lo) & (labels < split_hi)
        tl.store(y_ptr + rows, y_i * inv_t, mask=mine)


@triton.jit
def _tile_candidates(
    z2, m_i, rows, row_ok, n0, V, n_tiles, cand_v_ptr, cand_c_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """The tile's ``C`` largest entries of ``z₂`` per row (the value ``z₂·ln 2`` in natural
    units, the shard column), largest first, equal values by the smaller column, into
    ``cand_v`` / ``cand_c`` ``[N, n_tiles, C]`` (fp32 / int32): ``C`` max-reductions, each
    entry taken out of the tile in place (one tile of registers, as the statistics alone).

    Returns ``(rest, m_new, s_c, u_c, q_c, rest_m2)``: the tile without its candidates (at
    -inf), the running max with the tile, the candidates' own terms of the statistics relative
    to ``m_new`` (``Σ 2^(c - m_new)``, its ``u`` and its ``q``: the caller's sums over the rest
    complete them) and the rest's max (base 2, -inf for an empty rest)."""
    local = tl.arange(0, BLOCK_N)[None, :]
    out = (rows.to(tl.int64) * n_tiles + n0 // BLOCK_N) * C
    m_new = tl.maximum(m_i, tl.max(z2, 1))  # finite: every tile has a valid column
    s_c = tl.zeros((BLOCK_M,), tl.float32)
    u_c = tl.zeros((BLOCK_M,), tl.float32)
    q_c = tl.zeros((BLOCK_M,), tl.float32)
    for j in tl.static_range(C):
        top = tl.max(z2, 1)
        # The smallest column holding it: the tie rule within the tile.
        col = tl.min(tl.where(z2 == top[:, None], local, BLOCK_N), 1)
        tl.store(cand_v_ptr + out + j, top * LN2, mask=row_ok)
        # Within the shard even when no column holds the max (a NaN row): every id valid.
        tl.store(cand_c_ptr + out + j, tl.minimum(n0 + col, V - 1), mask=row_ok)
        z2 = tl.where(local == col[:, None], float("-inf"), z2)
        d = top - m_new
        e = tl.exp2(d)
        s_c += e
        u_c += tl.where(e > 0, e * d, 0.0)
        q_c += e * e
    return z2, m_new, s_c, u_c, q_c, tl.max(z2, 1)


@triton.jit
def _max_over_splits(parts_ptr, offs_t, valid, N, num_splits, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The shard's max of the compacted tokens ``offs_t`` over the splits' ``m`` plane (0 where
    not ``valid``)."""
    offs_s = tl.arange(0, BLOCK_S)
    m_all = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        mask = valid[:, None] & (s0 + offs_s < num_splits)[None, :]
        idx = (s0 + offs_s)[None, :] * N + offs_t[:, None]
        m_all = tl.maximum(m_all, tl.max(tl.load(parts_ptr + idx, mask=mask, other=float("-inf")), 1))
    return tl.where(valid, m_all, 0.0)


@triton.jit
def _sums_over_splits(
    parts_ptr, offs_t, valid, m_safe, N, num_splits,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, U_PLANE: tl.constexpr, Q_PLANE: tl.constexpr,
):  # fmt: skip
    """``(s, u, q)`` of the compacted tokens ``offs_t`` merged over the splits relative to
    ``m_safe`` (any value at least every split's max: the shard's, or the TP group's), 0 where
    not ``valid``; ``u`` and ``q`` only where their planes are nonzero, ``q`` rescaled by the
    squared factor."""
    plane = N.to(tl.int64) * num_splits  # N is never specialised (num_splits = 1 is a constant)
    part_s_ptr = parts_ptr + plane
    part_u_ptr = parts_ptr + U_PLANE * plane
    part_q_ptr = parts_ptr + Q_PLANE * plane
    offs_s = tl.arange(0, BLOCK_S)
    s_all = tl.zeros((BLOCK_T,), tl.float32)
    u_all = tl.zeros((BLOCK_T,), tl.float32)
    q_all = tl.zeros((BLOCK_T,), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        mask = valid[:, None] & (s0 + offs_s < num_splits)[None, :]
        idx = (s0 + offs_s)[None, :] * N + offs_t[:, None]
        pm = tl.load(parts_ptr + idx, mask=mask, other=0.0)
        ps = tl.load(part_s_ptr + idx, mask=mask, other=0.0)
        if U_PLANE:
            pu = tl.load(part_u_ptr + idx, mask=mask, other=0.0)
        shift = tl.where(ps > 0, pm - m_safe[:, None], 0.0)
        scale = tl.where(ps > 0, tl.exp(shift), 0.0)
        s_all += tl.sum(ps * scale, 1)
        if U_PLANE:
            u_all += tl.sum((pu + ps * shift) * scale, 1)
        if Q_PLANE:
            pq = tl.load(part_q_ptr + idx, mask=mask, other=0.0)
            q_all += tl.sum(pq * (scale * scale), 1)
    return s_all, u_all, q_all


@triton.jit
def _merge_rows(
    parts_ptr, offs_t, valid, N, num_splits,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, U_PLANE: tl.constexpr, Q_PLANE: tl.constexpr,
):  # fmt: skip
    """``(m, s, u, q)`` of the compacted tokens ``offs_t`` merged over the splits (0 where not
    ``valid``; as :func:`_sums_over_splits`). ``parts_ptr``: the planes of :func:`stats_kernel`."""
    m_safe = _max_over_splits(parts_ptr, offs_t, valid, N, num_splits, BLOCK_T, BLOCK_S)
    s_all, u_all, q_all = _sums_over_splits(
        parts_ptr, offs_t, valid, m_safe, N, num_splits, BLOCK_T, BLOCK_S, U_PLANE, Q_PLANE
    )
    return m_safe, s_all, u_all, q_all


@triton.jit(
    do_not_specialize=["N"],
    do_not_specialize_on_alignment=["parts_ptr", "perm_ptr", "count_ptr", "out_ptr"],
)
def merge_splits_kernel(
    parts_ptr,
    perm_ptr,
    count_ptr,
    out_ptr,
    N,
    num_splits,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    U_PLANE: tl.constexpr = 2,
    Q_PLANE: tl.constexpr = 0,
):
    """The shard's planes per token (``out_ptr`` ``[planes, N]``, place order: m, s, then each
    term at its plane) from the partials' ``[splits, N]`` planes (rows via ``perm``); ignored
    tokens get ``(m, s, u, q) = (0, 1, 0, 1)``."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = offs_t < N
    count = tl.load(count_ptr)
    valid = offs_t < count
    rows = tl.load(perm_ptr + offs_t, mask=in_n, other=0)
    m_safe, s_all, u_all, q_all = _merge_rows(
        parts_ptr, offs_t, valid, N, num_splits, BLOCK_T, BLOCK_S, U_PLANE, Q_PLANE
    )
    plane = N.to(tl.int64)
    tl.store(out_ptr + rows, m_safe, mask=in_n)
    tl.store(out_ptr + plane + rows, tl.where(valid, s_all, 1.0), mask=in_n)
    if U_PLANE:
        tl.store(out_ptr + U_PLANE * plane + rows, tl.where(valid, u_all, 0.0), mask=in_n)
    if Q_PLANE:
        tl.store(out_ptr + Q_PLANE * plane + rows, tl.where(valid, q_all, 1.0), mask=in_n)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    # libdevice's logf is what torch.log computes on CUDA (bit for bit); the interpreter has no libdevice.
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _finish_rows(
    m,
    s,
    u,
    q,
    rows,
    valid,
    in_n,
    y_ptr,
    labels_ptr,
    stride_l,
    lse_ptr,
    ent_ptr,
    lp_ptr,
    ent_out_ptr,
    vocab_size,
    max_entropy,
    detached_ptr,
    N,
    LIBDEVICE: tl.constexpr,
    SAVE: tl.constexpr,
    U_PLANE: tl.constexpr,
    CHECK_RANGE: tl.constexpr,
    Q_PLANE: tl.constexpr,
    Q_OUT: tl.constexpr,
):
    """The outputs of rows ``rows`` from their merged max ``m`` and sums ``s``, ``u``, ``q``
    (``u``, ``q`` read only with ``U_PLANE``, ``Q_PLANE``), as
    :meth:`mcore_ppo.statistics.Statistics.finish` forms them: ``lse = m + log s``, ``H = log s
    - u/s`` (both stored with ``SAVE``, for the backward), ``Σπ² = q/s²``; then ``log p = min(y -
    lse, 0)`` (NaN for a label outside ``[0, vocab_size)`` with ``CHECK_RANGE``), ``H`` clamped to
    ``[0, max_entropy]``, with ``Q_PLANE`` Σπ² clamped to ``[1/V, 1]`` into row ``Q_OUT`` of
    ``detached_ptr`` (``[rows, N]``), each 0 where not ``valid`` (NaN kept by the clamps, as
    torch's clamp keeps it)."""
    log_s = _log(s, LIBDEVICE)
    lse = m + log_s
    if SAVE:
        tl.store(lse_ptr + rows, lse, mask=in_n)
    y = tl.load(y_ptr + rows, mask=in_n, other=0.0)
    log_p = y - lse
    log_p = tl.where(log_p > 0.0, 0.0, log_p)
    log_p = tl.where(valid, log_p, 0.0)
    if CHECK_RANGE:
        label = tl.load(labels_ptr + rows.to(tl.int64) * stride_l, mask=in_n, other=0).to(tl.int64)
        log_p = tl.where(valid & ((label < 0) | (label >= vocab_size)), float("nan"), log_p)
    tl.store(lp_ptr + rows, log_p, mask=in_n)
    if U_PLANE:
        entropy = log_s - tl.math.div_rn(u, s)
        if SAVE:
            tl.store(ent_ptr + rows, entropy, mask=in_n)
        h = tl.where(entropy < 0.0, 0.0, entropy)
        h = tl.where(h > max_entropy, max_entropy, h)
        tl.store(ent_out_ptr + rows, tl.where(valid, h, 0.0), mask=in_n)
    if Q_PLANE:
        sum_pi_squared = tl.math.div_rn(q, s * s)
        floor = 1.0 / vocab_size.to(tl.float32)
        sp = tl.where(sum_pi_squared < floor, floor, sum_pi_squared)
        sp = tl.where(sp > 1.0, 1.0, sp)
        tl.store(detached_ptr + Q_OUT * N.to(tl.int64) + rows, tl.where(valid, sp, 0.0), mask=in_n)


@triton.jit(
    do_not_specialize=["N", "stride_l", "vocab_size"],
    do_not_specialize_on_alignment=[
        "parts_ptr",
        "perm_ptr",
        "count_ptr",
        "y_ptr",
        "labels_ptr",
        "lse_ptr",
        "ent_ptr",
        "lp_ptr",
        "ent_out_ptr",
        "detached_ptr",
    ],
)
def merge_finish_kernel(
    parts_ptr,
    perm_ptr,
    count_ptr,
    y_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    lp_ptr,
    ent_out_ptr,
    detached_ptr,
    N,
    num_splits,
    stride_l,
    vocab_size,
    max_entropy,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHECK_RANGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    SAVE: tl.constexpr,
    U_PLANE: tl.constexpr = 2,
    Q_PLANE: tl.constexpr = 0,
    Q_OUT: tl.constexpr = 0,
):
    """One shard holding the whole vocab: the merge of :func:`merge_splits_kernel` and then the
    head's outputs from the merged planes in the same pass (:func:`_finish_rows`). Ignored
    tokens get ``lse = H = 0`` and zero outputs."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = offs_t < N
    count = tl.load(count_ptr)
    valid = offs_t < count
    rows = tl.load(perm_ptr + offs_t, mask=in_n, other=0)
    m_safe, s_all, u_all, q_all = _merge_rows(
        parts_ptr, offs_t, valid, N, num_splits, BLOCK_T, BLOCK_S, U_PLANE, Q_PLANE
    )
    s = tl.where(valid, s_all, 1.0)
    u = tl.where(valid, u_all, 0.0)
    q = tl.where(valid, q_all, 1.0)
    _finish_rows(
        m_safe, s, u, q, rows, valid, in_n, y_ptr, labels_ptr, stride_l, lse_ptr, ent_ptr, lp_ptr, ent_out_ptr,
        vocab_size, max_entropy, detached_ptr, N, LIBDEVICE, SAVE, U_PLANE, CHECK_RANGE, Q_PLANE, Q_OUT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["parts_ptr", "perm_ptr", "count_ptr", "max_ptr"])
def split_max_kernel(
    parts_ptr, perm_ptr, count_ptr, max_ptr, N, num_splits, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr
):
    """Over TP, before the all-reduce MAX: the shard's max per token (place order; 0 for ignored
    tokens, on every rank alike)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = offs_t < N
    valid = offs_t < tl.load(count_ptr)
    rows = tl.load(perm_ptr + offs_t, mask=in_n, other=0)
    tl.store(max_ptr + rows, _max_over_splits(parts_ptr, offs_t, valid, N, num_splits, BLOCK_T, BLOCK_S), mask=in_n)


@triton.jit(
    do_not_specialize=["N"],
    do_not_specialize_on_alignment=["parts_ptr", "perm_ptr", "count_ptr", "max_ptr", "sums_ptr"],
)
def merge_to_max_kernel(
    parts_ptr,
    perm_ptr,
    count_ptr,
    max_ptr,
    sums_ptr,
    N,
    num_splits,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    U_PLANE: tl.constexpr = 2,
    Q_PLANE: tl.constexpr = 0,
):
    """Over TP, between the all-reduce MAX and the SUM: the splits merged straight to the TP
    group's max ``max_ptr`` into the planes of ``sums_ptr`` (``[planes, N]``, place order: the
    label logit ``y`` in plane 0, which the statistics kernel wrote and this one leaves, ``s``,
    then each term at its plane). Ignored tokens get ``s = q = 1`` and ``u = 0`` on every rank,
    so that their sums stay finite."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = offs_t < N
    valid = offs_t < tl.load(count_ptr)
    rows = tl.load(perm_ptr + offs_t, mask=in_n, other=0)
    m = tl.load(max_ptr + rows, mask=in_n & valid, other=0.0)
    s_all, u_all, q_all = _sums_over_splits(
        parts_ptr, offs_t, valid, m, N, num_splits, BLOCK_T, BLOCK_S, U_PLANE, Q_PLANE
    )
    plane = N.to(tl.int64)
    tl.store(sums_ptr + plane + rows, tl.where(valid, s_all, 1.0), mask=in_n)
    if U_PLANE:
        tl.store(sums_ptr + U_PLANE * plane + rows, tl.where(valid, u_all, 0.0), mask=in_n)
    if Q_PLANE:
        tl.store(sums_ptr + Q_PLANE * plane + rows, tl.where(valid, q_all, 1.0), mask=in_n)


@triton.jit(
    do_not_specialize=["N", "stride_l", "ignore_index", "vocab_size"],
    do_not_specialize_on_alignment=[
        "max_ptr", "sums_ptr", "labels_ptr", "lse_ptr", "ent_ptr", "lp_ptr", "ent_out_ptr", "detached_ptr",
    ],
)  # fmt: skip
def finish_kernel(
    max_ptr,
    sums_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    lp_ptr,
    ent_out_ptr,
    detached_ptr,
    N,
    stride_l,
    ignore_index,
    vocab_size,
    max_entropy,
    BLOCK_T: tl.constexpr,
    CHECK_RANGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    SAVE: tl.constexpr,
    U_PLANE: tl.constexpr = 2,
    Q_PLANE: tl.constexpr = 0,
    Q_OUT: tl.constexpr = 0,
):
    """Over TP, after the all-reduce SUM: the head's outputs from the group's max ``M`` and the
    summed planes of :func:`merge_to_max_kernel`, per token in place order, as
    :func:`merge_finish_kernel` forms them from one shard's (:func:`_finish_rows`, with ``valid =
    label != ignore_index``). Ignored tokens get ``lse = H = 0``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_n = rows < N
    label = tl.load(labels_ptr + rows.to(tl.int64) * stride_l, mask=in_n, other=0).to(tl.int64)
    valid = in_n & (label != ignore_index)
    plane = N.to(tl.int64)
    m = tl.load(max_ptr + rows, mask=valid, other=0.0)
    s = tl.load(sums_ptr + plane + rows, mask=valid, other=1.0)
    u = s  # read only with U_PLANE
    if U_PLANE:
        u = tl.load(sums_ptr + U_PLANE * plane + rows, mask=valid, other=0.0)
    q = s  # read only with Q_PLANE
    if Q_PLANE:
        q = tl.load(sums_ptr + Q_PLANE * plane + rows, mask=valid, other=1.0)
    _finish_rows(
        m, s, u, q, rows, valid, in_n, sums_ptr, labels_ptr, stride_l, lse_ptr, ent_ptr, lp_ptr, ent_out_ptr,
        vocab_size, max_entropy, detached_ptr, N, LIBDEVICE, SAVE, U_PLANE, CHECK_RANGE, Q_PLANE, Q_OUT,
    )  # fmt: skip
