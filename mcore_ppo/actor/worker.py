"""The actor's orchestration: :class:`MegatronPPOActor` (batching, the schedule, the log-prob
pass and the policy update). The groups and CP at the head are in :mod:`.layout`, the loss in
:mod:`.loss`, the gradients in :mod:`.grads`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mcore_ppo.actor.batching import MicroBatch, PackedRollout, make_micro_batches, pack_micro_batch, padded_length
from mcore_ppo.actor.config import PPOActorConfig
from mcore_ppo.actor.distill import (
    check_teacher_topk,
    distill_loss,
    reduce_distill_metrics,
    teacher_topk_forward,
    with_teacher,
)
from mcore_ppo.actor.grads import ActorGradients
from mcore_ppo.actor.layout import ActorParallel, all_reduce, broadcast_from_last_stage, cp_split_at_head
from mcore_ppo.actor.loss import assign_loss_weights, policy_loss, reduce_metrics
from mcore_ppo.actor.ppo_loss import schedule_loss_scale
from mcore_ppo.distill import TopK
from mcore_ppo.model import gpt_log_probs_and_entropy, unwrap_gpt_model
from mcore_ppo.parallel.groups import group_size

__all__ = ["MegatronPPOActor"]


def _uses_plain_local_attention(gpt: torch.nn.Module) -> bool:
    """True when the core attention is Megatron's local ``DotProductAttention`` itself, which
    rejects ``PackedSeqParams``: packed batches then go in with a block-diagonal causal mask."""
    return any(type(m) is DotProductAttention for m in gpt.modules())


class MegatronPPOActor:
    """PPO actor over a Megatron GPT with the fused head.

    Args:
        model: a ``GPTModel`` (possibly wrapped in Megatron DDP / ``Float16Module``) whose output
            layer is the fused head on the last stage; one model chunk (no virtual pipeline).
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters (bare model), or a
            Megatron ``MegatronOptimizer`` (which clips by ``config.clip_grad`` itself).
        config: :class:`~mcore_ppo.actor.PPOActorConfig`.
        parallel: the groups (default :meth:`ActorParallel.from_parallel_state`).
        forward_fn: ``(model, input_ids, position_ids, attention_mask, labels, *, temperature,
            packed_seq_params) -> (log_probs, entropy)`` on the last stage (hidden states on
            others); default :func:`mcore_ppo.model.gpt_log_probs_and_entropy` with
            ``return_sum_pi_squared=False``: the loss does not use Σπ², so a head installed with
            it on (``install_fused_head(model, return_sum_pi_squared=True)``, for other callers)
            skips its work here and still returns the pair.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        config: PPOActorConfig,
        *,
        parallel: ActorParallel | None = None,
        forward_fn: Callable[..., Any] | None = None,
    ) -> None:
        if isinstance(model, list | tuple):
            if len(model) != 1:
                raise ValueError("MegatronPPOActor supports one model chunk (no virtual pipeline stages)")
            model = model[0]
        self.model = model
        self.gpt = unwrap_gpt_model(model)
        self.optimizer = optimizer
        self.config = config
        self.parallel = parallel if parallel is not None else ActorParallel.from_parallel_state()
        schedule_cp = parallel_state.get_context_parallel_world_size()
        if self.parallel.schedule_cp_size != schedule_cp:
            # The loss scale and the pipeline's activation shapes both depend on it.
            raise ValueError(
                f"parallel.schedule_cp_size = {self.parallel.schedule_cp_size}, but Megatron's schedule runs "
                f"with parallel_state's CP size {schedule_cp}"
            )
        if forward_fn is None:
            # The actor's loss and metrics read the entropy and never Σπ²: whatever outputs the
            # installed head was built with, its calls here ask for exactly these two.
            forward_fn = partial(gpt_log_probs_and_entropy, return_entropy=True, return_sum_pi_squared=False)
        self.forward_fn = forward_fn
        self.grads = ActorGradients(model, optimizer, self.parallel, config.max_grad_norm)
        mcfg = self.gpt.config
        self.sequence_parallel = bool(mcfg.sequence_parallel) and group_size(self.parallel.tp) > 1
        # Pipeline schedules send activations of one fixed shape unless the config says lengths
        # vary: then every micro-batch is padded to the longest one.
        self.fixed_shape = group_size(self.parallel.pp) > 1 and not getattr(mcfg, "variable_seq_lengths", False)
        cp = self.parallel.cp_size
        # Each sequence is padded so that the CP split (2·cp chunks) and, under SP, the TP
        # sequence shards of every CP-local part are whole (verl/Megatron pack the same way).
        self.align = (2 * cp if cp > 1 else 1) * (group_size(self.parallel.tp) if self.sequence_parallel else 1)
        self.packed_attention = not _uses_plain_local_attention(self.gpt)
        self.is_last_stage = parallel_state.is_pipeline_last_stage()

    @property
    def uses_ddp(self) -> bool:
        """Whether the model is wrapped in Megatron DDP (which then reduces the gradients)."""
        return self.grads.uses_ddp

    @property
    def megatron_optimizer(self) -> bool:
        """Whether the optimizer is Megatron's (which then measures and clips the gradients)."""
        return self.grads.megatron_optimizer

    # -----------------------------------------------------------------------------------------
    # Batching and the schedule

    def micro_batches(self, rollout: PackedRollout) -> list[MicroBatch]:
        """This rank's packed micro-batches of ``rollout`` (whole sequences, in order)."""
        cfg = self.config
        groups = make_micro_batches(
            rollout.seq_lengths,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_micro_batch,
            align=self.align,
        )
        pad_to = None
        if self.fixed_shape:
            pad_to = max(sum(padded_length(n, self.align) for n in (rollout.seq_lengths[i] for i in g)) for g in groups)
        return [
            pack_micro_batch(
                rollout,
                seq_ids,
                align=self.align,
                cp_size=self.parallel.cp_size,
                cp_rank=self.parallel.cp_rank,
                model_cp_size=self.parallel.cp_size if self.parallel.model_runs_cp else 1,
                ignore_index=cfg.ignore_index,
                pad_token_id=cfg.pad_token_id,
                build_attention_mask=not self.packed_attention,
                pad_to=pad_to,
                device=self._device(),
            )
            for seq_ids in groups
        ]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, model: torch.nn.Module, mb: MicroBatch):
        with cp_split_at_head(self.gpt, self.parallel, mb.cu_seqlens_padded, sequence_parallel=self.sequence_parallel):
            return self.forward_fn(
                model,
                mb.input_ids,
                mb.position_ids,
                None if self.packed_attention else mb.attention_mask,
                mb.labels,
                temperature=self.config.temperature,
                packed_seq_params=mb.packed_seq_params if self.packed_attention else None,
            )

    def _run_schedule(
        self,
        mbs: list[MicroBatch],
        loss_fn: Callable[..., Any],
        forward_only: bool,
        *,
        model: torch.nn.Module | None = None,
        forward: Callable[[torch.nn.Module, MicroBatch], Any] | None = None,
    ) -> list[Any]:
        data = iter(mbs)
        forward = self._forward if forward is None else forward

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return forward(model, mb), partial(loss_fn, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.model if model is None else model,
            num_microbatches=len(mbs),
            seq_length=self.parallel.schedule_seq_length(max(mb.input_ids.shape[1] for mb in mbs)),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    # -----------------------------------------------------------------------------------------
    # Log-prob pass

    def compute_log_prob(
        self, rollout: PackedRollout, *, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of the rollout's response tokens under the model.

        Runs under ``no_grad`` with the model in eval mode, micro-batch by micro-batch through
        Megatron's schedule (``forward_only=True``).

        Returns:
            ``(log_probs, entropy)``, fp32 (fp64 for an fp64 model) ``[T]`` aligned with
            ``rollout.tokens`` (entry ``j`` is for token ``j`` given the tokens before it), zero
            off the response; ``entropy`` is None unless ``calculate_entropy``. Every rank of the
            model (all TP, CP and PP ranks) returns the same tensors.
        """
        mbs = self.micro_batches(rollout)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                store = self._run_schedule(mbs, _collect_outputs, forward_only=True)
        finally:
            self.model.train(was_training)
        total = rollout.tokens.shape[0]
        # The head's outputs are fp32 (fp64 for an fp64 model); every stage must agree for the broadcast.
        dtype = torch.float64 if self.gpt.config.params_dtype == torch.float64 else torch.float32
        out = torch.zeros(2 if calculate_entropy else 1, total, dtype=dtype, device=self._device())
        if self.is_last_stage:
            for mb, outputs in zip(mbs, store, strict=True):
                index = mb.token_index.view(-1)
                keep = mb.loss_mask.view(-1)
                out[0, index[keep]] = outputs["log_probs"].view(-1)[keep]
                if calculate_entropy:
                    out[1, index[keep]] = outputs["entropy"].view(-1)[keep]
        # Each response token lives on exactly one CP rank; the last stage has the values.
        all_reduce(out, self.parallel.cp)
        broadcast_from_last_stage(out, self.parallel.pp)
        return out[0], (out[1] if calculate_entropy else None)

    # -----------------------------------------------------------------------------------------
    # The teacher's top-k (distillation)

    def compute_teacher_topk(self, teacher: torch.nn.Module, rollout: PackedRollout, *, k: int | None = None) -> TopK:
        """The teacher's top-``k`` ids, log-probs and tail mass of every response token.

        ``teacher``: a GPT on the same TP/CP/PP layout as the actor's model (e.g. a larger or
        differently trained one of the same vocabulary), possibly wrapped; with CP at the head
        its decoder output is split as the actor's is. It runs under ``no_grad`` in eval mode,
        micro-batch by micro-batch through Megatron's schedule; per micro-batch
        :func:`mcore_ppo.actor.distill.teacher_topk_forward` (its hidden states, then
        :func:`mcore_ppo.fused_topk`), at the actor's temperature.

        Args:
            k: ids per token (default ``config.distill_topk``).

        Returns:
            :class:`~mcore_ppo.distill.TopK`, token-aligned with ``rollout.tokens``: ``ids [T, k]``
            (``ignore_index`` off the response), ``log_probs [T, k]`` and ``tail_log_mass [T]``
            (0 off the response), the same on every rank; what ``update_policy(teacher=)`` takes.
        """
        cfg = self.config
        k = cfg.distill_topk if k is None else k
        teacher_gpt = unwrap_gpt_model(teacher)
        mbs = self.micro_batches(rollout)

        def forward(model: torch.nn.Module, mb: MicroBatch):
            with cp_split_at_head(
                teacher_gpt, self.parallel, mb.cu_seqlens_padded, sequence_parallel=self.sequence_parallel
            ):
                return teacher_topk_forward(
                    model,
                    mb.input_ids,
                    mb.position_ids,
                    None if self.packed_attention else mb.attention_mask,
                    mb.labels,
                    k=k,
                    temperature=cfg.temperature,
                    packed_seq_params=mb.packed_seq_params if self.packed_attention else None,
                    ignore_index=cfg.ignore_index,
                )

        was_training = teacher.training
        teacher.eval()
        try:
            with torch.no_grad():
                store = self._run_schedule(mbs, _collect_topk, forward_only=True, model=teacher, forward=forward)
        finally:
            teacher.train(was_training)
        total = rollout.tokens.shape[0]
        dtype = torch.float64 if teacher_gpt.config.params_dtype == torch.float64 else torch.float32
        device = self._device()
        # ids shifted by one so that 0 means "no value here": the CP sum then adds zeros only.
        ids = torch.zeros(total, k, dtype=torch.int64, device=device)
        values = torch.zeros(total, k + 1, dtype=dtype, device=device)
        if self.is_last_stage:
            for mb, top in zip(mbs, store, strict=True):
                index = mb.token_index.view(-1)
                keep = mb.loss_mask.view(-1)
                rows = index[keep]
                ids[rows] = top["ids"].view(-1, k)[keep] + 1
                values[rows, :k] = top["log_probs"].view(-1, k)[keep].to(dtype)
                values[rows, k] = top["tail_log_mass"].view(-1)[keep].to(dtype)
        # Each response token lives on exactly one CP rank; the last stage has the values.
        for tensor in (ids, values):
            all_reduce(tensor, self.parallel.cp)
            broadcast_from_last_stage(tensor, self.parallel.pp)
        ids = torch.where(ids > 0, ids - 1, cfg.ignore_index)
        return TopK(ids, values[:, :k].contiguous(), values[:, k].contiguous())

    # -----------------------------------------------------------------------------------------
    # Policy update

    def update_policy(self, rollout: PackedRollout, *, teacher: TopK | None = None) -> dict[str, float]:
        """One optimizer step of PPO on ``rollout`` (which needs ``advantages`` and ``old_log_probs``).

        Loss per token: the clipped surrogate (dual-clip when ``clip_ratio_c`` is set) minus
        ``entropy_coeff`` × entropy, aggregated by ``loss_agg_mode`` over the *global* batch;
        gradients through Megatron's schedule, then reduced, clipped to ``max_grad_norm`` and
        applied.

        With distillation (``config.distill_coeff > 0``), ``teacher`` is the teacher's top-k of
        every response token, token-aligned (:meth:`compute_teacher_topk`, or computed elsewhere
        and passed with the rollout), and the loss adds ``distill_coeff`` × the forward
        ``KL(teacher ‖ student)`` over those ids (``config.distill_kl_mode``), aggregated like
        the PPO loss; one fused-head pass gives the sampled token's log-prob and the student's
        log-probs at the teacher's ids (:mod:`mcore_ppo.actor.distill`). With
        ``policy_loss=False`` the PPO terms are dropped and the rollout needs no advantages or
        old log-probs.

        Returns:
            Metrics, identical on every rank: ``loss``, ``pg_loss``, ``entropy`` (token mean),
            ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual-clip), ``ppo_kl`` (token mean of
            ``old - new`` log-prob, verl's), ``kl_k3`` (token mean of the k3 estimate of
            KL(old‖new) over the old policy's samples), ``grad_norm`` (before clipping),
            ``num_tokens``, ``num_seqs``, ``update_successful``; with distillation also
            ``distill_kl`` (token mean of the top-k forward KL; the PPO ones are 0 for terms
            that are off).
        """
        cfg = self.config
        if cfg.policy_loss and (rollout.advantages is None or rollout.old_log_probs is None):
            raise ValueError("update_policy needs rollout.advantages and rollout.old_log_probs")
        if cfg.distill and teacher is None:
            raise ValueError(
                "config.distill_coeff > 0: update_policy needs teacher= (the teacher's top-k, compute_teacher_topk)"
            )
        if not cfg.distill and teacher is not None:
            raise ValueError("teacher= is given but config.distill_coeff is 0: set distill_coeff to train on it")
        mbs = self.micro_batches(rollout)
        if teacher is not None:
            teacher = check_teacher_topk(teacher, rollout.tokens.shape[0])
            mbs = [with_teacher(mb, teacher, cfg.ignore_index) for mb in mbs]
        num_tokens, num_seqs = assign_loss_weights(mbs, self.parallel, self.config.loss_agg_mode)
        loss_scale = schedule_loss_scale(
            num_microbatches=len(mbs),
            cp_size=self.parallel.schedule_cp_size,
            dp_cp_size=group_size(self.parallel.grad_avg),
        )
        self.model.train()
        self.grads.zero()
        loss_fn, reduce = policy_loss, reduce_metrics
        if teacher is not None:
            loss_fn, reduce = distill_loss, reduce_distill_metrics
        store = self._run_schedule(mbs, partial(loss_fn, self.config, loss_scale), forward_only=False)
        self.grads.finalize()
        update_successful, grad_norm = self.grads.step()

        result = reduce(store, self.parallel, is_last_stage=self.is_last_stage, device=self._device())
        result.update(
            grad_norm=float(grad_norm),
            num_tokens=float(num_tokens),
            num_seqs=float(num_seqs),
            update_successful=float(update_successful),
        )
        return result


def _collect_outputs(mb: MicroBatch, output: tuple[torch.Tensor, torch.Tensor]):
    """Megatron ``loss_func`` of the log-prob pass: no loss, the outputs kept for the caller."""
    log_probs, entropy = output
    return torch.zeros((), device=log_probs.device), {"log_probs": log_probs.detach(), "entropy": entropy.detach()}


def _collect_topk(mb: MicroBatch, output):
    """Megatron ``loss_func`` of the teacher's pass: no loss, its top-k kept for the caller."""
    return torch.zeros((), device=output.ids.device), output._asdict()
