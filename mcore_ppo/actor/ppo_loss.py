"""PPO policy loss and loss aggregation, as pure tensor functions (no model, no process groups).

The actor (:mod:`mcore_ppo.actor`) splits a mini-batch over micro-batches, data-parallel ranks and
context-parallel ranks. To give the same gradient under every split, each mode of aggregation is
written as a *per-token weight* computed from **global** counts (all micro-batches, all DP ranks,
and every CP shard of a sequence), and the loss of any part of the batch is ``Σ weight · loss``
over the tokens that part holds; the parts then simply add up:

==========================  ====================================================================
mode                        weight of response token ``i`` of sequence ``s(i)``
==========================  ====================================================================
``token-mean``              ``1 / N_tokens``            (N_tokens: response tokens in the batch)
``seq-mean-token-sum``      ``1 / N_seqs``              (N_seqs: sequences with a response token)
``seq-mean-token-mean``     ``1 / (n_{s(i)} · N_seqs)`` (n_s: response tokens of sequence s)
==========================  ====================================================================

These are verl's ``agg_loss`` modes, with verl's definitions when the whole batch sits in one
place. Megatron's schedule then scales a micro-batch's 2-tuple loss by ``cp_size /
num_microbatches`` and DDP averages gradients over the DP×CP group; :func:`schedule_loss_scale`
is the factor that undoes both so that the summed gradient is that of the global objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

# The modes and their check live with the config (torch-free); named here too, beside the losses.
from mcore_ppo.actor.config import LOSS_AGG_MODES as LOSS_AGG_MODES
from mcore_ppo.actor.config import check_loss_agg_mode
from mcore_ppo.validation import check_tensor
from mcore_ppo.verdict import values_readable

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


# --- argument checks (types and shapes only: nothing here reads a CUDA tensor's values) -----------


def _check_number(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """A real Python number (int or float, not bool), not NaN; returned as float."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return float(value)


def _same_shape(names: str, *tensors: torch.Tensor) -> None:
    if any(t.shape != tensors[0].shape for t in tensors[1:]):
        raise ValueError(f"{names} must have the same shape, got " + ", ".join(str(tuple(t.shape)) for t in tensors))


def _values_checked(tensor: torch.Tensor) -> bool:
    """Whether values of ``tensor`` are read back to raise: where that costs no host sync (a CPU
    tensor outside a compiled region), as for the head's own checks (docs/design.md §5)."""
    return values_readable(tensor)


def _sequence_index(seq_index: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, in_range)``: int64 ids clamped into ``[0, num_seqs)`` and where they were in it.

    Ids out of range are a ValueError for CPU tensors.
    Otherwise, checking would cost a host sync: the callers poison what such a token touches
    with NaN instead (never an indexing assert on the device, never a plausible number)."""
    index = seq_index.reshape(-1).long()
    in_range = (index >= 0) & (index < num_seqs)
    if _values_checked(index) and not bool(in_range.all()):
        bad = index[~in_range][0].item()
        raise ValueError(f"seq_index must hold sequence ids in [0, {num_seqs}), found {bad}")
    return index.clamp(0, max(num_seqs - 1, 0)), in_range


def _mask_values(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` in fp64, NaN where it is negative or NaN: a ValueError on CPU (and on CUDA with
    ``MCORE_PPO_VALIDATE=1``), else poisoned rather than read back (a host sync) or dropped."""
    maskf = mask.to(torch.float64)
    bad = ~(maskf >= 0)
    if _values_checked(mask) and bool(bad.any()):
        raise ValueError(f"mask must be >= 0 (0/1, or per-token weights), found {maskf[bad][0].item()}")
    return torch.where(bad, torch.nan, maskf)


@dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token terms of the clipped surrogate (all shaped like the inputs).

    Attributes:
        pg_losses: the per-token policy-gradient loss to aggregate.
        log_ratio: ``log_prob - old_log_prob`` (clamped as for the ratio).
        ratio: ``exp(log_ratio)``.
        clipped: 1.0 where the clipped branch is the active one (PPO's clip fraction).
        dual_clipped: 1.0 where the dual-clip bound is active (negative advantages only).
    """

    pg_losses: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
    """PPO-clip surrogate per token, with the dual-clip bound for negative advantages.

    ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to ``±log_ratio_clamp`` so an
    outlier token cannot overflow, as verl does), and per token::

        clip_loss = max(-A · ratio, -A · clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        pg_loss   = min(clip_loss, -A · clip_ratio_c)   if A < 0 and clip_ratio_c is not None
                    clip_loss                            otherwise

    Args:
        log_prob: current policy's log-probs of the sampled tokens (differentiable).
        old_log_prob: log-probs of the same tokens under the policy that sampled them.
        advantages: per-token advantages.
        clip_ratio_low: lower clip ``ε_low`` (ratio floor ``1 - ε_low``), in ``[0, 1)``.
        clip_ratio_high: upper clip ``ε_high`` (ratio ceiling ``1 + ε_high``), ``≥ 0``.
        clip_ratio_c: dual-clip constant (> 1), or None for plain PPO-clip.
        log_ratio_clamp: bound on ``|log_prob - old_log_prob|`` before the exponential.

    Returns:
        :class:`PolicyLossTerms`, unaggregated (aggregate with :func:`aggregate`).
    """
    for name, value in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages)):
        check_tensor(name, value, "float")
    _same_shape("log_prob, old_log_prob and advantages", log_prob, old_log_prob, advantages)
    clip_ratio_low = _check_number("clip_ratio_low", clip_ratio_low)
    clip_ratio_high = _check_number("clip_ratio_high", clip_ratio_high)
    clip_ratio_c = _check_number("clip_ratio_c", clip_ratio_c, allow_none=True)
    log_ratio_clamp = _check_number("log_ratio_clamp", log_ratio_clamp)
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0 (inf: no upper clip), got {clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip) must be > 1 or None, got {clip_ratio_c}")
    if not log_ratio_clamp > 0.0:
        raise ValueError(f"log_ratio_clamp must be > 0 (a bound on |log_prob - old_log_prob|), got {log_ratio_clamp}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(log_prob.dtype)
    if clip_ratio_c is None:
        pg_losses = clip_loss
        dual_clipped = torch.zeros_like(clipped)
    else:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
        dual_clipped = ((clip_loss > dual_bound) & negative).to(log_prob.dtype)
    return PolicyLossTerms(pg_losses, log_ratio, ratio, clipped, dual_clipped)


def kl_k3(sample_log_prob: torch.Tensor, other_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(q ‖ p)`` from tokens sampled from ``q`` (always ≥ 0).

    ``r = log p - log q`` and the estimate is ``exp(r) - 1 - r``, whose mean over samples of
    ``q`` is exactly ``KL(q ‖ p)`` in expectation (Schulman's k3). In PPO the tokens come from
    the old policy, so ``kl_k3(old_log_probs, log_probs)`` estimates ``KL(π_old ‖ π)``.

    Args:
        sample_log_prob: ``log q`` of the sampled tokens (the sampling policy).
        other_log_prob: ``log p`` of the same tokens.
    """
    check_tensor("sample_log_prob", sample_log_prob, "float")
    check_tensor("other_log_prob", other_log_prob, "float")
    _same_shape("sample_log_prob and other_log_prob", sample_log_prob, other_log_prob)  # no silent broadcast
    r = other_log_prob - sample_log_prob
    return torch.expm1(r) - r


def sequence_token_counts(mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Number of masked-in tokens of each sequence: ``counts[s] = Σ_{i: seq_index[i] = s} mask[i]``.

    Args:
        mask: per-token 0/1 (bool or float) of tokens that count (response tokens).
        seq_index: per-token id of the sequence it belongs to, in ``[0, num_seqs)``.
        num_seqs: number of sequences.

    Returns:
        fp64 ``[num_seqs]`` (fp64 so counts add up exactly across ranks). An id outside
        ``[0, num_seqs)`` is a ValueError on CPU; on CUDA it
        makes a count NaN.
    """
    check_tensor("mask", mask, "mask")
    check_tensor("seq_index", seq_index, "index")
    _same_shape("mask and seq_index", mask, seq_index)
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int):
        raise TypeError(f"num_seqs must be an int, got {type(num_seqs).__name__}")
    if num_seqs < 0:
        raise ValueError(f"num_seqs must be >= 0, got {num_seqs}")
    counts = torch.zeros(num_seqs, dtype=torch.float64, device=mask.device)
    index, in_range = _sequence_index(seq_index, num_seqs)
    if num_seqs == 0:
        return counts
    values = torch.where(in_range, _mask_values(mask).reshape(-1), torch.nan)
    return counts.index_add_(0, index, values)


def loss_weights(
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: str,
    *,
    seq_token_counts: torch.Tensor,
    num_tokens: float | torch.Tensor,
    num_seqs: float | torch.Tensor,
) -> torch.Tensor:
    """Per-token weights of the aggregation ``mode`` from global counts (see the module doc).

    Args:
        mask: per-token 0/1 of tokens that count, any shape.
        seq_index: per-token sequence id (same shape), indexing ``seq_token_counts``.
        mode: one of :data:`LOSS_AGG_MODES`.
        seq_token_counts: response tokens of each sequence, counted over the *whole* sequence
            (every CP shard) — :func:`sequence_token_counts`, all-reduced over CP.
        num_tokens: response tokens in the global batch (all micro-batches and DP ranks).
        num_seqs: sequences with at least one response token in the global batch.

    Returns:
        fp32 weights shaped like ``mask``, zero where ``mask`` is 0. Empty batches (a count of
        zero) give zero weights, never NaN.
    """
    check_loss_agg_mode(mode)
    check_tensor("mask", mask, "mask")
    check_tensor("seq_index", seq_index, "index")
    _same_shape("mask and seq_index", mask, seq_index)
    check_tensor("seq_token_counts", seq_token_counts)
    for name, count in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if not isinstance(count, torch.Tensor) and not _check_number(name, count) >= 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    maskf = _mask_values(mask)
    if mode == "token-mean":
        denom = torch.as_tensor(num_tokens, dtype=torch.float64, device=mask.device).expand_as(maskf)
    else:
        seqs = torch.as_tensor(num_seqs, dtype=torch.float64, device=mask.device)
        if mode == "seq-mean-token-sum":
            denom = seqs.expand_as(maskf)
        else:
            index, in_range = _sequence_index(seq_index, seq_token_counts.shape[0])
            counts = torch.where(in_range, seq_token_counts.to(torch.float64)[index], torch.nan)
            denom = counts.view(seq_index.shape) * seqs
    # A NaN (a bad mask value or sequence id, see above) stays NaN: it must not read as "masked out".
    weights = torch.where(maskf > 0, maskf / denom.clamp(min=1.0), maskf * 0)
    return weights.to(torch.float32)


def aggregate(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ values · weights`` (a scalar; the part of the global aggregate this batch holds)."""
    check_tensor("values", values, "float")
    check_tensor("weights", weights, "float")
    _same_shape("values and weights", values, weights)
    return (values * weights.to(values.dtype)).sum()


def agg_loss(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's ``agg_loss`` for a whole padded batch in one place: ``values``/``mask`` are ``[b, s]``.

    ``token-mean``: masked mean over all tokens. ``seq-mean-token-sum``: mean over sequences of
    the masked token sum. ``seq-mean-token-mean``: mean over sequences of the masked token mean.
    Sequences without a masked-in token are left out of the sequence means.
    """
    check_tensor("values", values, "float")
    check_tensor("mask", mask, "mask")
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(f"values and mask must both be [b, s], got {tuple(values.shape)}, {tuple(mask.shape)}")
    b = values.shape[0]
    seq_index = torch.arange(b, device=values.device).unsqueeze(1).expand_as(mask)
    counts = sequence_token_counts(mask, seq_index, b)
    weights = loss_weights(
        mask, seq_index, mode, seq_token_counts=counts, num_tokens=counts.sum(), num_seqs=(counts > 0).sum()
    )
    return aggregate(values, weights)


def schedule_loss_scale(*, num_microbatches: int, cp_size: int, dp_cp_size: int) -> float:
    """Factor for a micro-batch's loss returned to Megatron's schedule as a 2-tuple.

    Megatron's ``forward_step`` multiplies a 2-tuple loss by ``cp_size`` and divides it by
    ``num_microbatches`` (``schedules.forward_step_calc_loss``), and DDP (or the actor's own
    gradient finalisation) *averages* gradients over the DP×CP group of ``dp_cp_size`` ranks.
    A micro-batch whose part of the global objective is ``J_part = Σ weight · loss`` must
    therefore hand the schedule ``J_part · num_microbatches · dp_cp_size / cp_size`` for the
    gradients to add up to ``∇ Σ_parts J_part``.
    """
    for name, value in (("num_microbatches", num_microbatches), ("cp_size", cp_size), ("dp_cp_size", dp_cp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dp_cp_size % cp_size:
        raise ValueError(f"dp_cp_size={dp_cp_size} must be a multiple of cp_size={cp_size}")
    return num_microbatches * dp_cp_size / cp_size
