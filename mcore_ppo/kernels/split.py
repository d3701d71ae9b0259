"""fp32 operands as sums of TF32 parts, laid out so that one TF32 GEMM gives their fp32 product.

An fp32 value ``x`` is ``hi + lo + r`` with ``hi`` its TF32 rounding (to nearest, ties away, as
``cvt.rna.tf32.f32``), ``lo`` the TF32 rounding of the exact remainder ``x - hi`` and
``|r| ≤ 2^-22 |x|``. A product ``x·w`` is then ``hi·hi' + hi·lo' + lo·hi'`` to about
``2^-21 |x||w|`` (the "3×TF32" of Triton's ``input_precision="tf32x3"`` and of CUTLASS): each
TF32 product is exact in an fp32 accumulator. Placing the parts side by side along K,

    rows (hidden):     [lo, hi, hi]
    columns (weight):  [hi, lo, hi]

turns ``x @ w.T`` over ``h`` into one TF32 ``x3 @ w3.T`` over ``3h`` with the small products
accumulated first, and the tensor cores read parts that are TF32 values already (their dot drops
nothing). Triton's own ``tf32x3`` splits the tiles in registers on every K step instead, which on
Hopper takes twice the time. ``split_kernel`` writes one operand's ``[rows, 3h]`` fp32 copy in one
pass: one program per (row, block of columns).
"""

import triton
import triton.language as tl


@triton.jit
def _tf32(x):
    """``x`` rounded to TF32 (10 fraction bits), to nearest with ties away from zero: the
    magnitude's bits plus half a TF32 unit, the 13 low bits cleared (inf and NaN stay so)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["H", "stride_src"])
def split_kernel(src_ptr, dst_ptr, H, stride_src, COLUMNS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``dst[r] = parts of src[r]`` in the order of the module doc (``COLUMNS``: the weight's)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    x = tl.load(src_ptr + row * stride_src + offs, mask=in_h, other=0.0)
    hi = _tf32(x)
    lo = tl.where(x == hi, 0.0, _tf32(x - hi))  # x - hi is exact in fp32 (inf: no remainder)
    out = dst_ptr + row * 3 * H + offs
    if COLUMNS:
        tl.store(out, hi, mask=in_h)
        tl.store(out + H, lo, mask=in_h)
    else:
        tl.store(out, lo, mask=in_h)
        tl.store(out + H, hi, mask=in_h)
    tl.store(out + 2 * H, hi, mask=in_h)
