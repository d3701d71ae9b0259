"""The actor's distillation option: the teacher's top-k per micro-batch, and the loss.

With ``PPOActorConfig.distill_coeff > 0`` the actor's update adds (or, with
``policy_loss=False``, uses alone) the forward ``KL(teacher ‖ student)`` over the teacher's
top-k ids of every response token (:func:`mcore_ppo.actor.distill_loss.topk_forward_kl`).

The teacher's top-k is *token-aligned* like ``old_log_probs``: row ``j`` of ``ids [T, k]``,
``log_probs [T, k]`` and ``tail_log_mass [T]`` is the teacher's distribution of token ``j``
given the tokens before it (rows off the response are not read). It comes with the rollout, or
from a teacher model through :meth:`~mcore_ppo.actor.MegatronPPOActor.compute_teacher_topk`
(:func:`teacher_topk_forward` per micro-batch: the teacher's final hidden states, then
:func:`mcore_ppo.fused_topk` over its vocab shards).

The student needs one pass of the fused head per micro-batch: its labels become
``[1, t, 1 + k]``, the sampled token first (the PPO log-prob) and the teacher's ids after it
(the head's ``[..., k]`` labels, :func:`mcore_ppo.fused_log_probs_at`), so ``log q`` at the
teacher's ids never needs the ``[tokens, V]`` logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mcore_ppo.actor.batching import MicroBatch
from mcore_ppo.actor.config import PPOActorConfig
from mcore_ppo.actor.distill_loss import topk_forward_kl
from mcore_ppo.actor.layout import ActorParallel, all_reduce, broadcast_from_last_stage
from mcore_ppo.actor.ppo_loss import aggregate, compute_policy_loss, kl_k3
from mcore_ppo.distill import TopK, fused_topk
from mcore_ppo.model import (
    check_supported_config,
    hidden_states_without_postprocess,
    supports_output_processor,
    unwrap_gpt_model,
)
from mcore_ppo.parallel.groups import group_size
from mcore_ppo.validation import check_tensor

__all__ = [
    "DISTILL_METRIC_NAMES",
    "DistillMicroBatch",
    "check_teacher_topk",
    "distill_loss",
    "reduce_distill_metrics",
    "teacher_topk_forward",
    "with_teacher",
]

#: The per-micro-batch metrics of :func:`distill_loss` (the PPO ones, zero for terms that are off,
#: and ``distill_kl``: the token mean of the top-k forward KL).
DISTILL_METRIC_NAMES = (
    "loss",
    "pg_loss",
    "entropy",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "kl_k3",
    "distill_kl",
)


@dataclass
class DistillMicroBatch(MicroBatch):
    """A :class:`MicroBatch` whose ``labels`` are ``[1, t, 1 + k]`` (the sampled token, then the
    teacher's ids; ``ignore_index`` off the response), with the teacher's values at those ids.

    Attributes:
        teacher_log_probs: ``[1, t, k]`` the teacher's ``log p`` at its ids (0 off the response).
        teacher_tail_log_mass: ``[1, t]`` ``log`` of the teacher's mass outside them.
    """

    teacher_log_probs: torch.Tensor | None = None
    teacher_tail_log_mass: torch.Tensor | None = None


def check_teacher_topk(teacher: object, num_tokens: int) -> TopK:
    """``teacher`` is a :class:`~mcore_ppo.distill.TopK` of token-aligned ``[T, k]`` / ``[T]``
    tensors for a rollout of ``num_tokens`` tokens (TypeError / ValueError naming the field)."""
    if not isinstance(teacher, TopK):
        raise TypeError(f"teacher must be a mcore_ppo.distill.TopK, got {type(teacher).__name__}")
    check_tensor("teacher.ids", teacher.ids, "index")
    check_tensor("teacher.log_probs", teacher.log_probs, "float")
    check_tensor("teacher.tail_log_mass", teacher.tail_log_mass, "float")
    if teacher.ids.dim() != 2 or teacher.ids.shape[0] != num_tokens or teacher.ids.shape[1] < 1:
        raise ValueError(
            f"teacher.ids must be [T, k] with T = {num_tokens} (the rollout's tokens), got {tuple(teacher.ids.shape)}"
        )
    if teacher.log_probs.shape != teacher.ids.shape:
        raise ValueError(
            f"teacher.log_probs must be shaped like teacher.ids {tuple(teacher.ids.shape)}, "
            f"got {tuple(teacher.log_probs.shape)}"
        )
    if teacher.tail_log_mass.shape != (num_tokens,):
        raise ValueError(f"teacher.tail_log_mass must be [{num_tokens}], got {tuple(teacher.tail_log_mass.shape)}")
    return teacher


def with_teacher(mb: MicroBatch, teacher: TopK, ignore_index: int) -> DistillMicroBatch:
    """``mb`` with its label positions given the teacher's top-k (``teacher`` token-aligned over
    the rollout, :func:`check_teacher_topk`): ``mb.token_index`` says which token each label
    position predicts, ``mb.loss_mask`` which ones are trained on."""
    device = mb.labels.device
    keep = mb.loss_mask
    index = mb.token_index.clamp(min=0)
    ids = teacher.ids.to(device)[index].long()
    ids = torch.where(keep[..., None], ids, torch.full_like(ids, ignore_index))
    log_probs = torch.where(keep[..., None], teacher.log_probs.to(device)[index], 0.0)
    tail = torch.where(keep, teacher.tail_log_mass.to(device)[index], 0.0)
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
    fields["labels"] = torch.cat([mb.labels[..., None].long(), ids], dim=-1)
    return DistillMicroBatch(**fields, teacher_log_probs=log_probs, teacher_tail_log_mass=tail)


@dataclass(frozen=True)
class _TopKRequest:
    """``output_processor_context`` of the teacher's forward: what :func:`mcore_ppo.fused_topk` takes."""

    k: int
    temperature: float
    labels: torch.Tensor
    ignore_index: int


def _topk_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    context: _TopKRequest,
    config: Any,
    **_unused: Any,
) -> TopK:
    """megatron-core's ``output_processor`` hook of the teacher: :func:`mcore_ppo.fused_topk` of the
    final hidden states (``[s/tp, b, h]`` under SP) over the output layer's vocab shards.

    ``output_weight``: the embedding's weight for tied models, else None (the output layer's).
    The labels come with the context, the model is called without them: with multi-token
    prediction, Megatron's MTP loss (discarded here, no gradient) would count ``ignore_index``.
    """
    check_supported_config(config)
    weight = output_layer.weight if output_weight is None else output_weight
    tp_group = getattr(output_layer, "tp_group", None)
    sequence_parallel = bool(config.sequence_parallel) and group_size(tp_group) > 1
    return fused_topk(
        hidden_states,
        weight,
        context.k,
        temperature=context.temperature,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        labels=context.labels,
        ignore_index=context.ignore_index,
    )


def teacher_topk_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    k: int,
    temperature: float,
    packed_seq_params: Any | None = None,
    ignore_index: int = -100,
) -> TopK | torch.Tensor:
    """A teacher GPT's top-``k`` for ``labels`` ``[1, t]`` (``[b, s]``), on the last pipeline stage.

    :func:`mcore_ppo.fused_topk` takes the top-k of the teacher's final hidden states over the
    output layer's vocab shards (the embedding's weight for tied models), under the model's TP
    group and sequence parallelism; tokens whose label is ``ignore_index`` get
    ``ids = ignore_index``. Models whose ``forward`` takes megatron-core >= 0.18's
    ``output_processor`` hand it the hidden states after their own post-process (final norm,
    multi-token prediction); the others run with ``post_process`` cleared for the call
    (:func:`mcore_ppo.model.hidden_states_without_postprocess`; multi-token prediction raises
    NotImplementedError there). No gradient. Other stages return what the model returns there.
    """
    gpt = unwrap_gpt_model(model)
    if not gpt.post_process:
        return model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
    request = _TopKRequest(k, temperature, labels, ignore_index)
    # The unwrapped model: Float16Module would turn the returned TopK into a plain tuple.
    with torch.no_grad():
        if supports_output_processor(gpt):
            return gpt(
                input_ids,
                position_ids,
                attention_mask,
                packed_seq_params=packed_seq_params,
                output_processor=_topk_processor,
                output_processor_context=request,
            )
        hidden, output_weight = hidden_states_without_postprocess(
            gpt, input_ids, position_ids, attention_mask, {"packed_seq_params": packed_seq_params}
        )
        return _topk_processor(
            hidden_states=hidden,
            output_layer=gpt.output_layer,
            output_weight=output_weight,
            context=request,
            config=gpt.config,
        )


def distill_loss(
    config: PPOActorConfig, loss_scale: float, mb: DistillMicroBatch, output: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron ``loss_func`` of one distillation micro-batch (last stage): ``(scaled loss, metrics)``.

    ``output`` is the head's ``(log_q [1, t, 1 + k], entropy [1, t])`` for ``mb.labels``. Loss:
    ``distill_coeff · KL_topk`` (``distill_kl_mode``), plus the PPO surrogate on ``log_q[..., 0]``
    when ``policy_loss``, minus ``entropy_coeff · entropy``, each aggregated with ``mb.weights``.
    Metrics: :data:`DISTILL_METRIC_NAMES`, this micro-batch's part of their global token means.
    """
    log_q, entropy = output
    sampled, at_teacher = log_q[..., 0], log_q[..., 1:]
    mask = mb.loss_mask
    kl = topk_forward_kl(
        at_teacher,
        mb.teacher_log_probs.to(log_q.dtype),
        mb.teacher_tail_log_mass.to(log_q.dtype),
        mode=config.distill_kl_mode,
        mask=mask,
    )
    distill = aggregate(kl, mb.weights)
    loss = config.distill_coeff * distill
    zero = torch.zeros((), dtype=log_q.dtype, device=log_q.device)
    pg_loss, clipped, dual_clipped, log_ratio = zero, zero, zero, None
    if config.policy_loss:
        terms = compute_policy_loss(
            sampled,
            mb.old_log_probs.to(sampled.dtype),
            mb.advantages.to(sampled.dtype),
            clip_ratio_low=config.low,
            clip_ratio_high=config.high,
            clip_ratio_c=config.clip_ratio_c,
        )
        pg_loss = aggregate(terms.pg_losses, mb.weights)
        loss = loss + pg_loss
        clipped, dual_clipped, log_ratio = terms.clipped, terms.dual_clipped, terms.log_ratio
    if config.entropy_coeff != 0.0:
        loss = loss - config.entropy_coeff * aggregate(entropy, mb.weights)
    with torch.no_grad():
        tw = mb.metric_weights
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "entropy": aggregate(entropy.detach(), tw),
            "pg_clipfrac": aggregate(clipped, tw) if log_ratio is not None else zero,
            "pg_clipfrac_lower": aggregate(dual_clipped, tw) if log_ratio is not None else zero,
            "ppo_kl": zero,
            "kl_k3": zero,
            "distill_kl": aggregate(kl.detach(), tw),
        }
        if mb.old_log_probs is not None:
            old = mb.old_log_probs.to(sampled.dtype)
            metrics["ppo_kl"] = aggregate(torch.where(mask, old - sampled.detach(), 0.0), tw)
            metrics["kl_k3"] = aggregate(kl_k3(old, sampled.detach()), tw)
    return loss * loss_scale, metrics


def reduce_distill_metrics(
    store: list[dict[str, torch.Tensor]], parallel: ActorParallel, *, is_last_stage: bool, device: torch.device
) -> dict[str, float]:
    """:data:`DISTILL_METRIC_NAMES` summed over micro-batches and DP×CP ranks, the same on every stage."""
    sums = torch.zeros(len(DISTILL_METRIC_NAMES), dtype=torch.float64, device=device)
    if is_last_stage:
        for metrics in store:
            sums += torch.stack([metrics[n] for n in DISTILL_METRIC_NAMES]).to(torch.float64)
    all_reduce(sums, parallel.grad_avg)
    broadcast_from_last_stage(sums, parallel.pp)
    return {n: float(v) for n, v in zip(DISTILL_METRIC_NAMES, sums.tolist(), strict=True)}
