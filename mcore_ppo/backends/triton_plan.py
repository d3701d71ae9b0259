"""The triton backend's per-shape launch plans.

A :class:`LaunchPlan` holds what the forward decides from shapes, dtypes, strides, alignment and
options alone: made once per key and cached on the backend, it is also the *site* key of every
launch it fixes (:meth:`mcore_ppo.backends.triton_launch.Launcher.launch`), so a steady call does
no per-argument work on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mcore_ppo.backends.triton_config import TritonConfig
from mcore_ppo.backends.triton_host import (
    MERGE_BLOCK_S,
    MERGE_BLOCK_T,
    GemmConfig,
    descriptor_ok,
    for_dtype,
    interpreting,
    kernel_flags,
    log_buffer_decision,
    merge_options,
    operands_by_tma,
    with_tma_store,
)
from mcore_ppo.numerics import Numerics, cdiv
from mcore_ppo.statistics import Statistics


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """What the forward decides from shapes, dtypes, strides, alignment and options alone.

    Hashed by identity: launches use the cached plan object itself as their site key."""

    n: int
    h: int
    v: int
    numerics: Numerics
    cfg: GemmConfig
    num_splits: int
    n_tiles_v: int
    statistics: Statistics
    store: bool
    use_tma: bool
    buf_tma: bool
    direct: bool
    n_parts: int  # planes of the per-split partials and of the TP sums: the max (the label logit), then one per term
    stats_grid: tuple[int]
    merge_grid: tuple[int]  # the merge and finish launches' (one program per MERGE_BLOCK_T tokens)
    stats_options: dict
    merge_options: dict  # merge_splits_kernel's and merge_to_max_kernel's constexprs
    finish_options: dict  # by (labels_in_range, grad_needed): the launch options of merge_finish_kernel
    tp_options: dict  # over TP: split_max_kernel's ("max"), merge_to_max_kernel's ("merge"), finish_kernel's (as above)

    @staticmethod
    def build(
        config: TritonConfig,
        forward_config: GemmConfig,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        grad_needed: bool,
        statistics: Statistics,
        row_temp: bool,
        parts: bool = False,
    ) -> LaunchPlan:
        """The plan of a backend with ``config`` whose forward tiles for this shard are
        ``forward_config`` (:meth:`TritonBackend.forward_config_for`). ``hidden`` and ``weight``
        are the operands the kernels read: with ``parts``, fp32 inputs' fp16 parts
        (:func:`~mcore_ppo.backends.triton_host.fp16_parts`), which keep no probability buffer."""
        n, h = hidden.shape
        v = weight.shape[0]
        numerics = Numerics.of(torch.float32 if parts else hidden.dtype, config.precision)
        cfg = for_dtype(forward_config, numerics.operand_dtype)
        num_splits = cdiv(v, cfg.tiles_per_split * cfg.block_n)
        fits, n_tiles_v = buffer_decision(config, forward_config, n, v, hidden.dtype)
        store = grad_needed and fits and not parts
        buffer_bytes = n * (v * hidden.element_size() + n_tiles_v * 4)
        log_buffer_decision(grad_needed, store, buffer_bytes, config.buffer_budget_bytes, parts)
        use_tma = operands_by_tma(hidden, weight, cfg)
        buf_tma = False
        if store:
            buf_tma, cfg = with_tma_store(config.buffer_store_tma, hidden, cfg, row_elements=v)
        # Blocks of consecutive valid rows are read in place, the others from a gathered copy of
        # only their rows (each program builds the descriptor it needs, in one launch): no row
        # copy when nothing is ignored.
        direct = use_tma and descriptor_ok(hidden)
        # Each term's plane (0: not reduced) from the description of the statistics.
        planes = statistics.kernel_options()
        variant = {**({"ROW_TEMP": True} if row_temp else {}), **planes}
        stats_options = {
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "TILES_PER_SPLIT": cfg.tiles_per_split, "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "USE_TMA": use_tma, "STORE_P": store, "BUF_TMA": buf_tma,
            "DIRECT_ROWS": direct, **kernel_flags(hidden, cfg, numerics), **variant,
        }  # fmt: skip
        libdevice = not interpreting()
        finish_options = {
            (checked, grad_needed): {
                "BLOCK_T": MERGE_BLOCK_T, "BLOCK_S": MERGE_BLOCK_S, "CHECK_RANGE": not checked,
                "LIBDEVICE": libdevice, "SAVE": grad_needed, **_exact_libdevice(), **planes,
                **statistics.output_options(),
            }
            for checked in (False, True)
        }  # fmt: skip
        merged = merge_options(statistics)
        tp_options = {
            "max": {"BLOCK_T": MERGE_BLOCK_T, "BLOCK_S": MERGE_BLOCK_S},
            "merge": merged,
            **{key: {k: o for k, o in opts.items() if k != "BLOCK_S"} for key, opts in finish_options.items()},
        }
        return LaunchPlan(
            n, h, v, numerics, cfg, num_splits, n_tiles_v, statistics, store, use_tma, buf_tma, direct,
            statistics.n_planes, (cdiv(n, cfg.block_m) * num_splits,), (cdiv(n, MERGE_BLOCK_T),), stats_options, merged,
            finish_options, tp_options,
        )  # fmt: skip


def buffer_decision(
    config: TritonConfig, forward_config: GemmConfig, n: int, v: int, dtype: torch.dtype
) -> tuple[bool, int]:
    """``(fits, n_tiles_v)``: whether the probability buffer of ``n`` rows by ``v`` columns (and
    its tile maxima) fits ``config``'s budget, and the number of the forward's vocab tiles
    (``forward_config``'s, this shard's); from shapes alone (the op's shape function decides the
    residual with it too)."""
    n_tiles_v = cdiv(v, for_dtype(forward_config, dtype).block_n)
    return n * (v * dtype.itemsize + n_tiles_v * 4) <= config.buffer_budget_bytes, n_tiles_v


@functools.cache
def _exact_libdevice() -> dict:
    """Launch options for the epilogue's ``logf`` / ``div_rn``: libdevice without flushing
    subnormals (Triton's default flushes them), as torch's CUDA kernels compute them; {} where
    this Triton has no such option (its default then) or runs the interpreter."""
    if interpreting():
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return {}
    return {"enable_reflect_ftz": False} if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__ else {}
