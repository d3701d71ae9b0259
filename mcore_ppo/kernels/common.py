"""Shared device helpers: the grouped tile order, the ``x @ w.T`` tile GEMM, and the top-k's
order keys (fp32 values as ordered int bits, and int64 keys of a value and its column).

Compile-once rule for every kernel here: Triton compiles a kernel anew for each combination of
integer arguments' divisibility by 16 and pointer arguments' 16-byte alignment it sees. Token
counts (``N``, one micro-batch to the next) and the per-token vectors (labels, ``lse``, upstream
gradients: often views into packed buffers, at offsets that follow the token count) would
multiply those variants, and each costs a compile of ~1 s in the middle of training. They are
listed in ``do_not_specialize`` / ``do_not_specialize_on_alignment``: the vectors are read one
scalar per row, so alignment buys nothing there. The operand matrices keep their
specialisation (vectorised loads); they are ours (gathered rows, workspaces) or parameters.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` in GROUP_M-row swizzled order.

    Programs that run at the same time share a few hidden row blocks (kept in L2) while they
    sweep the vocab, so the weight is streamed from HBM ``n / (BLOCK_M·GROUP_M)`` times
    instead of once per row block.
    """
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    """``acc + a @ b.T`` with the dot ``DOT`` names (the native one compiles as it always did)."""
    if DOT == "ieee":
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _add_rn(acc, part, INTERPRETED: tl.constexpr):
    """``acc + part`` in fp32, rounded to nearest, as an instruction the compiler cannot fold
    into the tensor-core accumulation: Triton rewrites ``acc + dot(a, b)`` into
    ``dot(a, b, acc)``, which is what this add exists to avoid (``PARTS`` in :func:`tile_dot`).
    The interpreter has no inline PTX; its numpy adds round to nearest already."""
    if INTERPRETED:
        return acc + part
    return tl.inline_asm_elementwise(
        "add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, part], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _step(a, b, acc, UPCAST: tl.constexpr, DOT: tl.constexpr, PARTS: tl.constexpr):
    """One K slice of :func:`tile_dot` into ``acc``: chained in the tensor cores, or with
    ``PARTS`` formed from zero and added in fp32 (promoted accumulation)."""
    if UPCAST:  # the interpreter's bf16 arithmetic is wrong: compute in fp32 there
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if PARTS:
        return _add_rn(acc, _dot(a, b, tl.zeros(acc.shape, tl.float32), DOT), UPCAST)
    return _dot(a, b, acc, DOT)


@triton.jit
def tile_dot(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    rows,
    cols,
    row0,
    col0,
    H,
    stride_x,
    stride_w,
    x_unscale_ptr,
    w_unscale_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    PARTS: tl.constexpr = False,
):
    """fp32 ``x[rows] @ w[cols].T`` for one ``[BLOCK_M, BLOCK_N]`` tile.

    Pointer path: ``rows`` (gathered) and ``cols`` must be in bounds (callers clamp them and
    mask the results), so the main loop needs no row/column predicates; only a ragged hidden
    size masks ``k``. TMA path (``USE_TMA``): the tile is the contiguous block at
    ``(row0, col0)`` of the descriptors (rows already compacted by the host); the copy engine
    zero-fills out-of-bounds rows, columns and ``k``.

    ``DOT``: ``"native"`` (the operands' own tensor-core dot) or ``"ieee"`` (fp32 operands:
    :class:`mcore_ppo.numerics.Numerics`).

    ``PARTS``: the operands are fp32 ones' fp16 parts (:mod:`mcore_ppo.kernels.split`, ``H`` is
    three times the hidden size), each K slice's product is formed from zero and added to the
    tile in fp32, and the tile is scaled back by ``x_unscale[rows]`` and ``w_unscale[cols]``
    (``rows``: the original row of each tile row, on both paths). The tensor cores' fp32
    accumulation truncates: summed over thousands of K in them, the logits shrink by a few
    1e-6 of their size (docs/kernels.md#numerics); over one slice, by ~1e-8.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            a = x_desc.load([row0, k * BLOCK_K])
            b = w_desc.load([col0, k * BLOCK_K])
            acc = _step(a, b, acc, UPCAST, DOT, PARTS)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        b_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < H - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            acc = _step(a, b, acc, UPCAST, DOT, PARTS)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if PARTS:
        acc = acc * tl.load(x_unscale_ptr + rows)[:, None] * tl.load(w_unscale_ptr + cols)[None, :]
    return acc


@triton.jit
def ordered_bits(value):
    """fp32 values as int32 in the same order (``-0.0`` as ``+0.0``, which compare equal)."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def value_of_bits(ordered):
    """The fp32 value of :func:`ordered_bits`' int32 (the inverse map)."""
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def order_key(value, col):
    """int64 keys ordered as the tie rule (larger fp32 value, then smaller column): the value's
    order-preserving bits above ``2**31 - 1 - col``."""
    return (ordered_bits(value).to(tl.int64) << 32) | (2147483647 - col.to(tl.int64))  # 2**31 - 1 - col


@triton.jit
def key_value(key):
    """The fp32 value of an :func:`order_key`."""
    return value_of_bits((key >> 32).to(tl.int32))


@triton.jit
def key_col(key):
    """The column of an :func:`order_key`."""
    return 2147483647 - (key & 0xFFFFFFFF)
