"""A Megatron PPO actor worker: log-prob pass and clipped-surrogate policy update over micro-batches.

The actor runs a Megatron ``GPTModel`` whose output layer is the fused head
(:func:`mcore_ppo.model.install_fused_head`) through Megatron's own forward-backward schedule
(``get_forward_backward_func()``), on packed THD micro-batches built from a
:class:`~mcore_ppo.batching.PackedRollout`. It follows verl's Megatron actor
(``compute_log_prob`` / ``update_policy``), with three differences that make the numbers the
same under every TP/CP/DP layout and micro-batch split:

- Loss aggregation uses *global* counts (response tokens / sequences over every micro-batch,
  DP rank and CP shard, one all-reduce each) and returns to the schedule the factor that
  undoes its ``× cp / num_microbatches`` and the DP×CP gradient averaging
  (:mod:`mcore_ppo.ppo_loss`).
- Labels are rolled on the global sequence before the CP split
  (:func:`parallel.roll_and_split_labels`), never after.
- Context parallelism at the head: where the model itself cannot run CP (Megatron's
  ``GPTModel`` needs TransformerEngine attention for CP > 1), :meth:`ActorParallel.cp_at_head`
  lets Megatron's data-parallel ranks act as the CP ranks: every CP rank runs the whole
  sequence through the decoder, and the decoder's final hidden states are split exactly as
  Megatron splits a CP batch before they reach the head and the loss. Everything from the head
  on (labels, head, loss, counts, gradient reduction) is then what a CP run does; the decoder
  compute is replicated instead of split.

Gradients: a model wrapped in Megatron DDP reduces them itself (``finalize_model_grads``); a bare
model gets the same reductions from the actor (SP-replicated parameters summed over TP, tied
embeddings over the embedding group, then the average over DP×CP), so CPU runs and tests need
no DDP.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import param_is_not_shared

from mcore_ppo.batching import MicroBatch, PackedRollout, make_micro_batches, pack_micro_batch, padded_length
from mcore_ppo.model import gpt_log_probs_and_entropy, unwrap_gpt_model
from mcore_ppo.ppo_loss import (
    aggregate,
    check_loss_agg_mode,
    compute_policy_loss,
    kl_k3,
    loss_weights,
    schedule_loss_scale,
    sequence_token_counts,
)
from parallel.context_parallel import split_for_cp
from parallel.groups import ProcessGroup, group_rank, group_size

__all__ = ["ActorParallel", "MegatronPPOActor", "PPOActorConfig"]


@dataclass
class PPOActorConfig:
    """Options of :class:`MegatronPPOActor` (names as in verl's actor config).

    Attributes:
        clip_ratio: PPO clip ``ε`` (both sides unless overridden below).
        clip_ratio_low, clip_ratio_high: asymmetric clip (ratio in ``[1 - low, 1 + high]``);
            None = ``clip_ratio``.
        clip_ratio_c: dual-clip constant (> 1) bounding the loss of negative-advantage tokens;
            None = off.
        entropy_coeff: weight of the entropy bonus (``loss = pg_loss - entropy_coeff · entropy``).
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-sum"`` or ``"seq-mean-token-mean"``.
        max_grad_norm: clip the global gradient norm to this (None = no clipping; the norm is
            still reported).
        temperature: sampling temperature the log-probs are taken at.
        micro_batch_size: sequences per micro-batch (exclusive with ``max_tokens_per_micro_batch``).
        max_tokens_per_micro_batch: padded-token budget per micro-batch (dynamic batch size).
        ignore_index: label value of positions not trained on.
        pad_token_id: token id used to pad sequences to the packing alignment.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    micro_batch_size: int | None = 4
    max_tokens_per_micro_batch: int | None = None
    ignore_index: int = -100
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        check_loss_agg_mode(self.loss_agg_mode)
        if not 0.0 <= self.low < 1.0 or self.high < 0.0:
            raise ValueError(
                f"clip ratios must satisfy 0 <= low < 1 and high >= 0, got low={self.low}, high={self.high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 or None, got {self.clip_ratio_c}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if self.max_tokens_per_micro_batch is not None:
            self.micro_batch_size = None
        if (self.micro_batch_size is None) == (self.max_tokens_per_micro_batch is None):
            raise ValueError("give exactly one of micro_batch_size and max_tokens_per_micro_batch")

    @property
    def low(self) -> float:
        """Effective lower clip."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(frozen=True)
class ActorParallel:
    """The process groups the actor uses, and whether the model itself runs CP.

    Attributes:
        tp: tensor-parallel group (the model's).
        cp: context-parallel group: ranks holding shards of the same sequences.
        dp: data-parallel group: ranks holding different sequences (CP excluded).
        grad_avg: DP×CP group over which gradients are averaged (Megatron DDP's group).
        pp: pipeline group.
        model_runs_cp: True when the model's inputs are CP-split (TransformerEngine attention);
            False when CP is applied at the head (the decoder sees whole sequences).
        schedule_cp_size: the CP size Megatron's schedule multiplies a 2-tuple loss by.
    """

    tp: ProcessGroup | None
    cp: ProcessGroup | None
    dp: ProcessGroup | None
    grad_avg: ProcessGroup | None
    pp: ProcessGroup | None
    model_runs_cp: bool
    schedule_cp_size: int = field(default=1)

    @classmethod
    def from_parallel_state(cls) -> ActorParallel:
        """Megatron's layout as initialised: CP (if any) runs inside the model."""
        cp = parallel_state.get_context_parallel_group()
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=cp,
            dp=parallel_state.get_data_parallel_group(),
            grad_avg=parallel_state.get_data_parallel_group(with_context_parallel=True),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            model_runs_cp=group_size(cp) > 1,
            schedule_cp_size=group_size(cp),
        )

    @classmethod
    def cp_at_head(cls, *, cp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None) -> ActorParallel:
        """CP applied at the head, for models that cannot run CP (no TransformerEngine).

        Initialise Megatron with ``context_parallel_size=1``: its data-parallel ranks are then
        the CP ranks (and any real DP ranks) of the intended layout — with Megatron's rank order,
        TP × DP' with DP' = cp·dp is the same rank grid as TP × CP × DP. The CP ranks hold the
        *same* sequences, the model sees them whole, and the actor splits the decoder's output
        for CP before the head. Gradients are averaged over Megatron's DP group (= DP×CP).

        Args:
            cp_group: the CP ranks inside Megatron's DP group (default: all of it).
            dp_group: the real data-parallel ranks (default: none).
        """
        if parallel_state.get_context_parallel_world_size() != 1:
            raise ValueError("cp_at_head needs Megatron initialised with context_parallel_size=1")
        dp_cp = parallel_state.get_data_parallel_group()
        cp = cp_group if cp_group is not None else dp_cp
        if group_size(cp) * group_size(dp_group) != group_size(dp_cp):
            raise ValueError(
                f"cp_group ({group_size(cp)} ranks) × dp_group ({group_size(dp_group)} ranks) must make up "
                f"Megatron's data-parallel group ({group_size(dp_cp)} ranks)"
            )
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=cp,
            dp=dp_group,
            grad_avg=dp_cp,
            pp=parallel_state.get_pipeline_model_parallel_group(),
            model_runs_cp=False,
            schedule_cp_size=1,
        )

    @property
    def cp_size(self) -> int:
        """Number of CP ranks."""
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        """This rank's place in the CP group."""
        return group_rank(self.cp)


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _is_megatron_optimizer(optimizer: Any) -> bool:
    """A Megatron-Core optimizer (its ``step()`` clips and returns the grad norm). By class, not by
    attribute: megatron-core 0.19's ``ChainedOptimizer`` lacks methods its 0.16 version has."""
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


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
        config: :class:`PPOActorConfig`.
        parallel: the groups (default :meth:`ActorParallel.from_parallel_state`).
        forward_fn: ``(model, input_ids, position_ids, attention_mask, labels, *, temperature,
            packed_seq_params) -> (log_probs, entropy)`` on the last stage (hidden states on
            others); default :func:`mcore_ppo.model.gpt_log_probs_and_entropy`.
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
        self.forward_fn = forward_fn if forward_fn is not None else gpt_log_probs_and_entropy
        self.uses_ddp = hasattr(model, "finish_grad_sync")
        self.megatron_optimizer = _is_megatron_optimizer(optimizer)
        if self.uses_ddp and not self.megatron_optimizer:
            raise TypeError("a model wrapped in Megatron DDP needs a Megatron optimizer (grads live in main_grad)")
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

    # -----------------------------------------------------------------------------------------
    # Batching

    def micro_batches(self, rollout: PackedRollout) -> list[MicroBatch]:
        """This rank's packed micro-batches of ``rollout`` (whole sequences, in order)."""
        cfg = self.config
        groups = make_micro_batches(
            rollout.seq_lengths,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_micro_batch,
            align=self.align,
        )
        device = self._device()
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
                device=device,
            )
            for seq_ids in groups
        ]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -----------------------------------------------------------------------------------------
    # Forward of one micro-batch

    @contextlib.contextmanager
    def _cp_split_at_head(self, mb: MicroBatch) -> Iterator[None]:
        """CP at the head: split the decoder's final hidden states as Megatron splits a CP batch."""
        if self.parallel.model_runs_cp or self.parallel.cp_size == 1 or not self.gpt.post_process:
            yield
            return
        tp, cp, cp_rank, sp = self.parallel.tp, self.parallel.cp_size, self.parallel.cp_rank, self.sequence_parallel

        def split_hidden(_module, _args, output):
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"CP at the head expects the decoder to return a tensor, got {type(output).__name__}")
            hidden = output
            if sp:
                # SP shards of the whole sequence -> whole sequence. The gradient coming back is
                # already TP-complete and identical on every TP rank (the SP scatter below
                # all-gathers it), so this gather's backward only splits (no sum).
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp)
            hidden = split_for_cp(hidden, cp, cp_rank, seq_dim=0, cu_seqlens=mb.cu_seqlens_padded)
            if sp:
                hidden = scatter_to_sequence_parallel_region(hidden, group=tp)
            return hidden

        handle = self.gpt.decoder.register_forward_hook(split_hidden)
        try:
            yield
        finally:
            handle.remove()

    def _forward(self, model: torch.nn.Module, mb: MicroBatch):
        with self._cp_split_at_head(mb):
            return self.forward_fn(
                model,
                mb.input_ids,
                mb.position_ids,
                None if self.packed_attention else mb.attention_mask,
                mb.labels,
                temperature=self.config.temperature,
                packed_seq_params=mb.packed_seq_params if self.packed_attention else None,
            )

    def _run_schedule(self, mbs: list[MicroBatch], loss_fn: Callable[..., Any], forward_only: bool) -> list[Any]:
        data = iter(mbs)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_fn, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.model,
            num_microbatches=len(mbs),
            seq_length=max(mb.input_ids.shape[1] for mb in mbs),
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
            ``(log_probs, entropy)``, fp32 (fp64 for an fp64 model) ``[T]`` aligned with ``rollout.tokens`` (entry ``j``
            is for token ``j`` given the tokens before it), zero off the response; ``entropy``
            is None unless ``calculate_entropy``. Every rank of the model (all TP, CP and PP
            ranks) returns the same tensors.
        """
        mbs = self.micro_batches(rollout)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                store = self._run_schedule(mbs, self._collect_outputs, forward_only=True)
        finally:
            self.model.train(was_training)
        total = rollout.tokens.shape[0]
        device = self._device()
        # The head's outputs are fp32 (fp64 for an fp64 model); every stage must agree for the broadcast.
        dtype = torch.float64 if self.gpt.config.params_dtype == torch.float64 else torch.float32
        out = torch.zeros(2 if calculate_entropy else 1, total, dtype=dtype, device=device)
        if self.is_last_stage:
            for mb, outputs in zip(mbs, store, strict=True):
                index = mb.token_index.view(-1)
                keep = mb.loss_mask.view(-1)
                out[0, index[keep]] = outputs["log_probs"].view(-1)[keep]
                if calculate_entropy:
                    out[1, index[keep]] = outputs["entropy"].view(-1)[keep]
        # Each response token lives on exactly one CP rank; the last stage has the values.
        _all_reduce(out, self.parallel.cp)
        self._broadcast_from_last_stage(out)
        return out[0], (out[1] if calculate_entropy else None)

    @staticmethod
    def _collect_outputs(mb: MicroBatch, output: tuple[torch.Tensor, torch.Tensor]):
        log_probs, entropy = output
        return torch.zeros((), device=log_probs.device), {"log_probs": log_probs.detach(), "entropy": entropy.detach()}

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        pp = self.parallel.pp
        if group_size(pp) > 1:
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=pp)

    # -----------------------------------------------------------------------------------------
    # Policy update

    def update_policy(self, rollout: PackedRollout) -> dict[str, float]:
        """One optimizer step of PPO on ``rollout`` (which needs ``advantages`` and ``old_log_probs``).

        Loss per token: the clipped surrogate (dual-clip when ``clip_ratio_c`` is set) minus
        ``entropy_coeff`` × entropy, aggregated by ``loss_agg_mode`` over the *global* batch;
        gradients through Megatron's schedule, then reduced, clipped to ``max_grad_norm`` and
        applied.

        Returns:
            Metrics, identical on every rank: ``loss``, ``pg_loss``, ``entropy`` (token mean),
            ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual-clip), ``ppo_kl`` (token mean of
            ``old - new`` log-prob, verl's), ``kl_k3`` (token mean of the k3 estimate of
            KL(old‖new) over the old policy's samples), ``grad_norm`` (before clipping), ``num_tokens``, ``num_seqs``,
            ``update_successful``.
        """
        if rollout.advantages is None or rollout.old_log_probs is None:
            raise ValueError("update_policy needs rollout.advantages and rollout.old_log_probs")
        mbs = self.micro_batches(rollout)
        num_tokens, num_seqs = self._assign_weights(mbs)
        self._loss_scale = schedule_loss_scale(
            num_microbatches=len(mbs),
            cp_size=self.parallel.schedule_cp_size,
            dp_cp_size=group_size(self.parallel.grad_avg),
        )
        self.model.train()
        self._zero_grad()
        store = self._run_schedule(mbs, self._policy_loss, forward_only=False)
        self._finalize_grads()
        update_successful, grad_norm = self._step()

        names = ("loss", "pg_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_k3")
        sums = torch.zeros(len(names), dtype=torch.float64, device=self._device())
        if self.is_last_stage:
            for metrics in store:
                sums += torch.stack([metrics[n] for n in names]).to(torch.float64)
        _all_reduce(sums, self.parallel.grad_avg)
        self._broadcast_from_last_stage(sums)
        result = {n: float(v) for n, v in zip(names, sums.tolist(), strict=True)}
        result.update(
            grad_norm=float(grad_norm),
            num_tokens=float(num_tokens),
            num_seqs=float(num_seqs),
            update_successful=float(update_successful),
        )
        return result

    def _assign_weights(self, mbs: list[MicroBatch]) -> tuple[float, float]:
        """Per-token loss weights from global counts (one all-reduce over CP, one over DP)."""
        counts = [sequence_token_counts(mb.loss_mask, mb.seq_index, len(mb.seq_ids)) for mb in mbs]
        flat = _all_reduce(torch.cat(counts), self.parallel.cp)  # each sequence summed over its CP shards
        totals = _all_reduce(torch.stack([flat.sum(), (flat > 0).sum().to(torch.float64)]), self.parallel.dp)
        num_tokens, num_seqs = float(totals[0]), float(totals[1])
        offset = 0
        for mb, c in zip(mbs, counts, strict=True):
            seq_counts = flat[offset : offset + c.numel()]
            offset += c.numel()
            mb.weights = loss_weights(
                mb.loss_mask,
                mb.seq_index,
                self.config.loss_agg_mode,
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

    def _policy_loss(self, mb: MicroBatch, output: tuple[torch.Tensor, torch.Tensor]):
        """Megatron ``loss_func``: ``(scaled loss, metrics)`` for one micro-batch (last stage)."""
        cfg = self.config
        log_probs, entropy = output
        terms = compute_policy_loss(
            log_probs,
            mb.old_log_probs.to(log_probs.dtype),
            mb.advantages.to(log_probs.dtype),
            clip_ratio_low=cfg.low,
            clip_ratio_high=cfg.high,
            clip_ratio_c=cfg.clip_ratio_c,
        )
        pg_loss = aggregate(terms.pg_losses, mb.weights)
        loss = pg_loss
        entropy_agg = None
        if cfg.entropy_coeff != 0.0:
            entropy_agg = aggregate(entropy, mb.weights)
            loss = pg_loss - cfg.entropy_coeff * entropy_agg
        with torch.no_grad():
            tw = mb.metric_weights
            metrics = {
                "loss": loss.detach(),
                "pg_loss": pg_loss.detach(),
                "entropy": aggregate(entropy.detach(), tw),
                "pg_clipfrac": aggregate(terms.clipped, tw),
                "pg_clipfrac_lower": aggregate(terms.dual_clipped, tw),
                "ppo_kl": aggregate(-terms.log_ratio.detach(), tw),
                "kl_k3": aggregate(kl_k3(mb.old_log_probs.to(log_probs.dtype), log_probs.detach()), tw),
            }
        return loss * self._loss_scale, metrics

    # -----------------------------------------------------------------------------------------
    # Gradients and the step

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _zero_grad(self) -> None:
        if self.uses_ddp:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if not self.uses_ddp:
            for p in self._params():
                p.grad = None

    def _finalize_grads(self) -> None:
        """The reductions Megatron DDP's ``finalize_model_grads`` would do, for a bare model."""
        if self.uses_ddp:
            if self.gpt.config.finalize_model_grads_func is None:
                from megatron.core.distributed import finalize_model_grads

                finalize_model_grads([self.model])
            return
        params = self._params()
        for p in params:
            if p.grad is None:  # e.g. no response token reached this rank: still take part below
                p.grad = torch.zeros_like(p)
        if self.sequence_parallel:
            sp_params = [p for p in params if getattr(p, "sequence_parallel", False)]
            self._all_reduce_grads(sp_params, self.parallel.tp, average=False)
        if (
            group_size(self.parallel.pp) > 1
            and self.gpt.share_embeddings_and_output_weights
            and parallel_state.is_rank_in_embedding_group()
        ):
            weight = self.gpt.shared_embedding_or_output_weight()
            _all_reduce(weight.grad, parallel_state.get_embedding_group())
        self._all_reduce_grads(params, self.parallel.grad_avg, average=True)

    @staticmethod
    def _all_reduce_grads(params: list[torch.nn.Parameter], group: ProcessGroup | None, *, average: bool) -> None:
        size = group_size(group)
        if size == 1 or not params:
            return
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _step(self) -> tuple[bool, float]:
        if self.megatron_optimizer:
            update_successful, grad_norm, _ = self.optimizer.step()
            return bool(update_successful), float(grad_norm if grad_norm is not None else float("nan"))
        grad_norm = self._grad_norm()
        max_norm = self.config.max_grad_norm
        if max_norm is not None and math.isfinite(grad_norm):
            coeff = max_norm / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for p in self._params():
                    p.grad.mul_(coeff)
        if not math.isfinite(grad_norm):
            return False, grad_norm  # skip the step, as Megatron's optimizer does
        self.optimizer.step()
        return True, grad_norm

    def _grad_norm(self) -> float:
        """Global L2 norm of the gradients: each TP shard and pipeline stage counted once."""
        tp = self.parallel.tp
        squares = torch.zeros((), dtype=torch.float64, device=self._device())
        for p in self._params():
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group=tp):
                squares += p.grad.detach().to(torch.float64).pow(2).sum()
        _all_reduce(squares, parallel_state.get_model_parallel_group())
        return float(squares.sqrt())
