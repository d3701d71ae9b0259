"""A teacher's top-k over the tensor-parallel vocab shards, without the ``[tokens, V]`` logits.

Per token, with ``z = hidden @ W.T / T`` over the global vocab and ``p = softmax(z)`` (``T`` one
number, or the token's own temperature: a per-token tensor divides each token's row), returns
the global ids of the ``k`` most likely tokens, their ``log p`` and the log of the probability
mass outside them. Each TP rank reduces its own shard to candidates and the softmax statistics
``(m, s)`` of its rest, one bounded block of logits at a time (the torch pass:
:mod:`mcore_ppo.distill.topk_torch`). The ranks then merge
(:func:`mcore_ppo.parallel.topk.merge_topk_over_ranks`).

On CUDA (fp16/bf16/fp32) the shard's pass is the head's own statistics kernel instead, with
its top-k on (:mod:`mcore_ppo.distill.topk_triton`): logit tiles in registers, each giving its
largest entries and its rest's statistics beside the head's; a second kernel selects the exact top ``k`` of each token's
candidates and sums its rest, and the few tiles that may hide more of the top are recomputed
whole and merged. The torch path stays the CPU/fp64 path and the exactness reference
(``impl="torch"``). Either pass also reduces the head's statistics of each token when asked
(:func:`topk_and_statistics`: the student's top-k and its ``lse``, entropy and Σπ² from one
read of the vocab).

The arguments go through the head's checks (:func:`mcore_ppo.head_call.check_call`), whose
verdict is shared over the TP group: a bad argument on one rank raises on every rank before the
first collective. Tokens are ordered as the head orders them (:mod:`mcore_ppo.tokens`).

No gradient: the teacher is not trained, so the call runs under ``torch.no_grad()`` and its
outputs never require grad, whatever ``hidden`` and ``weight`` do.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mcore_ppo import validation
from mcore_ppo.distill import topk_torch, topk_triton
from mcore_ppo.distill.topk_config import DEFAULT_CONFIG, TopKConfig
from mcore_ppo.head_call import attempt, check_call
from mcore_ppo.options import DEFAULT_LAYOUT, DEFAULT_OPTIONS, call_options, megatron_layout
from mcore_ppo.parallel.groups import resolve_tp_group
from mcore_ppo.parallel.mappings import all_gather_first_dim
from mcore_ppo.parallel.ranks import ProcessGroup, group_rank, group_size
from mcore_ppo.parallel.topk import merge_topk_over_ranks, select_topk_lse
from mcore_ppo.shard import autocast_off
from mcore_ppo.statistics import Statistics
from mcore_ppo.tokens import from_rows, hidden_rows, to_rows

__all__ = ["IMPLS", "MAX_TOPK", "TopK", "TopKConfig", "check_k", "fused_topk", "topk_and_statistics"]

#: Largest ``k`` accepted: a top-k teacher is a sparse summary (verl's default is 128), and
#: every rank all-gathers ``k`` candidates per token from every other rank.
MAX_TOPK = 128
#: Which shard pass ``impl="auto"`` takes: the Triton kernels for fp16/bf16/fp32 CUDA tensors
#: (where Triton is installed), the torch path otherwise.
IMPLS = ("auto", "torch", "triton")


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
    config: TopKConfig | None = None,
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
            ``>= MIN_TEMPERATURE`` (see ``validate``). Dividing a row by its positive ``T`` keeps
            the row's order, so the ids are those of the untempered logits (up to fp32 rounding
            of near-ties); the log-probs and tail mass are those of ``softmax(z_i / T_i)``.
        tp_group: tensor-parallel group; default Megatron's when initialised, else one rank.
        sequence_parallel: ``hidden`` arrives sequence-sharded over TP.
        labels: optional, shaped as for the head (``[b, s]``, ``[1, t]``, ``[n]``, the whole
            sequence), global vocab ids or ``ignore_index``. Tokens whose label is
            ``ignore_index`` get ``ids = ignore_index``, ``log_probs = 0``,
            ``tail_log_mass = 0``. None: every token counts.
        ignore_index: the label value of tokens to skip.
        impl: the shard pass: ``"auto"`` (the fused Triton kernels for fp16/bf16/fp32 CUDA
            tensors, the torch path otherwise), ``"torch"`` (chunked cuBLAS GEMMs +
            ``torch.topk``, any device), ``"triton"`` (CUDA tensors, or any under
            ``TRITON_INTERPRET=1``; not fp64). Every choice returns the same ids.
        validate: as the head's: True checks the values of the labels (in ``[0, V)`` or
            ``ignore_index``) and of a temperature tensor (finite, ``>= MIN_TEMPERATURE``), a
            bad one raising ValueError on every TP rank; one host sync per call. False reads
            nothing back: a token with a bad temperature then gets NaN ``log_probs`` and
            ``tail_log_mass`` (its ids are those of ``T = 1``), never a plausible number. None:
            :data:`mcore_ppo.validation.VALIDATE_DEFAULT`.
        config: how the shard pass runs (:class:`~mcore_ppo.distill.topk_config.TopKConfig`:
            block sizes, the kernels' tiles and candidates); None: the defaults.

    Returns:
        :class:`TopK` ``(ids, log_probs, tail_log_mass)``: ``[b, s, k]`` / ``[b, s]`` for hidden
        ``[s, b, h]`` (``[1, t, k]`` packed), ``[n, k]`` / ``[n]`` for ``[n, h]``; identical on
        every TP rank. ``log_probs`` and ``tail_log_mass`` are fp32 (fp64 for fp64 inputs).

    Raises:
        TypeError: ``k`` not an int, non-tensor inputs, a non-float ``hidden``, ``weight`` of
            another dtype, ``labels`` not an integer tensor, a flag that is not a bool, a
            ``temperature`` neither a number nor a floating-point tensor, ``impl`` not a str,
            ``config`` not a TopKConfig.
        ValueError: ``k`` out of range, shapes that do not fit a layout, unequal weight shards,
            a bad temperature (value, or a tensor's shape, device or values) or ``ignore_index``,
            labels outside ``[0, V)`` that are not ``ignore_index`` (with ``validate``), an
            unknown ``impl`` or ``"triton"`` where it cannot run, or another TP rank's refusal
            of its own inputs.
    """
    with torch.no_grad():
        return _fused_topk(
            hidden, weight, k, temperature, tp_group, sequence_parallel, labels, ignore_index, impl, validate, config
        )[0]


def topk_and_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    statistics: Statistics,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    impl: str = "auto",
    validate: bool | None = None,
    config: TopKConfig | None = None,
    prior_error: Exception | None = None,
) -> tuple[TopK, torch.Tensor]:
    """:func:`fused_topk`'s result and, from the same pass over the logits, the head's
    ``statistics`` of each token over the global vocab, finished
    (:meth:`~mcore_ppo.statistics.Statistics.finished`: ``[1 + terms, n]``, ``lse`` then each
    optional term's value, in the rows' order of the head, fp32, fp64 for fp64 inputs; no
    gradient): what the head's ``[..., k]`` ids pass takes as ``given_statistics`` instead of
    running its own statistics pass over the same logits (:func:`mcore_ppo.head_call.run_head`).
    ``prior_error``: the caller's own refusal of its arguments, shared over the TP group with
    this call's verdict (:func:`mcore_ppo.head_call.check_call`), before any collective of the
    pass."""
    if not isinstance(statistics, Statistics):
        raise TypeError(f"statistics must be a mcore_ppo.statistics.Statistics, got {validation.type_name(statistics)}")
    with torch.no_grad():
        return _fused_topk(
            hidden, weight, k, temperature, tp_group, sequence_parallel, labels, ignore_index, impl, validate, config,
            prior_error, statistics,
        )  # fmt: skip


def _fused_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    labels: torch.Tensor | None,
    ignore_index: int,
    impl: str,
    validate: bool | None,
    config: TopKConfig | None,
    caller_error: Exception | None = None,
    statistics: Statistics | None = None,
) -> tuple[TopK, torch.Tensor | None]:
    # The head's backend does not run here (the shard pass is this module's): "torch" is a
    # backend every device has, so the head's checks never refuse these inputs for it. A bad
    # option or flag, or the caller's own refusal, is shared over the TP group with every other
    # refusal (prior_error).
    (options, layout), prior_error = attempt(
        lambda: (
            call_options(None, ignore_index=ignore_index, backend="torch", return_entropy=False, validate=validate),
            megatron_layout(sequence_parallel),
        ),
        (DEFAULT_OPTIONS, DEFAULT_LAYOUT),
    )
    tp_group = resolve_tp_group(tp_group)
    given_labels = labels
    if labels is None:  # zeros are valid ids: the value checks read them
        labels = _zero_labels(hidden, tp_group, sequence_parallel)
    unsupported = functools.partial(_unsupported, weight=weight, k=k, impl=impl, config=config, tp_group=tp_group)
    call = check_call(
        hidden, weight, labels, temperature, options, tp_group, layout, ids=False, unsupported=unsupported,
        prior_error=caller_error or prior_error,
    )  # fmt: skip
    config = DEFAULT_CONFIG if config is None else config
    use_triton = _use_triton(impl, hidden)

    if sequence_parallel and call.tp_size > 1:
        hidden = all_gather_first_dim(hidden, tp_group)
    tokens = hidden_rows(hidden)
    shard_pass = topk_triton.shard_topk_triton if use_triton else topk_torch.shard_topk_torch
    with autocast_off(hidden.device):
        shard = shard_pass(
            tokens, weight, k, call.temperature, vocab_start=group_rank(tp_group) * weight.shape[0], config=config,
            statistics=statistics,
        )  # fmt: skip
        top_values, top_ids, lse, tail_lse = merge_topk_over_ranks(
            shard.values,
            shard.ids,
            shard.rest_max,
            shard.rest_sum,
            k,
            tp_group,
            presorted=use_triton,
            select=topk_triton.select_merged if use_triton else select_topk_lse,
        )
        finished = None
        if statistics is not None:
            # The head's statistics of the same pass, combined over TP as the head combines its own.
            shard_max, sums = shard.planes[0], shard.planes[1:]
            global_max, sums, _ = statistics.combine(shard_max, sums, torch.zeros_like(shard_max), tp_group)
            finished = statistics.finished(*statistics.finish(global_max, sums))
    log_probs = top_values - lse[:, None]
    tail_log_mass = tail_lse - lse
    batch_first = hidden.dim() == 3
    if given_labels is not None:
        valid = to_rows(call.labels, batch_first) != options.ignore_index
        top_ids = torch.where(valid[:, None], top_ids, torch.full_like(top_ids, options.ignore_index))
        log_probs = torch.where(valid[:, None], log_probs, torch.zeros_like(log_probs))
        tail_log_mass = torch.where(valid, tail_log_mass, torch.zeros_like(tail_log_mass))
    if call.bad_temperature is not None and not call.values_read:
        # Bad values were replaced by 1 for the computation; their tokens' outputs must not pass for numbers.
        log_probs = log_probs.masked_fill(call.bad_temperature[:, None], math.nan)
        tail_log_mass = tail_log_mass.masked_fill(call.bad_temperature, math.nan)
    if batch_first:
        seq, batch = hidden.shape[:2]
        return TopK(*(from_rows(out, True, batch, seq) for out in (top_ids, log_probs, tail_log_mass))), finished
    return TopK(top_ids, log_probs, tail_log_mass), finished


def _zero_labels(hidden: object, tp_group: ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """int64 zeros shaped as labels of the call's layout, for the head's checks; never raises
    (inputs the checks refuse get a placeholder, and the checks name the argument)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        device = hidden.device if isinstance(hidden, torch.Tensor) else None
        return torch.zeros(0, dtype=torch.int64, device=device)
    sp = sequence_parallel is True and isinstance(tp_group, ProcessGroup)
    seq = hidden.shape[0] * (group_size(tp_group) if sp else 1)
    shape = (hidden.shape[1], seq) if hidden.dim() == 3 else (seq,)
    return torch.zeros(shape, dtype=torch.int64, device=hidden.device)


def _unsupported(
    hidden: torch.Tensor,
    *,
    weight: torch.Tensor,
    k: object,
    impl: object,
    config: object,
    tp_group: ProcessGroup | None,
) -> None:
    """The top-k's own checks, inside the head's (their verdict shared over the TP group):
    ``k`` against the global vocab, ``config`` and ``impl`` (raising TypeError/ValueError)."""
    check_k(k, weight.shape[0] * group_size(tp_group))
    if config is not None and not isinstance(config, TopKConfig):
        raise TypeError(f"config must be a mcore_ppo.distill.TopKConfig or None, got {validation.type_name(config)}")
    _use_triton(impl, hidden)


def _use_triton(impl: object, hidden: torch.Tensor) -> bool:
    """Whether the shard pass is the Triton kernels: by ``impl``, the device and the dtype."""
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {validation.type_name(impl)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    runnable = topk_triton.runnable(hidden)
    if impl == "triton" and not runnable:
        raise ValueError(
            "impl='triton' needs fp16/bf16/fp32 CUDA tensors (or TRITON_INTERPRET=1) and triton, got "
            f"{hidden.dtype} tensors on {hidden.device}; use impl='torch' or 'auto'"
        )
    return runnable and (impl == "triton" or hidden.is_cuda)
