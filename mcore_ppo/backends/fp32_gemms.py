"""cuBLAS products with fp32 outputs from 16-bit operands: the backward's ``d_hidden`` and
``d_W`` GEMMs over the kernels' ``dz`` tiles, and the distillation reference's logits.

Whether this torch's products take ``out_dtype`` is asked once per process and device type
(:func:`fp32_output_gemms`, a probe on tiny tensors); the routes without it give the same
fp32-accumulated result in more passes.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def fp32_output_gemms(device_type: str = "cuda") -> tuple[bool, bool]:
    """``(mm, addmm)``: whether ``torch.mm(a, b, out_dtype=float32)`` and ``torch.addmm(c, a, b,
    out_dtype=float32, out=c)`` exist for bf16 operands on ``device_type`` (torch >= 2.8 on CUDA).

    Decided once per process by a probe on 2 x 2 tensors, never by catching errors of the real
    products: an error there (out of memory above all) propagates to the caller."""
    if device_type != "cuda":
        return False, False
    return probe_out_dtype(device_type)


def probe_out_dtype(device_type: str) -> tuple[bool, bool]:
    """The probe of :func:`fp32_output_gemms` on ``device_type``, uncached."""
    a = torch.zeros(2, 2, dtype=torch.bfloat16, device=device_type)
    c = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
    return _takes_out_dtype(lambda: torch.mm(a, a, out_dtype=torch.float32)), _takes_out_dtype(
        lambda: torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    )


def _takes_out_dtype(probe) -> bool:
    try:
        probe()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):  # no out_dtype overload in this torch
        return False
    return True


def addmm_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with fp32 ``out`` and low-precision ``a``, ``b``.

    cuBLAS does it in one GEMM with fp32 output and ``beta = 1`` (``addmm(..., out_dtype=
    float32)``, torch >= 2.8 on CUDA), so partial sums are never rounded to bf16; older torch
    gets an fp32-output product added separately, or at worst a bf16 product
    (:func:`fp32_output_gemms` decides which, once).
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if not a.is_cuda:
        out.add_(torch.mm(a.float(), b.float()))
        return
    mm, addmm = fp32_output_gemms(a.device.type)
    if addmm:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    elif mm:
        out.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        out.add_(torch.mm(a, b))


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, overwrite: bool) -> None:
    """``out = a @ b`` (``overwrite``: ``out`` holds no values yet) or ``out += a @ b``.

    Overwriting in ``out``'s own dtype is one GEMM that neither needs ``out`` zero-filled first
    nor reads it; otherwise :func:`addmm_fp32` (after a zero fill when ``out`` is unset).
    """
    if overwrite and a.dtype == out.dtype:
        torch.mm(a, b, out=out)
        return
    if overwrite:
        out.zero_()
    addmm_fp32(out, a, b)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a new fp32 tensor from low-precision ``a``, ``b`` (fp32 accumulation).

    On CUDA one GEMM with an fp32 output (``mm(..., out_dtype=float32)``, torch >= 2.8): unlike
    :func:`addmm_fp32` into a zeroed buffer, nothing is zero-filled first and the GEMM does not
    read an accumulator (``n x h`` fp32 twice: ~0.1 ms at 16384 x 3584 on an H200). The same
    result to the bit: ``0 + x`` is ``x``. Elsewhere, or on an older torch, exactly that route.
    """
    if a.is_cuda and a.dtype != torch.float32 and fp32_output_gemms(a.device.type)[0]:
        return torch.mm(a, b, out_dtype=torch.float32)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    addmm_fp32(out, a, b)
    return out
