"""Small numeric helpers shared by the head, its backends and the teacher's top-k (one place each)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch


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
