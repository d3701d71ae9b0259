"""Device-side compaction of the valid rows, in one launch (no host sync, no ``nonzero``)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["valid_ptr", "perm_ptr", "count_ptr"])
def compact_kernel(valid_ptr, perm_ptr, count_ptr, N, BLOCK: tl.constexpr):
    """One program: ``perm`` = valid rows in order, then ignored rows in order; ``count``.

    Two passes over ``valid`` (a count, then a running prefix sum per block), so that ignored
    rows can be placed after all valid ones.
    """
    total = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(valid_ptr + offs, mask=offs < N, other=0).to(tl.int32), 0)
    tl.store(count_ptr, total)
    valid_before = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_n = offs < N
        flags = tl.load(valid_ptr + offs, mask=in_n, other=0).to(tl.int32)
        inclusive = tl.cumsum(flags, 0)
        ranks_valid = valid_before + inclusive - flags  # exclusive prefix among valid rows
        ranks_ignored = total + (offs - valid_before - (inclusive - flags))  # among ignored rows
        dest = tl.where(flags != 0, ranks_valid, ranks_ignored)
        tl.store(perm_ptr + dest, offs, mask=in_n)
        valid_before += tl.sum(flags, 0)


@triton.jit
def contiguous_block(perm_ptr, count, N, row0, BLOCK_M):
    """``(direct, first)``: compacted rows ``row0 .. row0+BLOCK_M-1`` are all valid and are the
    consecutive original rows ``first ..``, so a tile can read them in place.

    ``perm``'s valid part is increasing, so its first and last entries decide it.
    """
    last_row = row0 + BLOCK_M - 1
    first = tl.load(perm_ptr + row0)
    last = tl.load(perm_ptr + tl.minimum(last_row, N - 1))
    return (last_row < count) & (last - first == BLOCK_M - 1), first


@triton.jit(do_not_specialize=["N", "skip_block_m"], do_not_specialize_on_alignment=["perm_ptr", "count_ptr"])
def gather_rows_kernel(src_ptr, perm_ptr, count_ptr, dst_ptr, N, H, stride_src, skip_block_m, BLOCK_H: tl.constexpr):
    """``dst[r] = src[perm[r]]`` for ``r < count``, zeros after: one program per row.

    The zeros are written, not computed as ``0·src``: an inf in an ignored row stays out.
    ``skip_block_m`` > 0 (a runtime value: one compiled variant for the forward's use and the
    backward's): rows of blocks of that many rows that :func:`contiguous_block` says are read
    in place are not copied (their ``dst`` rows stay unwritten).
    """
    r = tl.program_id(0)
    count = tl.load(count_ptr)
    if skip_block_m > 0:
        direct, _ = contiguous_block(perm_ptr, count, N, (r // skip_block_m) * skip_block_m, skip_block_m)
        if direct:
            return
    keep = r < count
    src_row = tl.load(perm_ptr + r).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = offs < H
        values = tl.load(src_ptr + src_row * stride_src + offs, mask=in_h & keep, other=0.0)
        tl.store(dst_ptr + r.to(tl.int64) * H + offs, values, mask=in_h)


@triton.jit(do_not_specialize_on_alignment=["perm_ptr"])
def scatter_rows_kernel(src_ptr, perm_ptr, dst_ptr, H, BLOCK_H: tl.constexpr):
    """``dst[perm[r]] = src[r]`` (cast to ``dst``'s dtype): rows back to their places."""
    r = tl.program_id(0)
    dst_row = tl.load(perm_ptr + r).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = offs < H
        values = tl.load(src_ptr + r.to(tl.int64) * H + offs, mask=in_h, other=0.0)
        tl.store(dst_ptr + dst_row * H + offs, values.to(dst_ptr.dtype.element_ty), mask=in_h)


@triton.jit(
    do_not_specialize=["N", "stride_l", "ignore_index", "vocab_start", "V"],
    do_not_specialize_on_alignment=["labels_ptr", "local_ptr", "valid_ptr", "perm_ptr", "count_ptr", "y_ptr"],
)
def tokens_kernel(
    labels_ptr,
    local_ptr,
    valid_ptr,
    perm_ptr,
    count_ptr,
    y_ptr,
    N,
    stride_l,
    ignore_index,
    vocab_start,
    V,
    BLOCK: tl.constexpr,
    SAVE: tl.constexpr,
):
    """One program: the per-token preparation of a forward, from the global ``labels``.

    ``valid = label != ignore_index``; ``local = label - vocab_start`` where that lies in this
    shard's ``[0, V)`` and the token is valid, else -1 (int64); ``perm`` and ``count`` as
    :func:`compact_kernel`; ``y`` (the label logits the forward kernel stores into) zeroed.
    Labels are compared in int64 (``ignore_index`` never wraps). ``valid`` is written only with
    ``SAVE`` (a backward will read it).
    """
    total = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_n = offs < N
        label = tl.load(labels_ptr + offs.to(tl.int64) * stride_l, mask=in_n, other=0).to(tl.int64)
        ok = in_n & (label != ignore_index)
        local = label - vocab_start
        in_shard = ok & (local >= 0) & (local < V)
        tl.store(local_ptr + offs, tl.where(in_shard, local, -1), mask=in_n)
        if SAVE:
            tl.store(valid_ptr + offs, ok, mask=in_n)
        tl.store(y_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=in_n)
        total += tl.sum(ok.to(tl.int32), 0)
    tl.store(count_ptr, total)
    valid_before = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_n = offs < N
        label = tl.load(labels_ptr + offs.to(tl.int64) * stride_l, mask=in_n, other=0).to(tl.int64)
        flags = (in_n & (label != ignore_index)).to(tl.int32)
        inclusive = tl.cumsum(flags, 0)
        ranks_valid = valid_before + inclusive - flags
        ranks_ignored = total + (offs - valid_before - (inclusive - flags))
        dest = tl.where(flags != 0, ranks_valid, ranks_ignored)
        tl.store(perm_ptr + dest, offs, mask=in_n)
        valid_before += tl.sum(flags, 0)
