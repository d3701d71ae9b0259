"""The actor's loss over micro-batches: per-token weights from global counts, the Megatron
``loss_func`` of one micro-batch, and the metrics summed over micro-batches and ranks.

The aggregation modes and the schedule's scaling are explained in :mod:`mcore_ppo.actor.ppo_loss`
and ``docs/actor.md``: each micro-batch hands the schedule ``Σ weight · loss`` times
:func:`~mcore_ppo.actor.ppo_loss.schedule_loss_scale`, so the gradients add up to the global objective
under every micro-batch split and TP/CP/DP layout.
"""

from __future__ import annotations

import torch

from mcore_ppo.actor.batching import MicroBatch
from mcore_ppo.actor.config import PPOActorConfig
from mcore_ppo.actor.layout import ActorParallel, all_reduce, broadcast_from_last_stage
from mcore_ppo.actor.ppo_loss import aggregate, compute_policy_loss, kl_k3, loss_weights, sequence_token_counts

__all__ = ["METRIC_NAMES", "assign_loss_weights", "policy_loss", "reduce_metrics"]

# The per-micro-batch metrics of :func:`policy_loss`, summed by :func:`reduce_metrics`.
METRIC_NAMES = ("loss", "pg_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_k3")


def assign_loss_weights(mbs: list[MicroBatch], parallel: ActorParallel, loss_agg_mode: str) -> tuple[float, float]:
    """Set each micro-batch's ``weights`` (``loss_agg_mode``) and ``metric_weights`` (token-mean).

    Counts are global: one all-reduce over CP (a sequence's tokens are spread over the CP ranks),
    one over DP. Returns ``(num_tokens, num_seqs)`` of the global batch.
    """
    counts = [sequence_token_counts(mb.loss_mask, mb.seq_index, len(mb.seq_ids)) for mb in mbs]
    flat = all_reduce(torch.cat(counts), parallel.cp)  # each sequence summed over its CP shards
    totals = all_reduce(torch.stack([flat.sum(), (flat > 0).sum().to(torch.float64)]), parallel.dp)
    num_tokens, num_seqs = float(totals[0]), float(totals[1])
    offset = 0
    for mb, c in zip(mbs, counts, strict=True):
        seq_counts = flat[offset : offset + c.numel()]
        offset += c.numel()
        mb.weights = loss_weights(
            mb.loss_mask,
            mb.seq_index,
            loss_agg_mode,
            seq_token_counts=seq_counts,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        mb.metric_weights = loss_weights(
            mb.loss_mask,
            mb.seq_index,
            "token-mean",
            seq_token_counts=seq_counts,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
    return num_tokens, num_seqs


def policy_loss(
    config: PPOActorConfig, loss_scale: float, mb: MicroBatch, output: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron ``loss_func`` of one micro-batch (last stage): ``(scaled loss, metrics)``.

    The loss is the clipped surrogate (dual-clip when ``clip_ratio_c`` is set) minus
    ``entropy_coeff`` × entropy, weighted by ``mb.weights``; the metrics (:data:`METRIC_NAMES`)
    are this micro-batch's part of their global token means.
    """
    log_probs, entropy = output
    old_log_probs = mb.old_log_probs.to(log_probs.dtype)
    terms = compute_policy_loss(
        log_probs,
        old_log_probs,
        mb.advantages.to(log_probs.dtype),
        clip_ratio_low=config.low,
        clip_ratio_high=config.high,
        clip_ratio_c=config.clip_ratio_c,
    )
    pg_loss = aggregate(terms.pg_losses, mb.weights)
    loss = pg_loss
    if config.entropy_coeff != 0.0:
        loss = pg_loss - config.entropy_coeff * aggregate(entropy, mb.weights)
    with torch.no_grad():
        tw = mb.metric_weights
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "entropy": aggregate(entropy.detach(), tw),
            "pg_clipfrac": aggregate(terms.clipped, tw),
            "pg_clipfrac_lower": aggregate(terms.dual_clipped, tw),
            "ppo_kl": aggregate(-terms.log_ratio.detach(), tw),
            "kl_k3": aggregate(kl_k3(old_log_probs, log_probs.detach()), tw),
        }
    return loss * loss_scale, metrics


def reduce_metrics(
    store: list[dict[str, torch.Tensor]], parallel: ActorParallel, *, is_last_stage: bool, device: torch.device
) -> dict[str, float]:
    """The schedule's per-micro-batch metrics summed over micro-batches and DP×CP ranks, the same
    on every pipeline stage."""
    sums = torch.zeros(len(METRIC_NAMES), dtype=torch.float64, device=device)
    if is_last_stage:
        for metrics in store:
            sums += torch.stack([metrics[n] for n in METRIC_NAMES]).to(torch.float64)
    all_reduce(sums, parallel.grad_avg)
    broadcast_from_last_stage(sums, parallel.pp)
    return {n: float(v) for n, v in zip(METRIC_NAMES, sums.tolist(), strict=True)}
