"""Host side of the Triton kernels: tile configs, row compaction, copy-engine (TMA) decisions
(the fp32-output cuBLAS products that consume the kernels' ``dz`` tiles:
:mod:`mcore_ppo.backends.fp32_gemms`).

Pure functions of their arguments; :mod:`mcore_ppo.backends.triton_backend` decides what to
launch with them, and the helpers that launch take the call's bound launcher
(:class:`~mcore_ppo.backends.triton_launch.BoundLauncher`). What cannot change within a process
is asked once and cached: the device's capability and properties (per device index) and
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mcore_ppo.backends.triton_launch import interpreting
from mcore_ppo.logs import log_once
from mcore_ppo.numerics import Numerics, cdiv, next_power_of_two
from mcore_ppo.statistics import Statistics

COMPACT_BLOCK = 4096  # rows per step of the one-program compaction: 4 dependent steps at n = 16384
COMPACT_WARPS = 8
ROW_BLOCK = 1024  # columns per step of the row gather / scatter kernels
MERGE_BLOCK_T = 64
MERGE_BLOCK_S = 32


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def budget_bytes(value: object, name: str) -> int:
    """A byte budget as an int ``>= 0``: an int (not a bool), or text such as ``"1073741824"``,
    ``"1GiB"``, ``"512 MiB"``, ``"1.5GB"`` (units KB/MB/GB = 10^3.., KiB/MiB/GiB = 2^10.., any
    case). ``name`` (the argument or environment variable) is named in the ValueError/TypeError."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
        unit = match and _BYTE_UNITS.get(match.group(2).lower())
        if unit is None:
            raise ValueError(
                f"{name} must be a number of bytes >= 0, optionally with a unit (KB, MB, GB, KiB, MiB, GiB), "
                f"got {value!r}"
            )
        number = match.group(1)
        return int(number) * unit if number.isdigit() else int(float(number) * unit)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (bytes), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 = off), got {value}")
    return value


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # torch.cuda.get_device_capability costs ~70 us of host time per call: asked once per device.
    return torch.cuda.get_device_capability(index)


@functools.cache
def _shared_memory_per_block(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    # Older torch lacks the field: Hopper and datacenter Blackwell (sm_90/sm_100) have 227 KiB.
    return getattr(props, "shared_memory_per_block_optin", 227 * 1024 if props.major in (9, 10) else 99 * 1024)


def _device_index(tensor: torch.Tensor) -> int:
    index = tensor.device.index
    return torch.cuda.current_device() if index is None else index


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one fused GEMM kernel."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 16
    num_warps: int = 8
    num_stages: int = 3
    tiles_per_split: int = 4  # forward only: vocab tiles folded per program before a partial is written
    use_tma: bool = False  # operands through the copy engine (host descriptors; rows gathered first)


@dataclass(frozen=True)
class ElementwiseConfig:
    """Tiling of ``dz_from_buffer_kernel`` (rows per program; the columns are one forward tile)."""

    block_m: int = 8
    num_warps: int = 4
    fast_log2: bool = True  # bf16 buffers: log2 from the bits (see kernels.backward._log2_bf16)


def compact_rows(valid: torch.Tensor, launch: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)``: row indices with valid rows first (in order), and their number.

    Both stay on the device: one single-program Triton launch (``compact_kernel``) through
    ``launch`` (the call's bound launcher) instead of the five torch ops of a cumulative-sum
    formulation; ``nonzero`` would sync the host. ``perm`` is int32 ``[n]``; ``count`` is an int32
    ``[1]`` tensor.
    """
    from mcore_ppo.kernels import compact_kernel

    n = valid.shape[0]
    perm = torch.empty(n, dtype=torch.int32, device=valid.device)
    count = torch.empty(1, dtype=torch.int32, device=valid.device)
    launch(
        compact_kernel,
        (1,),
        (valid.contiguous().view(torch.uint8), perm, count, n),
        {"BLOCK": COMPACT_BLOCK, "num_warps": COMPACT_WARPS},
        # One site: the dtypes are fixed here and the kernel specialises on neither its
        # pointers' alignment nor n.
        ("compact",),
    )
    return perm, count


def merge_splits(
    parts: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    launch: Callable,
    *,
    options: dict,
    site: object = None,
) -> torch.Tensor:
    """Per-token ``[planes, n]`` (the max ``m``, then each term's sum relative to it) from the
    forward's per-split partials ``parts [planes, splits, n]`` (the packed layout of
    :mod:`mcore_ppo.statistics`). ``options``: the kernel's constexprs, :func:`merge_options`
    of the pass's statistics (a plan holds them); ``launch``: the call's bound launcher;
    ``site``: the caller's launch site key, when its plan fixes every argument's
    specialisation."""
    from mcore_ppo.kernels import merge_splits_kernel

    planes, num_splits, n = parts.shape
    merged = torch.empty(planes, n, dtype=torch.float32, device=parts.device)
    launch(merge_splits_kernel, (cdiv(n, MERGE_BLOCK_T),), (parts, perm, count, merged, n, num_splits), options, site)
    return merged


def merge_options(statistics: Statistics) -> dict:
    """The constexprs of the kernels that merge a pass's vocab splits (``merge_splits_kernel``,
    ``merge_to_max_kernel``): the blocks and each term's plane."""
    return {"BLOCK_T": MERGE_BLOCK_T, "BLOCK_S": MERGE_BLOCK_S, **statistics.kernel_options()}


def for_dtype(config: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """fp32 operands take twice the shared memory per stage: halve the K tile for them."""
    if dtype == torch.float32 and config.block_k > 16:
        return replace(config, block_k=config.block_k // 2)
    return config


def kernel_flags(hidden: torch.Tensor, config: GemmConfig, numerics: Numerics) -> dict[str, bool | str]:
    """The GEMM kernels' operand flags: a ragged hidden size (of ``hidden``, the operand the
    kernels read), the interpreter's fp32 upcast of 16-bit tiles (its bf16 arithmetic is
    wrong), and the dot ``numerics`` asks for (fp32 inputs' parts: the native fp16 dot with
    ``PARTS``)."""
    if numerics.parts:
        dot = {"DOT": "native", "PARTS": True}
    else:
        dot = {"DOT": numerics.dot}
    return {
        "EVEN_K": hidden.shape[1] % config.block_k == 0,
        "UPCAST": interpreting() and numerics.operand_dtype != torch.float32,
        **dot,
    }


def fp16_parts(tensor: torch.Tensor, launch: Callable, *, columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-major fp32 ``[rows, h]`` operand as its fp16 parts ``[rows, 3h]`` and each row's
    scale-back ``[rows]`` (:mod:`mcore_ppo.kernels.split`; ``columns``: the weight's order), in
    one launch through ``launch`` (the call's bound launcher)."""
    from mcore_ppo.kernels import split_kernel

    rows, h = tensor.shape
    parts = torch.empty(rows, 3 * h, dtype=torch.float16, device=tensor.device)
    unscale = torch.empty(rows, dtype=torch.float32, device=tensor.device)
    if rows:
        stride = tensor.stride(0)
        # The fp32 operand's alignment and the two integers (their values stand for their classes)
        # fix the specialisation; the outputs are fresh.
        site = ("split", columns, h, stride, tensor.data_ptr() % 16 == 0)
        launch(
            split_kernel, (rows,), (tensor, parts, unscale, h, stride),
            {"COLUMNS": columns, "BLOCK_H": min(ROW_BLOCK, max(16, next_power_of_two(h))), "num_warps": 4}, site,
        )  # fmt: skip
    return parts, unscale


def operand_parts(
    hidden: torch.Tensor, weight: torch.Tensor, launch: Callable
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(hidden parts, weight parts, (hidden unscale, weight unscale))``: both row-major fp32
    GEMM operands as :func:`fp16_parts`, each in its own order, through ``launch``."""
    (x_parts, x_unscale), (w_parts, w_unscale) = (
        fp16_parts(hidden, launch, columns=False),
        fp16_parts(weight, launch, columns=True),
    )
    return x_parts, w_parts, (x_unscale, w_unscale)


def tma_capable(tensor: torch.Tensor) -> bool:
    """The copy engine is there: Hopper or newer, or the interpreter (which emulates it)."""
    return interpreting() or (tensor.is_cuda and _capability(_device_index(tensor))[0] >= 9)


def _tma_store_fits(tensor: torch.Tensor, config: GemmConfig) -> bool:
    """A ``BLOCK_M × BLOCK_N`` staging tile for a TMA store fits beside 3 operand stages.

    Datacenter Hopper/Blackwell have 227 KiB of shared memory per block (3 × 48 KiB + 64 KiB
    at the default tiles); parts with ~100 KiB (sm_120) store through pointers instead.
    """
    if interpreting():
        return True
    stage = (config.block_m + config.block_n) * config.block_k * tensor.element_size()
    staging = config.block_m * config.block_n * tensor.element_size()
    return 3 * stage + staging <= _shared_memory_per_block(_device_index(tensor))


def with_tma_store(
    enabled: bool, tensor: torch.Tensor, config: GemmConfig, *, row_elements: int | None = None
) -> tuple[bool, GemmConfig]:
    """Whether ``[BLOCK_M, BLOCK_N]`` tiles of ``tensor`` are stored by the copy engine, and the
    kernel config to use: with the 64 KiB staging tile the operand pipeline keeps 3 stages (a
    fourth overflows shared memory). Only 16-bit tiles, on rows the engine can address, where
    the staging tile fits (:func:`_tma_store_fits`). ``row_elements``: decide for a buffer not
    yet allocated, of ``tensor``'s dtype and device, with contiguous rows of that many
    elements (a fresh allocation is 16-byte aligned)."""
    if row_elements is None:
        addressable = descriptor_ok(tensor)
    else:
        addressable = (row_elements * tensor.element_size()) % 16 == 0
    ok = (
        enabled
        and tensor.element_size() == 2
        and tma_capable(tensor)
        and addressable
        and _tma_store_fits(tensor, config)
    )
    return ok, (replace(config, num_stages=min(config.num_stages, 3)) if ok else config)


def upstream_gradients(grad_log_prob, grad_entropy, placeholder: torch.Tensor):
    """``(has_g, has_e, g, e)``: the per-token upstream gradients as contiguous fp32 vectors for
    the kernels; an absent one is replaced by ``placeholder`` (a pointer the kernel never reads)."""
    has_g, has_e = grad_log_prob is not None, grad_entropy is not None
    g = grad_log_prob.float().contiguous() if has_g else placeholder
    e = grad_entropy.float().contiguous() if has_e else placeholder
    return has_g, has_e, g, e


def descriptor_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor the copy engine can address: unit last stride, 16-byte aligned rows."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def operands_by_tma(hidden: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> bool:
    """Operands through the copy engine (TMA descriptors over gathered rows or in place)?"""
    aligned = (hidden.shape[1] * hidden.element_size()) % 16 == 0 and descriptor_ok(weight)
    return config.use_tma and aligned and tma_capable(hidden)


def gathered_rows(
    hidden: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    launch: Callable,
    *,
    skip_direct_blocks: int = 0,
    site: object = None,
) -> torch.Tensor:
    """``hidden[perm]`` with the rows past the device-side ``count`` zeroed: valid rows first.

    Contiguous ``n × h`` in the input dtype, one launch (``gather_rows_kernel``, through
    ``launch``, the call's bound launcher). The zeros are stored, not multiplied in, so an inf in
    an ignored row (padding) never reaches a GEMM that runs over every row (``d_W``) as 0·inf =
    NaN. ``skip_direct_blocks`` = a kernel's ``BLOCK_M``: blocks of valid rows that are
    consecutive in ``hidden`` (which that kernel reads in place) are left uncopied; every block
    when no token is ignored. ``site``: the launch's site key when the caller's plan fixes the
    arguments.
    """
    from mcore_ppo.kernels import gather_rows_kernel

    n, h = hidden.shape
    rows = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device)
    if n:
        launch(
            gather_rows_kernel,
            (n,),
            (hidden, perm, count, rows, n, h, hidden.stride(0), skip_direct_blocks),
            {"BLOCK_H": ROW_BLOCK},
            site,
        )
    return rows


def scatter_rows(
    compacted: torch.Tensor, perm: torch.Tensor, dtype: torch.dtype, launch: Callable, *, site: object = None
) -> torch.Tensor:
    """Rows of fp32 ``compacted`` (in ``perm`` order) back to their places, cast to ``dtype``
    in the same pass (the one rounding of ``d_hidden``)."""
    from mcore_ppo.kernels import scatter_rows_kernel

    n, h = compacted.shape
    out = torch.empty(n, h, dtype=dtype, device=compacted.device)
    if n:
        launch(scatter_rows_kernel, (n,), (compacted, perm, out, h), {"BLOCK_H": ROW_BLOCK}, site)
    return out


def log_buffer_decision(grad_needed: bool, store: bool, buffer_bytes: int, budget: int, parts: bool = False) -> None:
    """One INFO line per kind of buffer decision (not per call): on, or off and why
    (``parts``: the GEMMs read fp32 inputs' fp16 parts)."""
    if store:
        key, why = "on", f"{buffer_bytes} bytes fit the budget of {budget}"
    elif parts and grad_needed:
        key, why = "off: fp32 parts", "fp32_faithful keeps no buffer (its backward recomputes dz in fp32)"
    elif not grad_needed:
        key, why = "off: no gradient", "no gradient will be needed (no-grad forward)"
    elif budget == 0:
        key, why = "off: budget 0", "the budget is 0 (always recompute)"
    else:
        key, why = "off: over budget", f"{buffer_bytes} bytes exceed the budget of {budget} (recompute the logits)"
    log_once(logging.INFO, ("triton-buffer", key, budget), "mcore_ppo: triton probability buffer %s: %s", key, why)
