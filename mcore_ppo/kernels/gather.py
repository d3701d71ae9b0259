"""The student's sparse part: logits and gradients at ``k`` weight rows per token, in fp32.

The ids are local to the shard, ``-1`` for a slot that is not in it (another rank's id, or an
ignored slot): such a slot's loads are masked, so it costs no memory traffic. Products are
fp32 multiply-adds of upcast operands (no tensor cores), so fp32 inputs keep fp32 products.

- ``gather_dot_kernel``: one program per token, ``z[t, j] = Σ_h x[t, h]·W[id[t, j], h]``;
  masked slots get 0 (also when ``x`` is not finite: ignored tokens may carry inf padding).
- ``gather_rows_sum_kernel``: one program per (token, block of ``h``),
  ``d_hidden[t, :] += Σ_j g[t, j]·W[id[t, j], :]`` into an fp32 buffer; the program owns its
  slice, so no atomics.
- ``segment_outer_kernel``: ``d_W[id, :] += Σ g·x[token, :]`` over the (id, token) pairs sorted
  by id (the sentinel ``V`` for skipped pairs sorts last). One program per (block of
  ``BLOCK_P`` sorted pairs, block of ``h``) owns every id segment that *starts* in its block and
  follows it past the block's end: each row of ``d_W`` is written by one program, without
  atomics, in a fixed order, so the result is the same bits on every run. Blocks of skipped
  pairs exit at once.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "K", "H"], do_not_specialize_on_alignment=["ids_ptr", "out_ptr"])
def gather_dot_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    N,
    K,
    H,
    stride_x,
    stride_w,
    BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out [N, K]`` fp32: the dot of token ``t``'s hidden row with each of its ``K`` weight rows."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    for j0 in range(0, K, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        ids = tl.load(ids_ptr + t * K + offs_j, mask=offs_j < K, other=-1)
        ok = ids >= 0
        rows = tl.where(ok, ids, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_J, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            col_ok = cols < H
            x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + rows[:, None] * stride_w + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            acc += w * x[None, :]
        z = tl.sum(acc, 1)
        tl.store(out_ptr + t * K + offs_j, tl.where(ok, z, 0.0), mask=offs_j < K)


@triton.jit(do_not_specialize=["N", "K", "H"], do_not_specialize_on_alignment=["ids_ptr", "g_ptr"])
def gather_rows_sum_kernel(
    w_ptr,
    ids_ptr,
    g_ptr,
    out_ptr,
    N,
    K,
    H,
    stride_w,
    stride_out,
    BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t, h-block] += Σ_j g[t, j]·W[ids[t, j], h-block]`` (``out`` fp32, ``g`` fp32 ``[N, K]``)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_J, BLOCK_H), dtype=tl.float32)
    for j0 in range(0, K, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        ids = tl.load(ids_ptr + t * K + offs_j, mask=offs_j < K, other=-1)
        ok = ids >= 0
        rows = tl.where(ok, ids, 0).to(tl.int64)
        g = tl.load(g_ptr + t * K + offs_j, mask=ok, other=0.0)
        w = tl.load(
            w_ptr + rows[:, None] * stride_w + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)
        acc += g[:, None] * w
    out_ptrs = out_ptr + t * stride_out + cols
    total = tl.load(out_ptrs, mask=col_ok, other=0.0) + tl.sum(acc, 0)
    tl.store(out_ptrs, total, mask=col_ok)


@triton.jit
def _segment_add(v_a, f_a, v_b, f_b):
    """Segmented sum: a flagged element (a segment's first) restarts the running sum."""
    return tl.where(f_b != 0, v_b, v_a + v_b), f_a | f_b


@triton.jit(
    do_not_specialize=["P", "V", "H"],
    do_not_specialize_on_alignment=["sorted_ids_ptr", "tokens_ptr", "g_ptr"],
)
def segment_outer_kernel(
    x_ptr,
    sorted_ids_ptr,
    tokens_ptr,
    g_ptr,
    dw_ptr,
    P,
    V,
    H,
    stride_x,
    stride_dw,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``dw[id, h-block] += Σ g·x[token, h-block]`` over the pairs ``(sorted_ids, tokens, g)``
    (``P`` of them, ids ascending, ``V`` for a pair to skip); see the module doc.

    The block's ``[BLOCK_P, BLOCK_H]`` products are summed per id by a segmented scan; each
    segment's total sits at its last pair and is added to its row there. Pairs of a segment that
    started in an earlier block are left to that block's program; the block's last segment is
    followed past the block's end, ``BLOCK_P`` pairs at a time, and its rest added at the end."""
    p0 = tl.program_id(0) * BLOCK_P
    lanes = tl.arange(0, BLOCK_P)
    offs = p0 + lanes
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    first = tl.load(sorted_ids_ptr + p0)
    if first < V:
        ids = tl.load(sorted_ids_ptr + offs, mask=offs < P, other=V)
        before = tl.load(sorted_ids_ptr + offs - 1, mask=offs > 0, other=-1)
        after = tl.load(sorted_ids_ptr + offs + 1, mask=offs + 1 < P, other=V + 1)
        lead = tl.load(sorted_ids_ptr + p0 - 1, mask=p0 > 0, other=-1)
        owned = (ids != lead) & (ids < V)
        start = (lanes == 0) | (ids != before)
        end = (ids != after) | (lanes == BLOCK_P - 1)
        tok = tl.load(tokens_ptr + offs, mask=owned, other=0).to(tl.int64)
        g = tl.load(g_ptr + offs, mask=owned, other=0.0)
        x = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=owned[:, None] & col_ok[None, :], other=0.0)
        prod = g[:, None] * x.to(tl.float32)
        flags = tl.broadcast_to(start[:, None], (BLOCK_P, BLOCK_H)).to(tl.int32)
        sums, _ = tl.associative_scan((prod, flags), 0, _segment_add)

        # The last segment may run past the block's end (only a full block has pairs after it).
        last = tl.load(sorted_ids_ptr + p0 + BLOCK_P - 1, mask=p0 + BLOCK_P - 1 < P, other=V)
        tail = tl.zeros((BLOCK_H,), dtype=tl.float32)
        q = p0 + BLOCK_P
        going = (last != lead) & (last < V) & (q < P)
        while going:
            nxt = q + lanes
            same = tl.load(sorted_ids_ptr + nxt, mask=nxt < P, other=V) == last
            t_n = tl.load(tokens_ptr + nxt, mask=same, other=0).to(tl.int64)
            g_n = tl.load(g_ptr + nxt, mask=same, other=0.0)
            x_n = tl.load(
                x_ptr + t_n[:, None] * stride_x + cols[None, :], mask=same[:, None] & col_ok[None, :], other=0.0
            )
            tail += tl.sum(g_n[:, None] * x_n.to(tl.float32), 0)
            q += BLOCK_P
            going = (tl.sum(same.to(tl.int32), 0) == BLOCK_P) & (q < P)
        sums += tl.where((lanes == BLOCK_P - 1)[:, None], tail[None, :], 0.0)

        # One pair per segment (its last) writes the segment's row: no two lanes share a row.
        write = (owned & end)[:, None] & col_ok[None, :]
        ptrs = dw_ptr + ids.to(tl.int64)[:, None] * stride_dw + cols[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=write, other=0.0) + sums, mask=write)
