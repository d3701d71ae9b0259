"""Backward kernel: recompute one vocab chunk's logits tile by tile and write ``dz / T``.

With ``t = z₂ - lse₂`` (base-2 log-probability, ``z₂ = x·w·log2e/T``), ``p = 2^t`` and
upstream ``g`` (log-prob) and ``e`` (entropy) per token (DESIGN §1):

    dz_j / T = g/T·1[j = label] - p_j·(g/T + e/T·(ln2·t_j + H))

The tile is stored in the workspace's dtype (bf16 for bf16 inputs) at the row's original
position, for the cuBLAS GEMMs ``d_hidden += dz @ W_chunk`` and ``d_W_chunk = dzᵀ @ x`` that
follow. Rows are visited through ``perm`` (valid rows first): programs past the device-side
valid count skip the GEMM and only write zeros (the cuBLAS GEMMs read every row).
"""

import triton
import triton.language as tl

from mcore_ppo.kernels.common import grouped_tile, tile_dot

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def dz_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    perm_ptr,
    count_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    g_ptr,
    e_ptr,
    dz_ptr,
    N,
    VC,
    v0,
    H,
    stride_x,
    stride_w,
    stride_dz,
    inv_temp,
    HAS_G: tl.constexpr,
    HAS_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """``dz[:, j - v0] / T`` for columns ``j`` in ``[v0, v0 + VC)`` of the shard; see the module doc."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), tl.cdiv(VC, BLOCK_N), GROUP_M)
    count = tl.load(count_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_n = offs_m < N
    rows = tl.load(perm_ptr + offs_m, mask=in_n, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < VC
    dz_ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + offs_n[None, :]
    store_mask = in_n[:, None] & col_ok[None, :]
    if pid_m * BLOCK_M >= count:
        tl.store(dz_ptrs, tl.zeros((BLOCK_M, BLOCK_N), tl.float32).to(dz_ptr.dtype.element_ty), mask=store_mask)
        return
    row_ok = offs_m < count

    acc = tile_dot(
        x_ptr,
        w_ptr,
        x_desc,
        w_desc,
        rows,
        v0 + tl.minimum(offs_n, VC - 1),
        pid_m * BLOCK_M,
        v0 + pid_n * BLOCK_N,
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
    lse2 = tl.load(lse_ptr + rows, mask=row_ok, other=0.0) * LOG2E
    if HAS_G:
        g_t = tl.where(row_ok, tl.load(g_ptr + rows, mask=row_ok, other=0.0) * inv_temp, 0.0)
    else:
        g_t = tl.zeros((BLOCK_M,), tl.float32)
    t = acc * (inv_temp * LOG2E) - lse2[:, None]
    p = tl.exp2(t)
    if HAS_E:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        e_t = tl.where(row_ok, tl.load(e_ptr + rows, mask=row_ok, other=0.0) * inv_temp, 0.0)
        q = (e_t * LN2)[:, None] * t + (g_t + e_t * ent)[:, None]
    else:
        q = g_t[:, None] + tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Rows past the valid count may hold any logits: 2^t can be inf there, so select, don't multiply.
    dz = tl.where(row_ok[:, None], -p * q, 0.0)
    if HAS_G:
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int32) - v0
        has_label = (labels >= pid_n * BLOCK_N) & (labels < pid_n * BLOCK_N + BLOCK_N)
        if tl.max(has_label.to(tl.int32), 0) > 0:
            dz += tl.where(offs_n[None, :] == labels[:, None], g_t[:, None], 0.0)
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def dz_from_buffer_kernel(
    buf_ptr,
    tmax_ptr,
    valid_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    g_ptr,
    e_ptr,
    N,
    V,
    n_tiles_v,
    inv_temp,
    HAS_G: tl.constexpr,
    HAS_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """In place: the forward's ``2^(z₂ - tile max)`` buffer becomes ``dz / T`` (issue 6).

    ``p = buf · 2^(tile max - lse₂)``, ``log p = ln2·(log2 buf + tile max - lse₂)``; the
    tile is one forward tile (same ``BLOCK_N``), so one tile max per row. No GEMM: the
    recompute of the logits is skipped. Ignored rows (never written by the forward) get zeros.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rows < N
    ok = (tl.load(valid_ptr + rows, mask=in_n, other=0) != 0) & in_n
    col_ok = cols < V
    mask = ok[:, None] & col_ok[None, :]
    ptrs = buf_ptr + rows.to(tl.int64)[:, None] * V + cols[None, :]
    b = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    lse2 = tl.load(lse_ptr + rows, mask=ok, other=0.0) * LOG2E
    shift = tl.load(tmax_ptr + rows.to(tl.int64) * n_tiles_v + pid_n, mask=ok, other=0.0) - lse2
    p = b * tl.exp2(shift)[:, None]
    if HAS_G:
        g_t = tl.where(ok, tl.load(g_ptr + rows, mask=ok, other=0.0) * inv_temp, 0.0)
    else:
        g_t = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_E:
        ent = tl.load(ent_ptr + rows, mask=ok, other=0.0)
        e_t = tl.where(ok, tl.load(e_ptr + rows, mask=ok, other=0.0) * inv_temp, 0.0)
        # b = 0 (underflowed) is masked below; the floor keeps log2 finite. A literal under fp32's
        # smallest normal (1e-38) would make Triton compute this in fp64: 10x slower.
        log_p = (tl.log2(tl.maximum(b, 1e-30)) + shift[:, None]) * LN2
        q = e_t[:, None] * (log_p + ent[:, None]) + g_t[:, None]
    else:
        q = g_t[:, None] + tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    dz = tl.where(mask & (b > 0), -p * q, 0.0)
    if HAS_G:
        labels = tl.load(labels_ptr + rows, mask=ok, other=-1).to(tl.int32)
        dz += tl.where(cols[None, :] == labels[:, None], g_t[:, None], 0.0)
    tl.store(ptrs, dz.to(buf_ptr.dtype.element_ty), mask=in_n[:, None] & col_ok[None, :])
