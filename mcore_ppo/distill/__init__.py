"""Distillation from a teacher over the tensor-parallel vocab shards.

:func:`fused_topk` (no gradient) gives, per token, the teacher's top-k global ids, their
log-probs and the log of the mass outside them, without the ``[tokens, V]`` logits. The losses
that consume them are pure tensor functions in :mod:`mcore_ppo.actor.distill_loss`.
:func:`mcore_ppo.fused_log_probs_at` (with gradients) gives the student's log-probs at those
ids: the head itself, :func:`mcore_ppo.fused_log_probs_and_entropy` with ``[..., k]`` labels.
"""

from mcore_ppo.distill.topk import MAX_TOPK, TopK, TopKConfig, check_k, fused_topk

__all__ = ["MAX_TOPK", "TopK", "TopKConfig", "check_k", "fused_topk"]
