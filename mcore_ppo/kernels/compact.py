"""Device-side compaction of the valid rows, in one launch (no host sync, no ``nonzero``)."""

import triton
import triton.language as tl


@triton.jit
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
