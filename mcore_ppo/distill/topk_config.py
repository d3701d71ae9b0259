"""Settings of the teacher's top-k: one frozen :class:`TopKConfig`, given to each call, and the
rule that chooses its candidates per tile from them (:func:`candidates_per_tile`).

:func:`mcore_ppo.fused_topk` takes it as ``config=`` (None: the defaults); nothing here is read
again while a call runs. Defaults were chosen by measurement on one H200 (bf16, a 152k vocab,
16,384 tokens); tests and benchmarks build the configs they need.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mcore_ppo.backends.triton_host import GemmConfig, for_dtype, interpreting
from mcore_ppo.validation import check_bool, check_positive_int, check_power_of_two, type_name

#: The fused kernel's tiles on a GPU: the head's 128 × 256 logits, TMA operands, one tile per
#: program (a program keeps nothing across tiles, and Triton does not pipeline one tile into the
#: next). On the H200 (bf16, V 151,936, n 16,384) 256 columns beat 128 by 15-25 %.
GPU_TILES = GemmConfig(
    block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, tiles_per_split=1, use_tma=True
)
#: Small tiles for the CPU interpreter (``TRITON_INTERPRET=1``, tests).
INTERPRETER_TILES = GemmConfig(
    block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, tiles_per_split=4
)


@dataclass(frozen=True, kw_only=True)
class TopKConfig:
    """How :func:`mcore_ppo.fused_topk` computes each rank's shard; validated when built.

    Attributes:
        token_chunk: tokens per block of the torch path's logits (``[token_chunk, vocab_chunk]``
            in fp32: 32 MiB with the defaults, whatever the batch).
        vocab_chunk: vocab columns per block of the torch path's logits. Chunks narrower than
            ``k`` are allowed (each block's top is merged into the running one).
        tiles: the fused kernel's tiles on a GPU (:data:`GPU_TILES`: 128 × 256 logits, TMA
            operands, one tile per program; 256 columns were 15-25 % faster than 128 on the H200).
        interpreter_tiles: the same under Triton's CPU interpreter (:data:`INTERPRETER_TILES`:
            small tiles, tests). fp32 inputs halve either one's K tile (shared memory).
        max_registers: ptxas register cap per thread of the statistics kernel's top-k launch; None: ptxas decides.
        candidates: candidates each tile keeps per row (``C``); None: chosen per call from
            ``candidate_range`` and ``full_tile_cost``. Each one costs every tile a max-reduction
            (~3 % of a GEMM on an H100, ~4 % on an H200); a row recomputes the tiles holding more
            than ``C`` of its top ``k`` (each such *full* tile per row ~15 / tiles of the shard's
            GEMM: its recompute, merge and larger selection), at most ``k // C`` of them (the
            slots of their recompute).
        candidate_range: ``(low, high)``, the range ``C`` is chosen in: from ``low`` (at most
            ``k``, where a tile fills only by ties) one more while that saves more than
            ``tiles / full_tile_cost`` expected full tiles per row (random logits: a row's top
            spread over the tiles as ``Poisson(k / tiles)``). On one H100 (bf16, V 151,936,
            n 16,384, GPU time) ``(1, 5)`` picks 1 / 2 candidates at TP 1 (594 tiles) for k 8 /
            128 (1.13 / 1.23× one GEMM, against 1.18 / 1.22× for 3), and at TP 8 (75 tiles)
            2 / 4 / 5 for k 8 / 64 / 128 (k 8: 1.19× against 1.21× for 3; k 128: 5.35× for 2).
        full_tile_cost: the cost of one expected full tile per row in candidates, times the
            shard's tile count (a full tile recomputes ``1 / tiles`` of its row's GEMM, a
            candidate costs every tile; measured: ~15 / tiles against ~0.03).
        recompute_rows: rows per work item of the full-tile recompute on a GPU (one weight tile
            serves that many gathered rows).
        interpreter_recompute_rows: the same under the interpreter.
        interpreter_select_rows: rows per program of the selection under the interpreter, whose
            cost is per program and op (on a GPU a program takes one row: the fastest on the
            H200 at 375, 2970 and 5120 candidates).
        scratch_bytes: scratch of one kernel launch: the per-(row, tile) outputs (``8·C + 8``
            bytes each) and each row's full-tile slots (``k // C`` recomputed tiles of fp32);
            a longer batch runs in token chunks that fit.
        sort_keys: how the selection and the full tiles' merge order their keys: ``tl.sort``
            (True) or by counting each key's larger ones (False), the same result. None:
            ``tl.sort``, but counting under the interpreter, whose sort costs ~0.7 s per 256 keys.
        splits: vocab splits per row block of the statistics kernel's top-k launch; None: the tiles' own
            ``tiles_per_split`` decides (tests force a count to split a small vocab).

    Raises:
        TypeError: a field of the wrong type (bool is not an int here), naming the field.
        ValueError: a value out of its range, naming the field.
    """

    token_chunk: int = 2048
    vocab_chunk: int = 4096
    tiles: GemmConfig = GPU_TILES
    interpreter_tiles: GemmConfig = INTERPRETER_TILES
    max_registers: int | None = None
    candidates: int | None = None
    candidate_range: tuple[int, int] = (1, 5)
    full_tile_cost: float = 500.0
    recompute_rows: int = 64
    interpreter_recompute_rows: int = 16
    interpreter_select_rows: int = 16
    scratch_bytes: int = 512 * 2**20
    sort_keys: bool | None = None
    splits: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "token_chunk", "vocab_chunk", "recompute_rows", "interpreter_recompute_rows", "interpreter_select_rows",
            "scratch_bytes",
        ):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        for name in ("max_registers", "candidates", "splits"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        for name in ("tiles", "interpreter_tiles"):
            _check_tiles(name, getattr(self, name))
        if self.sort_keys is not None:
            check_bool("sort_keys", self.sort_keys)
        object.__setattr__(self, "candidate_range", _check_range(self.candidate_range))
        cost = self.full_tile_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)):
            raise TypeError(f"full_tile_cost must be a number, got {type_name(cost)}")
        if not math.isfinite(cost) or cost <= 0:
            raise ValueError(f"full_tile_cost must be finite and > 0, got {cost}")
        object.__setattr__(self, "full_tile_cost", float(cost))

    def gemm(self, dtype: torch.dtype) -> GemmConfig:
        """The tiles of this device (the interpreter's or a GPU's), for ``dtype`` operands."""
        return for_dtype(self.interpreter_tiles if interpreting() else self.tiles, dtype)

    def recompute_block(self) -> int:
        """Rows per work item of the full-tile recompute on this device."""
        return self.interpreter_recompute_rows if interpreting() else self.recompute_rows

    def select_rows(self) -> int:
        """Rows per program of the selection on this device."""
        return self.interpreter_select_rows if interpreting() else 1

    def keys_by_sort(self) -> bool:
        """Whether the selection and the merge order keys by ``tl.sort`` on this device."""
        return not interpreting() if self.sort_keys is None else self.sort_keys

    def register_cap(self) -> dict[str, int]:
        """The top-k launch's ``maxnreg`` option, where one is set and compiled for."""
        return {"maxnreg": self.max_registers} if self.max_registers and not interpreting() else {}


def _check_tiles(name: str, value: object) -> None:
    if not isinstance(value, GemmConfig):
        raise TypeError(f"{name} must be a mcore_ppo.backends.triton_host.GemmConfig, got {type_name(value)}")
    for field in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "tiles_per_split"):
        check_positive_int(f"{name}.{field}", getattr(value, field))
    for field in ("block_m", "block_n", "block_k"):
        check_power_of_two(f"{name}.{field}", getattr(value, field))
    check_bool(f"{name}.use_tma", value.use_tma)


def _check_range(value: object) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"candidate_range must be a (low, high) pair of ints, got {type_name(value)}")
    low, high = (check_positive_int("candidate_range", bound) for bound in value)
    if low > high:
        raise ValueError(f"candidate_range must have low <= high, got {tuple(value)}")
    return low, high


#: What ``config=None`` means.
DEFAULT_CONFIG = TopKConfig()


def candidates_per_tile(num_tiles: int, c_out: int, config: TopKConfig) -> int:
    """``C`` for a shard of ``num_tiles`` logit tiles and a top ``c_out``: ``config.candidates``
    when set; else from the low end of ``config.candidate_range`` (at most ``c_out``: then a
    tile fills only by ties), one more while it saves more than ``num_tiles / config.full_tile_cost``
    expected full tiles per row (:func:`expected_full_tiles`): a candidate costs every tile, a
    full tile one tile of its row."""
    if config.candidates is not None:
        return config.candidates
    return _chosen_candidates(num_tiles, c_out, config.candidate_range, config.full_tile_cost)


@functools.lru_cache(maxsize=256)
def _chosen_candidates(num_tiles: int, c_out: int, bounds: tuple[int, int], full_tile_cost: float) -> int:
    low, high = bounds
    saving = num_tiles / full_tile_cost  # expected full tiles per row one candidate must save
    high = min(high, c_out)  # c_out candidates: a tile fills only by ties at the top's last value
    c = min(low, high)
    while c < high and expected_full_tiles(num_tiles, c_out, c) - expected_full_tiles(num_tiles, c_out, c + 1) > saving:
        c += 1
    return c


def expected_full_tiles(num_tiles: int, c_out: int, candidates: int) -> float:
    """Expected full tiles per row on random logits, ``tiles · P(X > C)`` for
    ``X ~ Poisson(c_out / tiles)``: the tiles holding more of the row's top than they keep."""
    lam = c_out / num_tiles
    term = cdf = math.exp(-lam)
    for i in range(1, candidates + 1):
        term *= lam / i
        cdf += term
    return num_tiles * max(0.0, 1.0 - cdf)


def full_tiles_cap(num_tiles: int, c_out: int, config: TopKConfig) -> int:
    """The most full tiles a row can have: each holds ``C`` entries of the top ``c_out``."""
    return min(num_tiles, c_out // candidates_per_tile(num_tiles, c_out, config))
