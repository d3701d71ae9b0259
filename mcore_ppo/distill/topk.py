"""A teacher's top-k over the tensor-parallel vocab shards, without the ``[tokens, V]`` logits.

Per token, with ``z = hidden @ W.T / T`` over the global vocab and ``p = softmax(z)`` (``T`` one
number, or the token's own temperature: a per-token tensor divides each token's row), returns
the global ids of the ``k`` most likely tokens, their ``log p`` and the log of the probability
mass outside them. Each TP rank reduces its own shard, one bounded block of logits at a time
(:data:`TOKEN_CHUNK` × :data:`VOCAB_CHUNK`): per block the ``k`` largest (``torch.topk`` plus a
deterministic repair of ties at the k-th value), merged with the rank's running candidates; every
entry that is not (or stops being) a candidate is folded into the softmax statistics ``(m, s)`` of
the shard's rest. The ranks then merge (:func:`parallel.topk.merge_topk_over_ranks`).

On CUDA (fp16/bf16/fp32) the shard's pass is fused Triton kernels instead
(:mod:`mcore_ppo.kernels.topk`): logit tiles in registers, each giving its largest entries and
its rest's statistics; a second kernel selects the exact top ``k`` of each token's candidates
and sums its rest, and the few tiles that may hide more of the top are recomputed whole and
merged. The torch path stays the CPU/fp64 path and the exactness reference (``impl="torch"``).

No gradient: the teacher is not trained, so the call runs under ``torch.no_grad()`` and its
outputs never require grad, whatever ``hidden`` and ``weight`` do.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mcore_ppo import validation
from mcore_ppo.backends.triton_host import (
    GemmConfig,
    cdiv,
    for_dtype,
    fp32_output_gemms,
    interpreting,
    kernel_flags,
    operands_by_tma,
    rowmajor,
)
from mcore_ppo.backends.triton_launch import TmaDesc, launch
from mcore_ppo.function import autocast_off
from parallel.groups import resolve_tp_group
from parallel.mappings import all_gather_first_dim
from parallel.ranks import ProcessGroup, group_rank, group_size
from parallel.topk import fold_into_statistics, merge_topk_over_ranks, select_topk

#: Largest ``k`` accepted: a top-k teacher is a sparse summary (verl's default is 128), and
#: every rank all-gathers ``k`` candidates per token from every other rank.
MAX_TOPK = 128
#: Block of logits held at once, ``[TOKEN_CHUNK, VOCAB_CHUNK]`` fp32 (32 MiB), read at each call.
TOKEN_CHUNK = 2048
VOCAB_CHUNK = 4096

#: Which shard pass ``impl="auto"`` takes: the Triton kernel for fp16/bf16/fp32 CUDA tensors
#: (where Triton is installed), the torch path otherwise.
IMPLS = ("auto", "torch", "triton")
#: Tiles of the fused kernel on a GPU: the head's 128 × 256 logits, TMA operands, one tile per
#: program (a program keeps nothing across tiles, and Triton does not pipeline one tile into
#: the next). On the H200 (bf16, V 151,936, n 16,384) 256 columns beat 128 by 15-25 %.
TRITON_CONFIG = GemmConfig(
    block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, tiles_per_split=1, use_tma=True
)
#: Small tiles for the CPU interpreter (``TRITON_INTERPRET=1``, tests).
TRITON_INTERPRETER_CONFIG = GemmConfig(
    block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, tiles_per_split=4
)
#: ptxas register cap per thread for the tiles kernel (None: ptxas decides).
TRITON_MAX_REGISTERS: int | None = None
#: Candidates each tile keeps per row (``C``). Each costs one more max-reduction per tile (~4 %
#: of a GEMM on the H200); a row recomputes the tiles holding more than ``C`` of its top ``k``
#: (each such *full* tile per row ~8-19 % of a GEMM at TP 8: its recompute and merge), at most
#: ``k // C`` of them (the slots of their recompute). None: chosen per call by
#: :func:`_candidates_per_tile`; an int forces it.
TRITON_CANDIDATES: int | None = None
#: The range ``C`` is chosen in, and the expected full tiles per row one more candidate must
#: save to be taken (the cost ratio above: 0.04 / 0.15). On the H200 (bf16, V 151,936, n 16,384,
#: GPU time) this picks what timing picked: 3 at TP 1 (594 tiles) for every k, and at TP 8 (75
#: tiles) 3 / 4 / 5 for k 8 / 64 / 128 (1.22 / 1.32 / 1.43× one GEMM, against 1.31 / 1.36 /
#: 1.43× for 5 everywhere and 1.22 / 1.34 / 2.34× for 3).
TRITON_CANDIDATE_RANGE = (3, 5)
TRITON_FULL_TILES_PER_CANDIDATE = 0.25
#: Rows per work item of the full-tile recompute (one weight tile, gathered rows).
TRITON_RECOMPUTE_ROWS = 64
TRITON_INTERPRETER_RECOMPUTE_ROWS = 16
#: Rows per program of the selection under the interpreter (its cost is per program and op).
TRITON_INTERPRETER_SELECT_ROWS = 16
#: Scratch of one launch: the per-(row, tile) outputs (``8·C + 8`` bytes each) and each row's
#: full-tile slots (``k // C`` recomputed tiles of fp32); longer batches run in token chunks
#: that fit.
TRITON_SCRATCH_BYTES = 512 * 2**20
#: How the selection and the full tiles' merge order their keys: ``tl.sort`` (True), or by
#: counting each key's larger ones (False); the same result. None: ``tl.sort`` but under the
#: interpreter, whose sort costs ~0.7 s per 256 keys.
TRITON_SORT_KEYS: bool | None = None
#: Forces the number of vocab splits (tests); None: the rule above.
TRITON_SPLITS: int | None = None


class TopK(NamedTuple):
    """Per-token top-k of the teacher, in the layout of the call (see :func:`fused_topk`).

    Attributes:
        ids: int64 ``[..., k]`` global vocab ids, most likely first, equal probabilities by
            ascending id; ``ignore_index`` in every slot of an ignored token.
        log_probs: ``[..., k]`` ``log p`` of those ids (fp32; fp64 for fp64 inputs); 0 for an
            ignored token.
        tail_log_mass: ``[...]`` ``log Σ_{j ∉ top-k} p_j`` (-inf when the top-k hold the whole
            vocab); 0 for an ignored token.
    """

    ids: torch.Tensor
    log_probs: torch.Tensor
    tail_log_mass: torch.Tensor


def check_k(k: object, vocab_size: int | None = None) -> int:
    """``k`` is an int (bool is not accepted) in ``[1, MAX_TOPK]`` and, given ``vocab_size``, ``<= vocab_size``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {validation.type_name(k)}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"k must be in [1, {MAX_TOPK}] (MAX_TOPK), got {k}")
    if vocab_size is not None and k > vocab_size:
        raise ValueError(f"k must be <= the global vocab size {vocab_size}, got k={k}")
    return k


def fused_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    impl: str = "auto",
    validate: bool | None = None,
) -> TopK:
    """Per-token top-``k`` ids, log-probs and tail mass of ``softmax(hidden @ W.T / temperature)``.

    Runs under ``torch.no_grad()``: no gradient reaches ``hidden`` or ``weight``.

    Args:
        hidden: ``[s, b, h]`` (Megatron; ``[t, 1, h]`` packed THD) or ``[n, h]``. With
            ``sequence_parallel`` the first dim is this rank's sequence shard ``s/tp``; it is
            all-gathered and the outputs cover the whole sequence.
        weight: this rank's vocab shard ``[V/tp, h]``, rows ``[rank·V/tp, (rank+1)·V/tp)`` of
            the global vocab, the same dtype as ``hidden``.
        k: how many ids per token, an int in ``[1, MAX_TOPK]`` and ``<= V``.
        temperature: the logits are divided by it: a Python number in ``[1e-4, inf)``
            (:data:`mcore_ppo.validation.MIN_TEMPERATURE`), or a per-token floating-point
            tensor (verl's per-sample temperatures spread over the tokens) on ``labels``' device,
            shaped like ``labels`` (the whole sequence under SP; under CP this rank's tokens,
            split like the labels) or broadcastable to it (``[b, 1]`` per sequence); with
            ``labels=None`` shaped like the tokens (``[b, s]`` for hidden ``[s, b, h]``, ``[n]``
            for ``[n, h]``). Every value, an ignored token's included, must be finite and
            ``>= MIN_TEMPERATURE`` (read back to the host: one sync on CUDA). Dividing a row by
            its positive ``T`` keeps the row's order, so the ids are those of the untempered
            logits (up to fp32 rounding of near-ties); the log-probs and tail mass are those of
            ``softmax(z_i / T_i)``. An ignored token's outputs stay ``ignore_index`` / 0.
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: ``hidden`` arrives sequence-sharded over TP.
        labels: optional, shaped as for the head (``[b, s]``, ``[1, t]``, ``[n]``, the whole
            sequence): only which entries equal ``ignore_index`` is read. Those tokens get
            ``ids = ignore_index``, ``log_probs = 0``, ``tail_log_mass = 0``. None: every token
            counts.
        ignore_index: the label value of tokens to skip.
        impl: the shard pass: ``"auto"`` (the fused Triton kernel for fp16/bf16/fp32 CUDA
            tensors, the torch path otherwise), ``"torch"`` (chunked cuBLAS GEMMs +
            ``torch.topk``, any device), ``"triton"`` (CUDA tensors, or any under
            ``TRITON_INTERPRET=1``; not fp64). Every choice returns the same ids.
        validate: check a temperature tensor's values (finite, ``>= MIN_TEMPERATURE``;
            ValueError), one host sync on CUDA; False skips it (a bad value then gives NaN for
            its token). None: :data:`mcore_ppo.validation.VALIDATE_DEFAULT`, as for the head.

    Returns:
        :class:`TopK` ``(ids, log_probs, tail_log_mass)``: ``[b, s, k]`` / ``[b, s]`` for hidden
        ``[s, b, h]`` (``[1, t, k]`` packed), ``[n, k]`` / ``[n]`` for ``[n, h]``; identical on
        every TP rank. ``log_probs`` and ``tail_log_mass`` are fp32 (fp64 for fp64 inputs).

    Raises:
        TypeError: ``k`` not an int, non-tensor inputs, a non-float ``hidden``, ``weight`` of
            another dtype, ``labels`` not an integer tensor, a flag that is not a bool, a
            ``temperature`` neither a number nor a floating-point tensor.
        ValueError: ``k`` out of range, shapes that do not fit a layout, unequal weight shards,
            a bad temperature (value, or a tensor's shape, device or values) or ``ignore_index``,
            an unknown ``impl`` or ``"triton"`` where it cannot run.
    """
    with torch.no_grad():
        return _fused_topk(
            hidden, weight, k, temperature, tp_group, sequence_parallel, labels, ignore_index, impl, validate
        )


def _fused_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    labels: torch.Tensor | None,
    ignore_index: int,
    impl: str = "auto",
    validate: bool | None = None,
) -> TopK:
    k = check_k(k)
    validate = validation.resolve_validate(validate)
    row_temperature = temperature if isinstance(temperature, torch.Tensor) else None
    if row_temperature is None:
        temperature = validation.check_temperature(temperature)
    validation.check_ignore_index(ignore_index)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {validation.type_name(sequence_parallel)}")
    tp_group = resolve_tp_group(tp_group)
    validation.check_process_group(tp_group)
    tp_size = group_size(tp_group)
    validation.check_tensor("hidden", hidden)
    validation.check_tensor("weight", weight)
    token_labels = labels if labels is not None else _all_tokens(hidden, tp_size, sequence_parallel)
    validation.check_tensors(hidden, weight, token_labels)
    # Shapes may be wrong on one rank only: the shard-size collective carries that to every rank.
    # So may a temperature tensor (and its values, on a rank whose labels differ).
    layout_error = None
    try:
        validation.check_layout(hidden, weight, token_labels, tp_size, sequence_parallel)
        if row_temperature is not None:
            temperature = _row_temperature(row_temperature, token_labels, hidden.dtype, validate)
    except (ValueError, TypeError) as err:
        layout_error = err
    validation.check_equal_shards(weight, tp_group, layout_error)
    check_k(k, weight.shape[0] * tp_size)
    use_triton = _use_triton(impl, hidden)

    if sequence_parallel and tp_size > 1:
        hidden = all_gather_first_dim(hidden, tp_group)
    tokens = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    with autocast_off(hidden.device):
        shard_pass = _shard_topk_triton if use_triton else _shard_topk
        values, ids, rest_max, rest_sum = shard_pass(
            tokens, weight, k, temperature, vocab_start=group_rank(tp_group) * weight.shape[0]
        )
        top_values, top_ids, lse, tail_lse = merge_topk_over_ranks(
            values, ids, rest_max, rest_sum, k, tp_group, presorted=use_triton
        )
    log_probs = top_values - lse[:, None]
    tail_log_mass = tail_lse - lse
    if labels is not None:
        valid = _token_order(labels.long(), labels.dim() == 2) != ignore_index
        top_ids = torch.where(valid[:, None], top_ids, torch.full_like(top_ids, ignore_index))
        log_probs = torch.where(valid[:, None], log_probs, torch.zeros_like(log_probs))
        tail_log_mass = torch.where(valid, tail_log_mass, torch.zeros_like(tail_log_mass))
    if hidden.dim() == 3:
        seq, batch = hidden.shape[:2]
        return TopK(
            top_ids.view(seq, batch, k).transpose(0, 1).contiguous(),
            log_probs.view(seq, batch, k).transpose(0, 1).contiguous(),
            tail_log_mass.view(seq, batch).t().contiguous(),
        )
    return TopK(top_ids, log_probs, tail_log_mass)


def _all_tokens(hidden: torch.Tensor, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """Labels shaped for the call's layout, for the head's shape checks (their values, never
    read, are left unset: no fill kernel)."""
    if hidden.dim() not in (2, 3):
        return torch.empty(0, dtype=torch.int64, device=hidden.device)  # check_layout names hidden
    seq = hidden.shape[0] * (tp_size if sequence_parallel and tp_size > 1 else 1)
    shape = (hidden.shape[1], seq) if hidden.dim() == 3 else (seq,)
    return torch.empty(shape, dtype=torch.int64, device=hidden.device)


def _row_temperature(
    temperature: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype, validate: bool
) -> torch.Tensor:
    """``T [n]`` in the tokens' order, contiguous, in the accumulation dtype (fp32; fp64 for fp64
    inputs), after the head's shape, dtype and device checks and, with ``validate``, its value
    check (every value, ignored tokens' included, as the head's; one host sync on CUDA)."""
    expanded = validation.check_temperature_tensor(temperature, labels)
    values = _token_order(expanded, labels.dim() == 2)
    bad = validation.bad_temperatures(values) if validate else None
    if bad is not None and bool(bad.any()):
        first = values[bad][0].item()
        raise ValueError(
            f"temperature values must be finite and >= {validation.MIN_TEMPERATURE:g} (MIN_TEMPERATURE), "
            f"got {first} ({int(bad.sum())} bad values)"
        )
    return values.to(torch.promote_types(dtype, torch.float32)).contiguous()


def _token_order(values: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """Per-token ``values`` (labels' layout) in the tokens' order: ``[b, s]`` is sequence-major."""
    return values.t().reshape(-1) if batch_first else values.reshape(-1)


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _tempered_logits(x: torch.Tensor, w: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``x @ w.T / T`` in the accumulation dtype (fp32; fp64 for fp64 inputs), a fresh tensor;
    ``T`` a float or the rows' ``[c, 1]`` column."""
    acc = torch.promote_types(x.dtype, torch.float32)
    # One cuBLAS GEMM with 16-bit inputs and an fp32 output where this torch has it (decided
    # once, by capability: an error of the real product, out of memory above all, propagates);
    # else the operands upcast first, the same fp32 products.
    if x.is_cuda and x.dtype != acc and fp32_output_gemms(x.device.type)[0]:
        return torch.mm(x, w.t(), out_dtype=acc).div_(temperature)
    return torch.mm(x.to(acc), w.to(acc).t()).div_(temperature)


def _chunk_topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``z [n, c]`` per row and their columns, ties to the smaller column.

    ``torch.topk`` returns the right *values*, but among entries equal to the k-th value it may
    return any of them. Those slots are re-filled with the first columns holding that value:
    a running count of equal entries along the row is non-decreasing, so ``searchsorted`` finds
    the column of the 1st, 2nd, ... equal entry.
    """
    values, cols = torch.topk(z, k, dim=1)
    kth = values[:, -1:]
    above = (values > kth).sum(dim=1, keepdim=True)  # every entry above the k-th value is in
    equal_count = (z == kth).cumsum(dim=1, dtype=torch.int32)
    slot = torch.arange(k, device=z.device, dtype=torch.int32)[None, :]
    nth_equal = (slot - above.to(torch.int32) + 1).clamp(min=1)
    tie_cols = torch.searchsorted(equal_count, nth_equal).clamp(max=z.shape[1] - 1)
    cols = torch.where(slot >= above, tie_cols, cols)
    return z.gather(1, cols), cols


def _rows_of(temperature: float | torch.Tensor, t0: int, t1: int) -> float | torch.Tensor:
    """The temperature of tokens ``[t0, t1)``: the float, or the rows' ``[t1 - t0, 1]`` column."""
    if isinstance(temperature, torch.Tensor):
        return temperature[t0:t1, None]
    return temperature


def _shard_topk(
    tokens: torch.Tensor, weight: torch.Tensor, k: int, temperature: float | torch.Tensor, *, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's candidates ``(values [n, c], ids [n, c])`` with ``c = min(k, V/tp)`` and the
    statistics ``(m [n], s [n])`` of the rest of its shard, one logits block at a time.
    ``temperature``: a float or ``T [n]`` per token (the accumulation dtype)."""
    n, v = tokens.shape[0], weight.shape[0]
    acc = torch.promote_types(tokens.dtype, torch.float32)
    device = tokens.device
    c = min(k, v)
    values = torch.empty(n, c, dtype=acc, device=device)
    ids = torch.empty(n, c, dtype=torch.int64, device=device)
    rest_max = torch.empty(n, dtype=acc, device=device)
    rest_sum = torch.empty(n, dtype=acc, device=device)
    token_chunk, vocab_chunk = TOKEN_CHUNK, VOCAB_CHUNK
    for t0, t1 in _chunks(n, token_chunk):
        x = tokens[t0:t1]
        rows_t = _rows_of(temperature, t0, t1)
        m = torch.full((t1 - t0,), -torch.inf, dtype=acc, device=device)
        s = torch.zeros(t1 - t0, dtype=acc, device=device)
        run_values = run_ids = None
        for v0, v1 in _chunks(v, vocab_chunk):
            z = _tempered_logits(x, weight[v0:v1], rows_t)
            chunk_values, cols = _chunk_topk(z, min(k, v1 - v0))
            m, s = fold_into_statistics(m, s, z.scatter_(1, cols, -torch.inf))
            chunk_ids = cols.to(torch.int64) + (vocab_start + v0)
            if run_values is None:
                run_values, run_ids = chunk_values, chunk_ids
            else:
                run_values, run_ids, dropped = select_topk(
                    torch.cat([run_values, chunk_values], dim=1), torch.cat([run_ids, chunk_ids], dim=1), k
                )
                m, s = fold_into_statistics(m, s, dropped)
        values[t0:t1], ids[t0:t1], rest_max[t0:t1], rest_sum[t0:t1] = run_values, run_ids, m, s
    return values, ids, rest_max, rest_sum


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(impl: object, hidden: torch.Tensor) -> bool:
    """Whether the shard pass is the Triton kernel: by ``impl``, the device and the dtype."""
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {validation.type_name(impl)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    runnable = hidden.dtype in _TRITON_DTYPES and (hidden.is_cuda or interpreting()) and _triton_importable()
    if impl == "triton" and not runnable:
        raise ValueError(
            "impl='triton' needs fp16/bf16/fp32 CUDA tensors (or TRITON_INTERPRET=1) and triton, got "
            f"{hidden.dtype} tensors on {hidden.device}; use impl='torch' or 'auto'"
        )
    return runnable and (impl == "triton" or hidden.is_cuda)


def _triton_splits(n_tiles: int, cfg: GemmConfig) -> int:
    """Vocab splits per row block: the config's tiles per program, or :data:`TRITON_SPLITS`."""
    if TRITON_SPLITS is not None:
        return max(1, min(TRITON_SPLITS, n_tiles))
    return cdiv(n_tiles, cfg.tiles_per_split)


def _triton_config(dtype: torch.dtype) -> GemmConfig:
    return for_dtype(TRITON_INTERPRETER_CONFIG if interpreting() else TRITON_CONFIG, dtype)


def _shard_topk_triton(
    tokens: torch.Tensor, weight: torch.Tensor, k: int, temperature: float | torch.Tensor, *, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_shard_topk`'s outputs from the fused kernel, token chunk by token chunk: as many
    rows per launch as keep the per-(row, tile) outputs within :data:`TRITON_SCRATCH_BYTES`."""
    n, v = tokens.shape[0], weight.shape[0]
    c = min(k, v)
    device = tokens.device
    tokens, weight = rowmajor(tokens), rowmajor(weight)
    cfg = _triton_config(tokens.dtype)
    # Per row: the tiles' candidates and rests, the slots of its full tiles' recompute, and its
    # place in the full pairs' lists by tile (one int32 per tile).
    num_tiles = cdiv(v, cfg.block_n)
    candidates = num_tiles * (8 * _candidates_per_tile(num_tiles, c) + 8)
    per_row = candidates + _full_tiles_cap(num_tiles, c) * cfg.block_n * 4 + num_tiles * 4
    chunk = max(cfg.block_m, TRITON_SCRATCH_BYTES // per_row // cfg.block_m * cfg.block_m)
    if 0 < n <= chunk:  # one launch: its outputs are the shard's
        values, ids, rest_max, rest_sum = _triton_chunk(tokens, weight, k, temperature, cfg)
        if vocab_start:
            ids += vocab_start
        return values, ids, rest_max, rest_sum
    values = torch.empty(n, c, dtype=torch.float32, device=device)
    ids = torch.empty(n, c, dtype=torch.int64, device=device)
    rest_max = torch.empty(n, dtype=torch.float32, device=device)
    rest_sum = torch.empty(n, dtype=torch.float32, device=device)
    for t0, t1 in _chunks(n, chunk):
        row_t = temperature[t0:t1] if isinstance(temperature, torch.Tensor) else temperature
        out = _triton_chunk(tokens[t0:t1], weight, k, row_t, cfg)
        values[t0:t1], ids[t0:t1], rest_max[t0:t1], rest_sum[t0:t1] = out
    ids += vocab_start
    return values, ids, rest_max, rest_sum


def _inverse_temperature(
    temperature: float | torch.Tensor, placeholder: torch.Tensor
) -> tuple[float, torch.Tensor, bool]:
    """``(inv_temp, inv_temp_rows, row_temp)`` for the kernel, rounded as the head's kernels
    take them: a float gives the scalar ``1/T`` and ``placeholder`` as the never-read vector; a
    per-token ``T [n]`` gives ``1/T_i`` as an fp32 vector, each the fp32 rounding of the exact
    ``1/T_i`` (formed in fp64, as the scalar is), and a scalar 1.0 the kernel does not read."""
    if not isinstance(temperature, torch.Tensor):
        return 1.0 / temperature, placeholder, False
    return 1.0, (1.0 / temperature.to(torch.float64)).to(torch.float32).contiguous(), True


class _Tiles(NamedTuple):
    """The kernel's per-(row, tile) outputs (see :mod:`mcore_ppo.kernels.topk`)."""

    values: torch.Tensor  # [n, tiles · C] fp32, per tile largest first
    cols: torch.Tensor  # [n, tiles · C] int32 shard columns
    rest_m: torch.Tensor  # [n, tiles] the tile's other entries: max
    rest_s: torch.Tensor  # [n, tiles] and Σ exp(z - max)


def _triton_chunk(
    tokens: torch.Tensor, weight: torch.Tensor, k: int, temperature: float | torch.Tensor, cfg: GemmConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch over ``tokens [n, h]`` (``temperature`` a float or ``T [n]``): the top
    ``min(k, V)`` in the tie rule's order, shard-local ids, and the rest's ``(m, s)``."""
    from mcore_ppo.kernels.topk import topk_tiles_kernel

    n, h = tokens.shape
    v = weight.shape[0]
    device = tokens.device
    num_tiles = cdiv(v, cfg.block_n)
    splits = _triton_splits(num_tiles, cfg)
    tiles_per_split = cdiv(num_tiles, splits)
    splits = cdiv(num_tiles, tiles_per_split)
    c = _candidates_per_tile(num_tiles, min(k, v))
    values = torch.empty(n, num_tiles * c, dtype=torch.float32, device=device)
    cols = torch.empty(n, num_tiles * c, dtype=torch.int32, device=device)
    rest = torch.empty(2, n, num_tiles, dtype=torch.float32, device=device)
    use_tma = operands_by_tma(tokens, weight, cfg) and tokens.data_ptr() % 16 == 0
    x_desc = TmaDesc(tokens, (cfg.block_m, cfg.block_k)) if use_tma else tokens
    w_desc = TmaDesc(weight, (cfg.block_n, cfg.block_k)) if use_tma else weight
    inv_temp, inv_temp_rows, row_temp = _inverse_temperature(temperature, rest)
    # The head's launcher: Triton's per-call dispatch and descriptor encoding cost ~0.1 ms of
    # host time per launch, a few percent of a 3 ms call at TP 8.
    launch(
        topk_tiles_kernel,
        (cdiv(n, cfg.block_m) * splits,),
        (
            tokens, weight, x_desc, w_desc, values, cols, rest[0], rest[1], n, v, h, tokens.stride(0),
            weight.stride(0), splits, tiles_per_split, num_tiles, inv_temp, inv_temp_rows,
        ),
        dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, C=c,
            USE_TMA=use_tma, **kernel_flags(tokens, cfg), ROW_TEMP=row_temp, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **({"maxnreg": TRITON_MAX_REGISTERS} if TRITON_MAX_REGISTERS and not interpreting() else {}),
        ),
    )  # fmt: skip
    tiles = _Tiles(values, cols, rest[0], rest[1])
    inverse = (inv_temp, inv_temp_rows, row_temp)  # the recompute takes the same roundings
    return _select_from_tiles(tokens, weight, tiles, min(k, v), inverse, cfg)


def _select_from_tiles(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    tiles: _Tiles,
    c_out: int,
    inverse: tuple[float, torch.Tensor, bool],
    cfg: GemmConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact top ``c_out`` of a shard from its tiles' candidates, and the rest's ``(m, s)``;
    ``inverse``: the tiles kernel's :func:`_inverse_temperature`, for the recompute.

    :func:`~mcore_ppo.kernels.topk.select_top_kernel` takes each row's top ``c_out`` of the
    candidates in the tie rule's order; its last value ``b`` bounds the true top ``c_out`` from
    below. A tile's unkept entries are at most its rest's max, so only *full* tiles (rest max
    ``>= b``, every candidate in the top) can hide one: those (row, tile) pairs are recomputed
    whole (:func:`_recompute_full_tiles`) and merged in place of the tile's candidates
    (:func:`_merge_full_tiles`). The rest is summed from its own terms, each row in a fixed
    order: the unselected candidates and the tiles' rests outside full tiles, then the entries
    the merge drops. No host sync: a row has at most ``c_out // C`` full tiles, so their pairs
    have fixed slots (``[n, cap]``), and the recompute and the merge run whether or not any
    tile is full (a row or work item without one returns at once).
    """
    from mcore_ppo.kernels.topk import select_top_kernel

    n, width = tiles.values.shape
    values, cols = tiles.values, tiles.cols
    if width < c_out:  # a tiny shard, fewer candidates than wanted: the bound is -inf below
        pad = c_out - width
        values = torch.cat([values, values.new_full((n, pad), -torch.inf)], dim=1)
        cols = torch.cat([cols, cols.new_zeros(n, pad)], dim=1)
        width = c_out
    num_tiles = tiles.rest_m.shape[1]
    cap = _full_tiles_cap(num_tiles, c_out)
    device = values.device
    top_values = torch.empty(n, c_out, dtype=torch.float32, device=device)
    top_cols = torch.empty(n, c_out, dtype=torch.int64, device=device)
    full = torch.empty(n, num_tiles, dtype=torch.int8, device=device)
    full_rows = torch.empty(n, dtype=torch.int32, device=device)
    full_list = torch.empty(n, max(cap, 1), dtype=torch.int32, device=device)
    rest_m = torch.empty(n, dtype=torch.float32, device=device)
    rest_s = torch.empty_like(rest_m)
    block_w = _next_pow2(width)
    # One row per program on a GPU, a warp per 512 candidates up to 4 (the fastest on the H200
    # at 375, 2970 and 5120 candidates); rows share a program in the interpreter, whose cost
    # is per program.
    block_r = TRITON_INTERPRETER_SELECT_ROWS if interpreting() else 1
    launch(
        select_top_kernel,
        (cdiv(n, block_r),),
        (values, cols, tiles.rest_m, tiles.rest_s, top_values, top_cols, full, full_rows, full_list, rest_m, rest_s,
         n, width, c_out, num_tiles, max(cap, 1)),
        dict(
            C=_candidates_per_tile(num_tiles, c_out), BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_T=_next_pow2(num_tiles),
            TOP=_next_pow2(c_out), BY_SORT=_keys_by_sort(),
            num_warps=max(1, min(4, block_w // 512)),
        ),
    )  # fmt: skip
    if cap and n:
        # The rest so far holds every entry outside full tiles that ranks after the top's last;
        # the merge folds in the top's and the full tiles' entries that drop out of it.
        recomputed = _recompute_full_tiles(tokens, weight, full, full_list.shape[1], inverse, cfg)
        _merge_full_tiles(top_values, top_cols, full, full_rows, full_list, recomputed, rest_m, rest_s, weight, cfg)
    return top_values, top_cols, rest_m, rest_s


def _candidates_per_tile(num_tiles: int, c_out: int) -> int:
    """``C`` for a shard of ``num_tiles`` logit tiles and a top ``c_out``: from the low end of
    :data:`TRITON_CANDIDATE_RANGE` (or ``c_out + 1`` below it: then no tile fills), one more
    while it saves more than :data:`TRITON_FULL_TILES_PER_CANDIDATE` expected full tiles per row
    (random logits: the top spread over the tiles as ``Poisson(c_out / num_tiles)``).
    :data:`TRITON_CANDIDATES` forces it."""
    if TRITON_CANDIDATES is not None:
        return TRITON_CANDIDATES
    return _chosen_candidates(num_tiles, c_out, TRITON_CANDIDATE_RANGE, TRITON_FULL_TILES_PER_CANDIDATE)


@functools.lru_cache(maxsize=256)
def _chosen_candidates(num_tiles: int, c_out: int, bounds: tuple[int, int], saving: float) -> int:
    low, high = bounds
    c = min(low, c_out + 1)  # more than c_out: no tile can fill, nothing to recompute
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


def _full_tiles_cap(num_tiles: int, c_out: int) -> int:
    """The most full tiles a row can have: each holds ``C`` entries of the top ``c_out``."""
    return min(num_tiles, c_out // _candidates_per_tile(num_tiles, c_out))


def _keys_by_sort() -> bool:
    return not interpreting() if TRITON_SORT_KEYS is None else TRITON_SORT_KEYS


def _recompute_full_tiles(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    full: torch.Tensor,
    cap: int,
    inverse: tuple[float, torch.Tensor, bool],
    cfg: GemmConfig,
) -> torch.Tensor:
    """``z [n·cap, BLOCK_N]``: slot ``r·cap + j`` holds row ``r``'s whole ``j``-th full tile
    (``full [n, tiles]``: 0, or 1 + that place ``j``; ``-inf`` past the shard), as the tiles
    kernel computes it (with its ``inverse`` temperature); other slots are left unwritten. Two
    launches and no host sync: the pairs listed by tile, then the tiles recomputed, each in work
    items of at most :data:`TRITON_RECOMPUTE_ROWS` rows, on a grid of the most items the slots
    could need (those past the last find no pairs)."""
    from mcore_ppo.kernels.topk import full_pairs_kernel, tile_rows_kernel

    n, h = tokens.shape
    v = weight.shape[0]
    slots = n * cap
    device = tokens.device
    num_tiles = full.shape[1]
    counts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    pair_slot = torch.empty(num_tiles, n, dtype=torch.int32, device=device)
    interpreted = interpreting()
    launch(
        full_pairs_kernel,
        (num_tiles,),
        (full, counts, pair_slot, n, num_tiles, cap),
        dict(BLOCK_R=16 if interpreted else 4096, num_warps=8),
    )
    block = TRITON_INTERPRETER_RECOMPUTE_ROWS if interpreted else TRITON_RECOMPUTE_ROWS
    z = torch.empty(slots, cfg.block_n, dtype=torch.float32, device=device)
    inv_temp, inv_temp_rows, row_temp = inverse
    launch(
        tile_rows_kernel,
        (cdiv(slots, block) + min(num_tiles, slots),),
        (tokens, weight, counts, pair_slot, z, n, v, h, tokens.stride(0), weight.stride(0), num_tiles, cap,
         inv_temp, inv_temp_rows),
        dict(
            BLOCK_M=block, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_T=_next_pow2(num_tiles),
            num_warps=min(4, cfg.num_warps), num_stages=cfg.num_stages, **kernel_flags(tokens, cfg),
            **({"ROW_TEMP": True} if row_temp else {}),
        ),
    )  # fmt: skip
    return z


def _merge_full_tiles(
    top_values: torch.Tensor,
    top_cols: torch.Tensor,
    full: torch.Tensor,
    full_rows: torch.Tensor,
    full_list: torch.Tensor,
    recomputed: torch.Tensor,
    rest_m: torch.Tensor,
    rest_s: torch.Tensor,
    weight: torch.Tensor,
    cfg: GemmConfig,
) -> None:
    """In place, for the rows with full tiles: the top over the entries outside full tiles and the
    recomputed tiles' (in the tie rule's order), and the entries that drop out of it folded into
    the rest (:func:`~mcore_ppo.kernels.topk.merge_full_kernel`, one program per row; a row
    without a full tile returns at once)."""
    from mcore_ppo.kernels.topk import merge_full_kernel

    n, c_out = top_values.shape
    top = _next_pow2(c_out)
    launch(
        merge_full_kernel,
        (n,),
        (top_values, top_cols, full, full_rows, full_list, recomputed, rest_m, rest_s, n, weight.shape[0], c_out,
         full.shape[1], full_list.shape[1]),
        dict(BLOCK_N=cfg.block_n, TOP=top, BLOCK_U=_next_pow2(top + cfg.block_n), BY_SORT=_keys_by_sort()),
    )  # fmt: skip


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()
