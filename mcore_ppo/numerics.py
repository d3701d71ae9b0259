"""Small numeric helpers shared by the head, its backends and the teacher's top-k (one place each)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: How fp32 operands of the head's GEMMs are multiplied (``precision=``). ``"auto"`` (default):
#: IEEE fp32 dots, exact and slow on tensor-core GPUs. ``"fp32_faithful"``: fp32 accuracy at
#: tensor-core speed on the triton backend: each operand as its fp16 parts, three fp16 products
#: per product (:mod:`mcore_ppo.kernels.split`; the weight's parts, 1.5× the fp32 weight's bytes,
#: are held while each forward and backward runs). ``"ieee"``: IEEE fp32 dots, said explicitly
#: (the reference). 16-bit operands' products are exact in the fp32 accumulator whatever is
#: chosen, so the choice changes only fp32 operands.
PRECISIONS = ("auto", "fp32_faithful", "ieee")


def check_precision(precision: object, name: str = "precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; TypeError / ValueError naming ``name`` otherwise."""
    if not isinstance(precision, str):
        raise TypeError(f"{name} must be a str, one of {PRECISIONS}, got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


@dataclass(frozen=True)
class Numerics:
    """The numerics of one shard's GEMMs: decided once per call signature from the operands'
    dtype and the backend's ``precision``, and part of the triton backend's launch plan.

    Attributes:
        operand_dtype: the dtype both operands enter the dot in: the inputs' own, or fp16 for
            fp32 inputs' parts.
        dot: ``"native"`` (tensor cores in ``operand_dtype``: exact products of 16-bit values,
            fp64 on the torch path), ``"ieee"`` (fp32 operands) or ``"fp16x3"`` (fp32 operands
            as their fp16 parts, :mod:`mcore_ppo.kernels.split`: the GEMM kernels read the
            parts, ``[rows, 3h]``, with promoted accumulation).

    The probability buffer and the backward's ``dz`` keep the inputs' dtype (a 16-bit ``dz``
    rounds once, as the 16-bit gradients do anyway); fp32 inputs' parts keep no buffer (fp16
    probabilities would round the fp32 backward) and recompute ``dz`` in fp32 from the parts.
    """

    operand_dtype: torch.dtype
    dot: str

    @property
    def parts(self) -> bool:
        """The GEMM kernels read the operands' fp16 parts (``dot == "fp16x3"``)."""
        return self.dot == "fp16x3"

    @staticmethod
    @functools.cache
    def of(dtype: torch.dtype, precision: str) -> Numerics:
        """The numerics of operands of ``dtype`` under ``precision`` (:data:`PRECISIONS`)."""
        if dtype != torch.float32:
            return Numerics(dtype, "native")
        if precision == "fp32_faithful":
            return Numerics(torch.float16, "fp16x3")
        return Numerics(dtype, "ieee")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs; fp64 inputs stay fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive blocks of at most ``size`` covering ``[0, total)``."""
    for start in range(0, total, size):
        yield start, min(start + size, total)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def next_power_of_two(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride in its last dim (a copy only when it has not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=64)
def max_entropy(vocab_size: int, dtype: torch.dtype) -> float:
    """``log V`` rounded *down* to ``dtype``, as a python float exact in ``dtype``.

    Computed on the host (no device work, no sync) so ``entropy <= log V`` holds exactly
    whatever way a clamp converts its scalar.
    """
    log_v = math.log(vocab_size)
    bound = torch.tensor(log_v, dtype=dtype)
    if bound.item() > log_v:
        bound = torch.nextafter(bound, torch.tensor(-math.inf, dtype=dtype))
    return bound.item()


def inverse_temperature(
    temperature: float | torch.Tensor, placeholder: torch.Tensor
) -> tuple[float, torch.Tensor, bool]:
    """``(inv_temp, inv_temp_rows, row_temp)`` for the Triton kernels: a float gives the scalar
    ``1/T`` and ``placeholder`` as the never-read vector; a per-token tensor gives ``1/T_i`` as
    an fp32 vector, each the fp32 rounding of the exact ``1/T_i`` (formed in fp64, as the scalar
    is), and a scalar 1.0 the kernels do not read."""
    if not isinstance(temperature, torch.Tensor):
        return 1.0 / temperature, placeholder, False
    return 1.0, (1.0 / temperature.to(torch.float64)).to(torch.float32).contiguous(), True
