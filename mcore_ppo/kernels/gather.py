"""The student's sparse part on the GPU: the logits at ``k`` weight rows per token, and the
one-hot gradients at those ids folded into the dense backward's ``dz``.

- ``gather_dot_kernel`` (forward): one program per token, ``z[t, j] = Σ_h x[t, h]·W[id[t, j], h]``
  in fp32 multiply-adds of upcast operands (no tensor cores: fp32 inputs keep fp32 products).
  The ids are local to the shard, ``-1`` for a slot that is not in it (another rank's id, or an
  ignored slot): such a slot gets 0 and no work (the in-shard slots are compacted into blocks
  of ``BLOCK_J`` first; a token without any, e.g. an ignored one whose ``x`` may be inf
  padding, never reads ``x``).
- ``onehot_merge_kernel`` (backward, once per call): per token, the ``k`` slots' upstream
  gradients merged by id (a duplicate id's slots summed, in a fixed order: the same bits every
  run) and scaled by the row's ``1/T``, written in the backward's compacted row order with
  ``-1`` for every slot but an id's first.
- ``onehot_add_kernel`` (backward, per ``dz`` buffer or vocab chunk, between the kernel that
  writes ``dz`` and the GEMMs that read it): ``dz[r, id - v0] += merged`` for the merged ids
  inside the chunk. After the merge each (row, id) is written by one lane of one program: no
  atomics. The sum is formed in fp32 and stored in ``dz``'s dtype, so ``d_hidden = dz @ W`` and
  ``d_W = dzᵀ @ x`` of the triton backend carry the one-hot terms with no kernel of their own.
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
    BLOCK_K: tl.constexpr,
):
    """``out [N, K]`` fp32: the dot of token ``t``'s hidden row with each of its ``K`` weight rows.

    The token's in-shard slots are taken ``BLOCK_J`` at a time in slot order (a slot's rank
    among them, from a prefix sum over ``BLOCK_K`` slots per step, picks it into its block), so
    a token with few of its ids in the shard (TP > 1) runs one short block, not all ``K`` slots."""
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_J)
    offs_h = tl.arange(0, BLOCK_H)
    ids_row = ids_ptr + t * K
    out_row = out_ptr + t * K
    count = tl.zeros((), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        slot = k0 + offs_k
        ids = tl.load(ids_row + slot, mask=slot < K, other=-1)
        tl.store(out_row + slot, tl.zeros((BLOCK_K,), tl.float32), mask=(slot < K) & (ids < 0))
        count += tl.sum((ids >= 0).to(tl.int32), 0)
    for c0 in range(0, count, BLOCK_J):
        rank_wanted = c0 + offs_j
        slot_of = tl.zeros((BLOCK_J,), tl.int32)
        before = tl.zeros((), tl.int32)
        for k0 in range(0, K, BLOCK_K):
            slot = k0 + offs_k
            ok = (tl.load(ids_row + slot, mask=slot < K, other=-1) >= 0).to(tl.int32)
            rank = before + tl.cumsum(ok, 0) - ok
            pick = (ok != 0)[None, :] & (rank[None, :] == rank_wanted[:, None])
            slot_of += tl.sum(tl.where(pick, slot[None, :], 0), 1)
            before += tl.sum(ok, 0)
        found = rank_wanted < count
        rows = tl.load(ids_row + slot_of, mask=found, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_J, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            col_ok = cols < H
            x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + rows[:, None] * stride_w + cols[None, :], mask=found[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            acc += w * x[None, :]
        tl.store(out_row + slot_of, tl.sum(acc, 1), mask=found)


@triton.jit(do_not_specialize=["N", "K"], do_not_specialize_on_alignment=["ids_ptr", "g_ptr", "inv_temp_ptr"])
def onehot_merge_kernel(
    ids_ptr,
    g_ptr,
    perm_ptr,
    count_ptr,
    ids_out_ptr,
    g_out_ptr,
    N,
    K,
    inv_temp,
    inv_temp_ptr,
    BLOCK_K: tl.constexpr,
    ROW_TEMP: tl.constexpr,
):
    """Compacted row ``r`` (token ``perm[r]``): ``ids_out[r, i]`` = the token's ``ids[·, i]``
    where slot ``i`` holds the first of its id's slots, else -1; ``g_out[r, i]`` = the sum of
    ``g`` over that id's slots times ``1/T`` (fp32). Rows past ``count`` get -1 throughout.

    ``O(K²)`` comparisons per token, ``BLOCK_K × BLOCK_K`` at a time (``K`` is a teacher's top-k:
    tens of ids). A slot with id -1 is never written and never summed into another's."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    if r >= tl.load(count_ptr):
        for i0 in range(0, K, BLOCK_K):
            tl.store(ids_out_ptr + r * K + i0 + offs, tl.full((BLOCK_K,), -1, tl.int64), mask=i0 + offs < K)
        return
    row = tl.load(perm_ptr + r).to(tl.int64)
    if ROW_TEMP:
        inv_t = tl.load(inv_temp_ptr + row)
    else:
        inv_t = inv_temp
    for i0 in range(0, K, BLOCK_K):
        slot_i = i0 + offs
        id_i = tl.load(ids_ptr + row * K + slot_i, mask=slot_i < K, other=-1).to(tl.int64)
        total = tl.zeros((BLOCK_K,), tl.float32)
        first = id_i >= 0
        for j0 in range(0, K, BLOCK_K):
            slot_j = j0 + offs
            id_j = tl.load(ids_ptr + row * K + slot_j, mask=slot_j < K, other=-1).to(tl.int64)
            g_j = tl.load(g_ptr + row * K + slot_j, mask=slot_j < K, other=0.0)
            same = (id_i[:, None] == id_j[None, :]) & (id_j >= 0)[None, :]
            # where, not a product: a slot outside the shard may carry anything in g.
            total += tl.sum(tl.where(same, g_j[None, :], 0.0), 1)
            earlier = same & (slot_j[None, :] < slot_i[:, None])
            first = first & (tl.max(earlier.to(tl.int32), 1) == 0)
        tl.store(ids_out_ptr + r * K + slot_i, tl.where(first, id_i, -1), mask=slot_i < K)
        tl.store(g_out_ptr + r * K + slot_i, total * inv_t, mask=slot_i < K)


@triton.jit(do_not_specialize=["N", "K", "v0", "VC"], do_not_specialize_on_alignment=["ids_ptr", "g_ptr"])
def onehot_add_kernel(
    dz_ptr,
    ids_ptr,
    g_ptr,
    N,
    K,
    v0,
    VC,
    stride_dz,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``dz[r, ids[r, i] - v0] += g[r, i]`` for the ids in ``[v0, v0 + VC)``, the sum in fp32
    stored in ``dz``'s dtype; ``ids``/``g`` from :func:`onehot_merge_kernel` (each id once per row)."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        slot = k0 + offs_k
        at = offs_r[:, None] * K + slot[None, :]
        in_bounds = (offs_r < N)[:, None] & (slot < K)[None, :]
        col = tl.load(ids_ptr + at, mask=in_bounds, other=-1) - v0
        hit = in_bounds & (col >= 0) & (col < VC)
        g = tl.load(g_ptr + at, mask=hit, other=0.0)
        ptrs = dz_ptr + offs_r[:, None] * stride_dz + col
        old = tl.load(ptrs, mask=hit, other=0.0).to(tl.float32)
        tl.store(ptrs, (old + g).to(dz_ptr.dtype.element_ty), mask=hit)
