"""Settings of the triton backend: one frozen :class:`TritonConfig`, given to its constructor.

Defaults were chosen by measurement on one H200 (docs/kernels.md); nothing here is read again
while a backend runs. Tests and benchmarks build the configs they need.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from mcore_ppo.backends.triton_host import ElementwiseConfig, GemmConfig, budget_bytes
from mcore_ppo.backends.triton_launch import interpreting
from mcore_ppo.numerics import check_precision
from mcore_ppo.validation import check_bool, check_positive_int, check_power_of_two

#: The forward on a GPU: TMA operands and 3 stages were the fastest at every V/tp measured
#: (profile_head --sweep-forward); tiles per split follow the shard (``forward_tiles_per_split``).
GPU_FORWARD = GemmConfig(num_stages=3, tiles_per_split=2, use_tma=True)
GPU_BACKWARD = GemmConfig(tiles_per_split=1, use_tma=True)
#: The GPU defaults' tiles for fp32 operands, by dot (``block_k`` before :func:`for_dtype`
#: halves it for fp32 operand tiles), with 2 tiles per split; the forward's tiles per split
#: then follow the shard as the 16-bit default's do (there: 4 for the compute-bound IEEE dots;
#: fewer partials where the shard is large). IEEE fp32 dots run on the SIMT units, where
#: 64 × 64 tiles cut the forward 22× and the backward's recompute 10× against the 16-bit tiles
#: (qwen7b TP 8 shard, ``scripts/bench_precision.py --sweep``, docs/kernels.md#numerics). fp32
#: inputs' fp16 parts (``fp16x3``) hold a second fp32 tile (the promoted slice's product)
#: beside the accumulator: 128 × 128 tiles, where the 16-bit default's 128 × 256 would spill;
#: K slices of 64 in 3 stages, the tiling measured in the head (one H100, qwen7b TP 8 shard:
#: 5.4-5.6× the bf16 GEMM, gpu_runs/h100_2026-12-07d). There a GEMM of the parts alone took
#: 3.94× the bf16 GEMM at K slices of 128 against 4.86× at 64: not yet measured in the head.
FP32_TILES = {
    "ieee": (
        GemmConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2, tiles_per_split=2, use_tma=True),
        GemmConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2, tiles_per_split=1, use_tma=True),
    ),
    "fp16x3": (
        GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tiles_per_split=2, use_tma=True),
        GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tiles_per_split=1, use_tma=True),
    ),
}
#: Where IEEE fp32 dots of CUDA operands are formed (:attr:`TritonConfig.ieee_gemms`).
IEEE_GEMMS = ("cublas", "kernels")
#: ``(token_chunk, vocab_chunk)`` of the cuBLAS route of IEEE fp32 dots: at qwen7b's TP 8 shard
#: (4,096 tokens, one H200) the forward took 1.17× cuBLAS's one IEEE GEMM at 4,096 × 8,192,
#: 1.23× at the torch backend's default 2,048 × 4,096 (128 MiB of fp32 logits per block).
IEEE_BLOCKS = (4096, 8192)
#: Small tiles for the CPU interpreter (``TRITON_INTERPRET=1``, tests).
INTERPRETER_FORWARD = GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1)
INTERPRETER_BACKWARD = replace(INTERPRETER_FORWARD, tiles_per_split=1)
#: The environment variable of the budget of the backend that ``backend="triton"`` / ``"auto"``
#: build (read once, when it is built): bytes, or with a unit (``1GiB``, ``512MB``).
BUFFER_BUDGET_ENV = "MCORE_PPO_BUFFER_BUDGET_BYTES"


@dataclass(frozen=True)
class TritonConfig:
    """What a :class:`~mcore_ppo.backends.triton_backend.TritonBackend` is built with.

    Attributes:
        forward_config, backward_config: tiles of the forward and backward kernels; None: the
            GPU defaults (:data:`GPU_FORWARD`, whose ``tiles_per_split`` then follows the shard,
            :attr:`forward_tiles_per_split`; :data:`FP32_TILES` for fp32 operands), or small
            tiles under ``TRITON_INTERPRET=1``. A given config is used as given.
        forward_tiles_per_split, min_forward_splits: the default forward's vocab tiles per
            program, by shard: the most of ``forward_tiles_per_split`` that still leaves
            ``min_forward_splits`` vocab splits per row block (longer programs merge fewer
            partials; too few splits leave SMs idle in the last waves).
        workspace_bytes: bound on the backward's ``dz`` workspace (one vocab chunk × all tokens).
        buffer_budget_bytes: bytes a rank may hold in the forward's probability buffer (three
            GEMMs per step instead of four where it fits); an int, or text with a unit
            (``"1GiB"``); 0 turns the buffer off. 1 GiB buys it where it costs at most that
            (16,384 tokens × V/tp ≤ 32k in bf16: TP 8 for a 152k vocab).
        buffer_store_tma, dz_store_tma: copy-engine stores of the buffer / ``dz`` tiles where
            the device allows them (both are written in compacted row order).
        buffer_dz_config: tiling of the buffer mode's ``dz`` kernel.
        fused_forward: the whole single-label forward in the backend's kernels (labels prepared
            and outputs finished there); False: the Function's generic forward over
            ``shard_statistics`` (tests compare the two).
        plan_cache_size: per-shape launch plans kept (one per shape and option set a process uses).
        kept_kernels: launches after a call site's first go through the compiled kernel Triton
            chose for it (where the Triton version and device allow, docs/kernels.md#launches);
            False: every launch through Triton's own dispatch, ``kernel[grid](...)`` (tests
            compare both).
        onehot_block_k, onehot_add_elements: slots per step of the one-hot kernels of ``k``-id
            gradients, and slots per program of their add (rows × slots).
        gather_rows: ``(BLOCK_J, BLOCK_H, num_warps)`` of the ``k``-id logit gather: 16 in-shard
            slots × 256 columns per step compile to ~120 registers on sm_90 without spills.
        gather_scan_slots: slots per step of the gather's scan over a token's ids (a power of two).
        precision: how fp32 operands are multiplied (:data:`mcore_ppo.numerics.PRECISIONS`):
            ``"auto"`` and ``"ieee"`` IEEE fp32 dots, ``"fp32_faithful"`` the operands' fp16
            parts, three fp16 products per product (:mod:`mcore_ppo.kernels.split`), in the
            forward and in the backward's recompute; 16-bit operands are unaffected (their
            products are exact).
        ieee_gemms: where IEEE fp32 dots of CUDA operands are formed. ``"cublas"``: cuBLAS's
            fp32 GEMMs in blocks of :data:`IEEE_BLOCKS` (the torch backend's chunked pass, no
            ``[n, V]`` logits), where cuBLAS's fp32 GEMMs are IEEE (torch's default: TF32 not
            allowed by ``torch.backends.cuda.matmul``), else the kernels' own; ``"kernels"``:
            the kernels' SIMT dots always (3-4× cuBLAS's GEMM time: cuBLAS runs IEEE fp32 at
            its roofline, the kernels' tiles do not).
    """

    forward_config: GemmConfig | None = None
    backward_config: GemmConfig | None = None
    forward_tiles_per_split: tuple[int, ...] = (8, 4, 2)
    min_forward_splits: int = 48
    workspace_bytes: int = 240 * 2**20
    buffer_budget_bytes: int | str = 1 << 30
    buffer_store_tma: bool = True
    dz_store_tma: bool = True
    buffer_dz_config: ElementwiseConfig = field(default_factory=ElementwiseConfig)
    fused_forward: bool = True
    plan_cache_size: int = 64
    kept_kernels: bool = True
    onehot_block_k: int = 64
    onehot_add_elements: int = 1024
    gather_rows: tuple[int, int, int] = (16, 256, 4)
    gather_scan_slots: int = 64
    precision: str = "auto"
    ieee_gemms: str = "cublas"

    def __post_init__(self) -> None:
        for name in ("forward_config", "backward_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, GemmConfig):
                raise TypeError(f"{name} must be a GemmConfig or None, got {type(value).__name__}")
        if not isinstance(self.buffer_dz_config, ElementwiseConfig):
            raise TypeError(
                f"buffer_dz_config must be an ElementwiseConfig, got {type(self.buffer_dz_config).__name__}"
            )
        object.__setattr__(self, "buffer_budget_bytes", budget_bytes(self.buffer_budget_bytes, "buffer_budget_bytes"))
        for name in ("buffer_store_tma", "dz_store_tma", "fused_forward", "kept_kernels"):
            check_bool(name, getattr(self, name))
        for name in ("min_forward_splits", "workspace_bytes", "plan_cache_size", "onehot_block_k"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("onehot_add_elements", self.onehot_add_elements)
        check_power_of_two("gather_scan_slots", self.gather_scan_slots)
        if not isinstance(self.gather_rows, tuple):
            raise TypeError(
                f"gather_rows must be a tuple (BLOCK_J, BLOCK_H, num_warps), got {type(self.gather_rows).__name__}"
            )
        if len(self.gather_rows) != 3:
            raise ValueError(f"gather_rows must be (BLOCK_J, BLOCK_H, num_warps), got {self.gather_rows!r}")
        check_power_of_two("gather_rows[0] (BLOCK_J)", self.gather_rows[0])
        check_power_of_two("gather_rows[1] (BLOCK_H)", self.gather_rows[1])
        check_power_of_two("gather_rows[2] (num_warps)", self.gather_rows[2])
        check_precision(self.precision)
        if not isinstance(self.ieee_gemms, str):
            raise TypeError(f"ieee_gemms must be a str, one of {IEEE_GEMMS}, got {type(self.ieee_gemms).__name__}")
        if self.ieee_gemms not in IEEE_GEMMS:
            raise ValueError(f"ieee_gemms must be one of {IEEE_GEMMS}, got {self.ieee_gemms!r}")
        if not self.forward_tiles_per_split or any(t < 1 for t in self.forward_tiles_per_split):
            raise ValueError(f"forward_tiles_per_split must be ints >= 1, got {self.forward_tiles_per_split}")

    @classmethod
    def from_environment(cls, **fields) -> TritonConfig:
        """The defaults with ``fields``, and ``buffer_budget_bytes`` from
        ``MCORE_PPO_BUFFER_BUDGET_BYTES`` when it is set (a unit allowed: ``1GiB``)."""
        env = os.environ.get(BUFFER_BUDGET_ENV, "").strip()
        if env:
            fields["buffer_budget_bytes"] = budget_bytes(env, BUFFER_BUDGET_ENV)
        return cls(**fields)

    def resolved_forward(self) -> tuple[GemmConfig, bool]:
        """``(forward config, tiles by shard)``: the given config as it is, else the device's
        default, whose tiles per split follow the shard on a GPU."""
        if self.forward_config is not None:
            return self.forward_config, False
        if interpreting():
            return INTERPRETER_FORWARD, False
        return GPU_FORWARD, True

    def resolved_backward(self) -> tuple[GemmConfig, bool]:
        """``(backward config, GPU default)``: the given config as it is, else the device's
        default; on a GPU the default, whose fp32 operands take their dot's tiles."""
        if self.backward_config is not None:
            return self.backward_config, False
        if interpreting():
            return INTERPRETER_BACKWARD, False
        return GPU_BACKWARD, True
