"""Host side of the warp-specialised Hopper forward (:mod:`mcore_ppo.kernels.forward_ws`).

Used by :class:`~mcore_ppo.backends.triton_backend.TritonBackend` for the statistics-only
forward (no probability buffer) when it is asked for (``ws_forward``) and the inputs allow it:
an sm_90 device, 16-bit operands the copy engine can address, and a Triton with Gluon's Hopper
warp specialisation. Anything else keeps the portable ``stats_kernel``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mcore_ppo.backends.triton_host import cdiv, descriptor_ok

ROWS_PER_CTA = 256  # two consumer warpgroups of 128 rows
COLS = 128


@dataclass(frozen=True)
class WsConfig:
    """Tiling and pipelining of ``ws_stats_kernel`` (docs/kernels.md has the measurements)."""

    split_tiles: int = 1  # vocab tiles per unit: one partial per (unit, row)
    group_m: int = 8  # row blocks per swizzle group
    a_stages: int = 3  # ring depth of each warpgroup's hidden rows
    b_stages: int = 8  # ring depth of the shared weight slices: holds the lag
    lag: int = 3  # K-steps warpgroup 1 starts each tile after warpgroup 0 (0: lockstep)
    block_k: int = 64
    consumer_regs: int = 232
    producer_regs: int = 40


@functools.cache
def gluon_hopper() -> bool:
    """Triton here has Gluon with Hopper warp specialisation (3.5+)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


def ws_usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """The warp-specialised forward can run on these operands."""
    return (
        hidden.is_cuda
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == hidden.dtype
        and torch.cuda.get_device_capability(hidden.device) == (9, 0)
        and (hidden.shape[1] * hidden.element_size()) % 16 == 0
        and descriptor_ok(weight)
        and gluon_hopper()
    )


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, element))


def ws_partial_statistics(
    x_rows: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    config: WsConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parts [3, splits, n], y [n])`` over gathered rows ``x_rows`` (valid rows first).

    ``parts`` holds per-split ``(m·ln2, s, u·ln2)`` in compacted row order, as
    ``merge_splits`` expects; ``y`` the label logits ``/ T`` in original row order.
    """
    from mcore_ppo.kernels.forward_ws import ws_stats_kernel

    n, h = x_rows.shape
    v = weight.shape[0]
    num_splits = cdiv(v, config.split_tiles * COLS)
    parts = torch.empty(3, num_splits, n, dtype=torch.float32, device=x_rows.device)
    y = torch.zeros(n, dtype=torch.float32, device=x_rows.device)
    units = cdiv(n, ROWS_PER_CTA) * num_splits
    sms = torch.cuda.get_device_properties(x_rows.device).multi_processor_count
    ws_stats_kernel[(min(sms, units),)](
        _descriptor(x_rows, [ROWS_PER_CTA // 2, config.block_k]),
        _descriptor(weight, [COLS, config.block_k]),
        perm,
        count,
        labels,
        parts[0],
        parts[1],
        parts[2],
        y,
        n,
        v,
        h,
        num_splits,
        1.0 / temperature,
        SPLIT_TILES=config.split_tiles,
        GROUP_M=config.group_m,
        A_STAGES=config.a_stages,
        B_STAGES=config.b_stages,
        LAG=config.lag,
        CONSUMER_REGS=config.consumer_regs,
        PRODUCER_REGS=config.producer_regs,
        num_warps=4,
        maxnreg=168,
    )
    return parts, y
