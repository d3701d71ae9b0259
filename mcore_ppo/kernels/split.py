"""fp32 operands as sums of bf16 parts, laid out so that one bf16 GEMM gives their fp32 product.

An fp32 value is exactly ``a1 + a2 + a3`` with each part bf16 (``a1`` its bf16 rounding, ``a2``
the remainder's, ``a3`` what is left: each remainder is exact in fp32). A product ``x·w`` of two
such values is, to below fp32 rounding, the six products whose parts' orders sum to at most 4
(Henry et al., "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision
Computations", 2019: "bf16x6"); the three dropped ones are below ``2^-23·|x||w|`` together
(casts that round to nearest: ``|a2| ≤ 2^-8|x|``, ``|a3| ≤ 2^-16|x|``), the size of one fp32
rounding of the product, where three TF32 products drop about ``2^-21``. Each
bf16 product is exact in an fp32 accumulator, so placing the parts side by side along K,

    rows (hidden):     [a3, a2, a1, a2, a1, a1]
    columns (weight):  [b1, b2, b3, b1, b2, b1]

turns ``x @ w.T`` over ``h`` into a bf16 ``x6 @ w6.T`` over ``6h`` on the tensor cores, with the
small products accumulated first. ``split_kernel`` writes one operand's ``[rows, 6h]`` copy in one
pass: one program per (row, block of columns).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["H", "stride_src"])
def split_kernel(src_ptr, dst_ptr, H, stride_src, COLUMNS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``dst[r] = parts of src[r]`` in the order of the module doc (``COLUMNS``: the weight's)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    x = tl.load(src_ptr + row * stride_src + offs, mask=in_h, other=0.0)
    a1 = x.to(tl.bfloat16)
    rest = x - a1.to(tl.float32)  # exact: x minus its own rounding
    a2 = rest.to(tl.bfloat16)
    a3 = (rest - a2.to(tl.float32)).to(tl.bfloat16)  # exact, and exactly representable
    out = dst_ptr + row * 6 * H + offs
    if COLUMNS:
        tl.store(out, a1, mask=in_h)
        tl.store(out + H, a2, mask=in_h)
        tl.store(out + 2 * H, a3, mask=in_h)
        tl.store(out + 3 * H, a1, mask=in_h)
        tl.store(out + 4 * H, a2, mask=in_h)
        tl.store(out + 5 * H, a1, mask=in_h)
    else:
        tl.store(out, a3, mask=in_h)
        tl.store(out + H, a2, mask=in_h)
        tl.store(out + 2 * H, a1, mask=in_h)
        tl.store(out + 3 * H, a2, mask=in_h)
        tl.store(out + 4 * H, a1, mask=in_h)
        tl.store(out + 5 * H, a1, mask=in_h)
