"""fp32 operands as fp16 parts, laid out so that one fp16 GEMM over three times the hidden size
gives their fp32 product: the GEMM operands of ``precision="fp32_faithful"``.

Each row is first scaled by a power of two (exact), ``2^(141 - E)`` for the biased exponent
``E`` of its largest magnitude, so that its largest value lies in ``[2^14, 2^15)``: fp16's range
then holds the row's values and their remainders. A scaled value ``x`` is ``a1 + a2 + r`` with
``a1`` its fp16 rounding, ``a2`` the fp16 rounding of ``x - a1`` (exact in fp32) and
``|r| <= 2^-22 |x|``. Of a product's four part products the three kept ones are exact in an fp32
accumulator, and the dropped ``a2·b2`` and the remainders come to about ``2^-22 |x||w|``: fp16
and TF32 keep the same 11 significant bits, so this is the "3×TF32" split (CUTLASS's
``tf32x3``), on fp16 tensor cores, which run at twice TF32's rate, with half the bytes. Placed
side by side along K,

    rows (hidden):     [a1, a1, a2]
    columns (weight):  [b1, b2, b1]

``x @ w.T`` over ``h`` becomes an fp16 ``x3 @ w3.T`` over ``3h``, which the GEMM kernels run
with ``PARTS`` (:func:`mcore_ppo.kernels.common.tile_dot`: promoted accumulation, then the tile
scaled back by ``2^(E - 141)`` per row and per column, the ``unscale`` this kernel writes).

A row holding an inf keeps scale 1: its parts carry the inf (and ``inf - inf``, a NaN) into the
product; a NaN is carried by its own parts whatever the scale (never a finite number). Rows
below ``2^-112`` (zeros, subnormals) take the smallest scale-back, ``2^-126``.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["H", "stride_src"])
def split_kernel(src_ptr, dst_ptr, unscale_ptr, H, stride_src, COLUMNS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``dst[r]`` = the parts of row ``r`` of ``src`` (``[rows, 3H]`` fp16, ``COLUMNS``: the
    weight's order) and ``unscale[r]`` its scale-back; one program per row (module doc)."""
    row = tl.program_id(0).to(tl.int64)
    src = src_ptr + row * stride_src
    largest = tl.zeros((BLOCK_H,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        largest = tl.maximum(largest, tl.abs(tl.load(src + offs, mask=offs < H, other=0.0)))
    exponent = (tl.max(largest, 0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.where(exponent == 255, 141, tl.maximum(exponent, 15))
    scale = ((268 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(141 - E)
    tl.store(unscale_ptr + row, ((exponent - 14) << 23).to(tl.float32, bitcast=True))  # 2^(E - 141)
    dst = dst_ptr + row * 3 * H
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = offs < H
        x = tl.load(src + offs, mask=in_h, other=0.0) * scale
        a1 = x.to(tl.float16)
        a2 = (x - a1.to(tl.float32)).to(tl.float16)
        tl.store(dst + offs, a1, mask=in_h)
        if COLUMNS:
            tl.store(dst + H + offs, a2, mask=in_h)
            tl.store(dst + 2 * H + offs, a1, mask=in_h)
        else:
            tl.store(dst + H + offs, a1, mask=in_h)
            tl.store(dst + 2 * H + offs, a2, mask=in_h)
