"""Backward kernel: recompute one vocab chunk's logits tile by tile and write ``dz / T``.

With ``t = z₂ - lse₂`` (base-2 log-probability, ``z₂ = x·w·log2e/T``), ``p = 2^t`` and
upstream ``g`` (log-prob) and ``e`` (entropy) per token (docs/design.md §1):

    dz_j / T = g/T·1[j = label] - p_j·(g/T + e/T·(ln2·t_j + H))

The tile is stored in the workspace's dtype (bf16 for bf16 inputs) in *compacted* row order
(valid rows first, as ``perm`` lists them), for the cuBLAS GEMMs ``d_hidden_c += dz @ W_chunk``
and ``d_W_chunk = dzᵀ @ x_c`` that follow (``x_c``: the gathered rows, ignored ones zeroed, so
an inf in an ignored row cannot turn into 0·inf = NaN in ``d_W``); the host puts the rows of
``d_hidden`` back in place once. Compacted rows make each program's tile one contiguous block:
with ``DZ_TMA`` the copy engine stores it asynchronously. Programs past the device-side valid
count skip the GEMM and only write zeros (the cuBLAS GEMMs read every row).

``ROW_TEMP`` (constexpr, both kernels): ``1/T`` per row from ``inv_temp_ptr`` (a per-token
temperature) instead of the scalar ``inv_temp``; off, the code is the scalar path's as it was.
"""

import triton
import triton.language as tl

from mcore_ppo.kernels.common import grouped_tile, tile_dot

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(
    do_not_specialize=["N", "VC"],
    do_not_specialize_on_alignment=[
        "perm_ptr",
        "count_ptr",
        "labels_ptr",
        "lse_ptr",
        "ent_ptr",
        "g_ptr",
        "e_ptr",
        "inv_temp_ptr",
        "x_unscale_ptr",
        "w_unscale_ptr",
    ],
)
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
    dz_desc,
    N,
    VC,
    v0,
    H,
    stride_x,
    stride_w,
    stride_dz,
    inv_temp,
    inv_temp_ptr,
    x_unscale_ptr,
    w_unscale_ptr,
    HAS_G: tl.constexpr,
    HAS_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    DZ_TMA: tl.constexpr,
    ROW_TEMP: tl.constexpr = False,
    PARTS: tl.constexpr = False,
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
    dz_ptrs = dz_ptr + offs_m.to(tl.int64)[:, None] * stride_dz + offs_n[None, :]
    store_mask = in_n[:, None] & col_ok[None, :]
    if pid_m * BLOCK_M >= count:
        zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32).to(dz_ptr.dtype.element_ty)
        if DZ_TMA:
            dz_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], zeros)
        else:
            tl.store(dz_ptrs, zeros, mask=store_mask)
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
    lse2 = tl.load(lse_ptr + rows, mask=row_ok, other=0.0) * LOG2E
    if ROW_TEMP:
        inv_t = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    else:
        inv_t = inv_temp
    if HAS_G:
        g_t = tl.where(row_ok, tl.load(g_ptr + rows, mask=row_ok, other=0.0) * inv_t, 0.0)
    else:
        g_t = tl.zeros((BLOCK_M,), tl.float32)
    if ROW_TEMP:
        t = acc * (inv_t * LOG2E)[:, None] - lse2[:, None]
    else:
        t = acc * (inv_temp * LOG2E) - lse2[:, None]
    p = tl.exp2(t)
    if HAS_E:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        e_t = tl.where(row_ok, tl.load(e_ptr + rows, mask=row_ok, other=0.0) * inv_t, 0.0)
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
    if DZ_TMA:
        dz_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], dz.to(dz_ptr.dtype.element_ty))
    else:
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _log2_bf16(b_raw):
    """``log2`` of positive bf16 values from their bits: exponent + a quartic in the mantissa.

    A bf16 value carries 8 significant bits, so its own rounding is worth up to 2.8e-3 in
    log2; the quartic (a minimax fit over the 128 mantissas, max error 1.0e-4) stays far
    under that, and costs a shift, two masks and four FMAs instead of fp32 ``log2``'s range
    reduction and longer polynomial. Subnormals (p below 1e-38) come out slightly off: their
    ``dz`` terms are that small too.
    """
    bits = b_raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    exponent = (bits >> 7) - 127
    f = (bits & 0x7F).to(tl.float32) * (1.0 / 128.0)
    return exponent.to(tl.float32) + f * (1.43909132 + f * (-0.68052689 + f * (0.32680567 + f * -0.0855058)))


@triton.jit(
    do_not_specialize=["N"],
    do_not_specialize_on_alignment=[
        "tmax_ptr",
        "perm_ptr",
        "count_ptr",
        "labels_ptr",
        "lse_ptr",
        "ent_ptr",
        "g_ptr",
        "e_ptr",
        "inv_temp_ptr",
    ],
)
def dz_from_buffer_kernel(
    buf_ptr,
    tmax_ptr,
    perm_ptr,
    count_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    g_ptr,
    e_ptr,
    N,
    V,
    n_tiles_v,
    inv_temp,
    inv_temp_ptr,
    HAS_G: tl.constexpr,
    HAS_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    ROW_TEMP: tl.constexpr = False,
):
    """In place: the forward's ``2^(z₂ - tile max)`` buffer becomes ``dz / T`` (buffer mode, docs/kernels.md).

    ``p = buf · 2^(tile max - lse₂)``, ``log p = ln2·(log2 buf + tile max - lse₂)``; the
    tile is one forward tile (same ``BLOCK_N``), so one tile max per row. No GEMM: the
    recompute of the logits is skipped. The buffer's rows are in compacted order (valid rows
    first, as the forward stored them); rows past the valid count are zeroed. Programs walk
    the vocab fastest (``pid_n`` minor), so each streams whole rows: DRAM pages stay open.
    """
    pid = tl.program_id(0)
    pid_m = pid // n_tiles_v
    pid_n = pid % n_tiles_v
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_m < N
    ok = offs_m < tl.load(count_ptr)
    rows = tl.load(perm_ptr + offs_m, mask=ok, other=0)
    col_ok = cols < V
    mask = ok[:, None] & col_ok[None, :]
    ptrs = buf_ptr + offs_m.to(tl.int64)[:, None] * V + cols[None, :]
    b_raw = tl.load(ptrs, mask=mask, other=0.0)
    b = b_raw.to(tl.float32)
    lse2 = tl.load(lse_ptr + rows, mask=ok, other=0.0) * LOG2E
    shift = tl.load(tmax_ptr + offs_m.to(tl.int64) * n_tiles_v + pid_n, mask=ok, other=0.0) - lse2
    p = b * tl.exp2(shift)[:, None]
    if ROW_TEMP:
        inv_t = tl.load(inv_temp_ptr + rows, mask=ok, other=1.0)
    else:
        inv_t = inv_temp
    if HAS_G:
        g_t = tl.where(ok, tl.load(g_ptr + rows, mask=ok, other=0.0) * inv_t, 0.0)
    else:
        g_t = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_E:
        ent = tl.load(ent_ptr + rows, mask=ok, other=0.0)
        e_t = tl.where(ok, tl.load(e_ptr + rows, mask=ok, other=0.0) * inv_t, 0.0)
        if FAST_LOG2:
            log2_b = _log2_bf16(b_raw)
        else:
            # The floor keeps log2 finite where b underflowed to 0 (masked below). A literal
            # under fp32's smallest normal (e.g. 1e-38) would make Triton compute in fp64.
            log2_b = tl.log2(tl.maximum(b, 1e-30))
        log_p = (log2_b + shift[:, None]) * LN2
        q = e_t[:, None] * (log_p + ent[:, None]) + g_t[:, None]
    else:
        q = g_t[:, None] + tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # b != 0, not b > 0: a NaN (from a NaN input row) must reach dz, not be masked to 0 with the underflows.
    dz = tl.where(mask & (b != 0), -p * q, 0.0)
    if HAS_G:
        labels = tl.load(labels_ptr + rows, mask=ok, other=-1).to(tl.int32)
        dz += tl.where(cols[None, :] == labels[:, None], g_t[:, None], 0.0)
    tl.store(ptrs, dz.to(buf_ptr.dtype.element_ty), mask=in_n[:, None] & col_ok[None, :])
