"""Hopper forward statistics, warp-specialised (Gluon): the softmax epilogue off the MMA's path.

Why (issue 14, docs/kernels.md): in :func:`forward.stats_kernel` both consumer warpgroups share
one ``128 × 256`` tile, so each tile's softmax epilogue (one ``exp2`` per logit on the SFU) runs
while the tensor cores idle: ~4-5 % of the GEMM. A second accumulator to overlap it with does
not fit in the register file (two ``128 × 256`` fp32 tiles are all of it), and narrower tiles
per warpgroup starve on L2 bandwidth (measured: ``128 × 128`` tiles 35-60 % slower).

So each CTA computes a ``256 × 128`` tile as two ``128 × 128`` halves, one per consumer
warpgroup, that share the weight tile (the same L2 traffic per FLOP as ``128 × 256``) but run
*out of phase*: warpgroup 1 starts each tile ``LAG`` K-steps after warpgroup 0, so while one
folds its tile into the statistics the other still has MMAs to issue. Three one-warp producers feed three
rings through the copy engine (TMA): the weight tile (freed when both warpgroups are done with
it, so it is deep enough to hold the lag) and each warpgroup's hidden rows.

Persistent: one CTA per SM walks work units ``(256-row block, vocab split of SPLIT_TILES
tiles)`` in GROUP_M-swizzled order; every partition walks the same units, so the rings stay in
step. The statistics and their layout are exactly :func:`forward.stats_kernel`'s (no buffer
mode here): ``(m·ln2, s, u·ln2)`` per (split, compacted row) and the label logit ``y``; the same
``merge_splits_kernel`` merges them. Rows are the host-gathered compacted rows (valid first);
units whose rows all lie past the device-side valid count are skipped by every partition.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

ROWS: gl.constexpr = gl.constexpr(128)  # rows per consumer warpgroup (two per CTA)
COLS: gl.constexpr = gl.constexpr(128)  # vocab columns per tile
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _unit(u, num_row_blocks, num_splits, GROUP_M: gl.constexpr):
    """``(row block, vocab split)`` of work unit ``u`` in GROUP_M-swizzled order."""
    per_group = GROUP_M * num_splits
    first = (u // per_group) * GROUP_M
    size = gl.minimum(num_row_blocks - first, GROUP_M)
    return first + (u % per_group) % size, (u % per_group) // size


@gluon.jit
def _load_ring(
    desc,
    bufs,
    ready,
    empty,
    count_ptr,
    N,
    V,
    H,
    num_splits,
    IS_WEIGHT: gl.constexpr,
    ROW_OFF: gl.constexpr,
    SPLIT_TILES: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """One producer warp: every K-slice this CTA will consume from ``desc`` into its ring."""
    BK: gl.constexpr = desc.block_type.shape[1]
    stages: gl.constexpr = bufs.shape[0]
    count = gl.load(count_ptr)
    num_row_blocks = gl.cdiv(N, 2 * ROWS)
    k_steps = gl.cdiv(H, BK)
    it = 0
    for u in range(gl.program_id(0), num_row_blocks * num_splits, gl.num_programs(0)):
        rb, sp = _unit(u, num_row_blocks, num_splits, GROUP_M)
        if rb * 2 * ROWS < count:
            n_tiles = gl.minimum(SPLIT_TILES, gl.cdiv(V - sp * SPLIT_TILES * COLS, COLS))
            for t in range(n_tiles):
                for kk in range(k_steps):
                    slot = it % stages
                    mbarrier.wait(empty.index(slot), ((it // stages) & 1) ^ 1)
                    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
                    if IS_WEIGHT:
                        coord_row = (sp * SPLIT_TILES + t) * COLS
                    else:
                        coord_row = rb * 2 * ROWS + ROW_OFF
                    tma.async_copy_global_to_shared(desc, [coord_row, kk * BK], ready.index(slot), bufs.index(slot))
                    it += 1


@gluon.jit
def _consume(
    a_bufs,
    b_bufs,
    a_ready,
    a_empty,
    b_ready,
    b_empty,
    go,
    perm_ptr,
    count_ptr,
    labels_ptr,
    part_m_ptr,
    part_s_ptr,
    part_u_ptr,
    y_ptr,
    N,
    V,
    H,
    num_splits,
    inv_temp,
    ROW_OFF: gl.constexpr,
    LAG: gl.constexpr,
    SPLIT_TILES: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """One consumer warpgroup: ``128 × 128`` logit tiles of its rows into running statistics."""
    BK: gl.constexpr = a_bufs.shape[2]
    a_stages: gl.constexpr = a_bufs.shape[0]
    b_stages: gl.constexpr = b_bufs.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    LEADER: gl.constexpr = ROW_OFF == 0

    count = gl.load(count_ptr)
    num_row_blocks = gl.cdiv(N, 2 * ROWS)
    k_steps = gl.cdiv(H, BK)
    scale2 = inv_temp * LOG2E
    go_depth: gl.constexpr = go.shape[0]
    lag_steps = gl.minimum(LAG, k_steps)
    it = 0
    tile = 0
    for u in range(gl.program_id(0), num_row_blocks * num_splits, gl.num_programs(0)):
        rb, sp = _unit(u, num_row_blocks, num_splits, GROUP_M)
        if rb * 2 * ROWS < count:
            offs_m = rb * 2 * ROWS + ROW_OFF + gl.arange(0, ROWS, layout=row_layout)
            row_ok = offs_m < count
            rows = gl.load(perm_ptr + offs_m, mask=offs_m < N, other=0)
            labels = gl.load(labels_ptr + rows, mask=row_ok, other=-1).to(gl.int32)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
            s_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
            u_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
            y_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
            split_lo = sp * SPLIT_TILES * COLS
            n_tiles = gl.minimum(SPLIT_TILES, gl.cdiv(V - split_lo, COLS))
            for t in range(n_tiles):
                if (not LEADER) and LAG > 0:
                    # Each tile starts LAG K-steps behind the leader's, so that the two epilogues
                    # alternate (left free-running, the two fall into lockstep: measured).
                    mbarrier.wait(go.index(tile % go_depth), (tile // go_depth) & 1)
                acc = gl.zeros([ROWS, COLS], gl.float32, layout=acc_layout)
                for kk in range(k_steps):
                    a_slot = it % a_stages
                    b_slot = it % b_stages
                    mbarrier.wait(a_ready.index(a_slot), (it // a_stages) & 1)
                    mbarrier.wait(b_ready.index(b_slot), (it // b_stages) & 1)
                    acc = warpgroup_mma(
                        a_bufs.index(a_slot), b_bufs.index(b_slot).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
                    )
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    # The previous K-slice's MMA is complete: hand its buffers back.
                    mbarrier.arrive(a_empty.index((a_slot + a_stages - 1) % a_stages), pred=kk > 0)
                    mbarrier.arrive(b_empty.index((b_slot + b_stages - 1) % b_stages), pred=kk > 0)
                    if LEADER and LAG > 0:
                        mbarrier.arrive(go.index(tile % go_depth), pred=kk == lag_steps - 1)
                    it += 1
                acc = warpgroup_mma_wait(0, deps=(acc,))
                last = it - 1
                mbarrier.arrive(a_empty.index(last % a_stages))
                mbarrier.arrive(b_empty.index(last % b_stages))
                tile += 1

                n0 = split_lo + t * COLS
                offs_n = n0 + gl.arange(0, COLS, layout=col_layout)
                col_ok = offs_n < V
                has_label = (labels >= n0) & (labels < n0 + COLS)
                if gl.max(has_label.to(gl.int32), 0) > 0:
                    hit = gl.expand_dims(offs_n, 0) == gl.expand_dims(labels, 1)
                    y_i += gl.sum(gl.where(hit, acc, 0.0), 1)
                z2 = gl.where(gl.expand_dims(col_ok, 0), acc * scale2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(z2, 1))
                d = z2 - gl.expand_dims(m_new, 1)
                e = gl.exp2(d)
                eu = gl.where(gl.expand_dims(col_ok, 0), e * d, 0.0)
                alpha = gl.exp2(m_i - m_new)
                shift = gl.where(s_i > 0, m_i - m_new, 0.0)
                u_i = alpha * (u_i + s_i * shift) + gl.sum(eu, 1)
                s_i = alpha * s_i + gl.sum(e, 1)
                m_i = m_new
            part = sp * N + offs_m
            gl.store(part_m_ptr + part, m_i * LN2, mask=row_ok)
            gl.store(part_s_ptr + part, s_i, mask=row_ok)
            gl.store(part_u_ptr + part, u_i * LN2, mask=row_ok)
            mine = row_ok & (labels >= split_lo) & (labels < split_lo + SPLIT_TILES * COLS)
            gl.store(y_ptr + rows, y_i * inv_temp, mask=mine)


@gluon.jit(do_not_specialize=["N"])
def ws_stats_kernel(
    x_desc,
    w_desc,
    perm_ptr,
    count_ptr,
    labels_ptr,
    part_m_ptr,
    part_s_ptr,
    part_u_ptr,
    y_ptr,
    N,
    V,
    H,
    num_splits,
    inv_temp,
    SPLIT_TILES: gl.constexpr,
    GROUP_M: gl.constexpr,
    A_STAGES: gl.constexpr,
    B_STAGES: gl.constexpr,
    LAG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """Per-(split, row) ``(m, s, u)`` partials and ``y``; see the module doc. ``num_warps=4``."""
    gl.static_assert(LAG < B_STAGES, "the weight ring must hold the lag")  # 0: in lockstep
    dtype: gl.constexpr = x_desc.dtype
    a0_bufs = gl.allocate_shared_memory(dtype, [A_STAGES] + x_desc.block_type.shape, x_desc.layout)  # noqa: RUF005 (jit code)
    a1_bufs = gl.allocate_shared_memory(dtype, [A_STAGES] + x_desc.block_type.shape, x_desc.layout)  # noqa: RUF005 (jit code)
    b_bufs = gl.allocate_shared_memory(dtype, [B_STAGES] + w_desc.block_type.shape, w_desc.layout)  # noqa: RUF005 (jit code)
    a0_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a0_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a1_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a1_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
    # The leader is at most B_STAGES K-steps (so tiles) ahead: one barrier per tile it may lead by.
    go = gl.allocate_shared_memory(gl.int64, [B_STAGES + 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(A_STAGES):
        mbarrier.init(a0_ready.index(i), count=1)
        mbarrier.init(a0_empty.index(i), count=1)
        mbarrier.init(a1_ready.index(i), count=1)
        mbarrier.init(a1_empty.index(i), count=1)
    for i in gl.static_range(B_STAGES):
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(b_empty.index(i), count=2)  # both consumer warpgroups read each weight slice
    for i in gl.static_range(B_STAGES + 1):
        mbarrier.init(go.index(i), count=1)

    gl.warp_specialize(
        [
            (
                _consume,
                (
                    a0_bufs,
                    b_bufs,
                    a0_ready,
                    a0_empty,
                    b_ready,
                    b_empty,
                    go,
                    perm_ptr,
                    count_ptr,
                    labels_ptr,
                    part_m_ptr,
                    part_s_ptr,
                    part_u_ptr,
                    y_ptr,
                    N,
                    V,
                    H,
                    num_splits,
                    inv_temp,
                    0,
                    LAG,
                    SPLIT_TILES,
                    GROUP_M,
                ),
            ),
            (
                _consume,
                (
                    a1_bufs,
                    b_bufs,
                    a1_ready,
                    a1_empty,
                    b_ready,
                    b_empty,
                    go,
                    perm_ptr,
                    count_ptr,
                    labels_ptr,
                    part_m_ptr,
                    part_s_ptr,
                    part_u_ptr,
                    y_ptr,
                    N,
                    V,
                    H,
                    num_splits,
                    inv_temp,
                    ROWS,
                    LAG,
                    SPLIT_TILES,
                    GROUP_M,
                ),
            ),
            (
                _load_ring,
                (w_desc, b_bufs, b_ready, b_empty, count_ptr, N, V, H, num_splits, True, 0, SPLIT_TILES, GROUP_M),
            ),
            (
                _load_ring,
                (x_desc, a0_bufs, a0_ready, a0_empty, count_ptr, N, V, H, num_splits, False, 0, SPLIT_TILES, GROUP_M),
            ),
            (
                _load_ring,
                (
                    x_desc,
                    a1_bufs,
                    a1_ready,
                    a1_empty,
                    count_ptr,
                    N,
                    V,
                    H,
                    num_splits,
                    False,
                    ROWS,
                    SPLIT_TILES,
                    GROUP_M,
                ),
            ),
        ],
        [4, 1, 1, 1],
        [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS],
    )
