"""The distillation demo (``scripts/launch.sh --config configs/distill_demo.yaml``), and its verdict.

:func:`run_distill_demo` runs under torchrun when the config turns distillation on
(``ppo.distill_coeff > 0``; :func:`mcore_ppo_testing.ppo_demo.run_demo` hands over). Three models
of the config's shape on the config's layout: the *student* (the actor, fused head), a *teacher*
(seed + 1), and a second student from the student's seed whose ``forward_fn`` is the full-logits
path (:class:`LogitsPathTopK`: the model's logits gathered over TP, fp64 ``log_softmax``, gathered
at the ids). Every step, on a fresh synthetic rollout:

- the teacher's top-k (:meth:`~mcore_ppo.actor.MegatronPPOActor.compute_teacher_topk`, i.e.
  ``fused_topk``) against the teacher's fp64 full logits: log-probs at the ids, tails, and the k
  largest values (the *teacher line*);
- ``ppo_epochs`` updates of both students with the same rollout and teacher top-k (update lines);
- the *parity line*: the student's distillation loss (its first update's ``distill_kl``, taken
  before the step) against the same KL from the student's fp64 full logits, and the fused student
  against the logits-path student (``loss``, relative ``grad_norm``).

After the steps, every parameter of the two students is compared: equal parameters after the
updates mean equal gradients (of the distillation loss, and of the PPO terms when on). The last
line is ``PASS: ...`` or ``FAIL: ...``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from mcore_ppo.actor import ActorParallel, MegatronPPOActor
from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo.actor.distill_loss import topk_forward_kl
from mcore_ppo.actor.layout import broadcast_from_last_stage
from mcore_ppo.distill import TopK
from mcore_ppo.model import unwrap_gpt_model
from mcore_ppo_testing.demo_config import DemoConfig
from mcore_ppo_testing.ppo_harness import (
    build_actor_model,
    destroy_layout,
    full_log_softmax,
    full_parameters,
    init_distributed,
    init_layout,
    synthetic_rollout,
    te_available,
)

__all__ = ["LogitsPathTopK", "full_log_probs", "run_distill_demo"]


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _from_last_stage(value: float, parallel: ActorParallel, device: torch.device) -> float:
    """The last pipeline stage's ``value``, on every stage."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    broadcast_from_last_stage(t, parallel.pp)
    return float(t)


class LogitsPathTopK:
    """``forward_fn`` of :class:`~mcore_ppo.actor.MegatronPPOActor` through full logits, for
    labels with k ids per token (``[1, t, k]``) as well as plain ``[1, t]``.

    The model's vocab-parallel logits are all-gathered over TP (Megatron's
    ``gather_from_tensor_model_parallel_region``, whose backward keeps this rank's shard), divided
    by the temperature, ``log_softmax`` in fp64, gathered at the ids (0 where ignored); the
    entropy per token. Returned in fp32 (fp64 for an fp64 model), as the fused head returns them.
    """

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        packed_seq_params: Any | None = None,
    ) -> Any:
        gpt = unwrap_gpt_model(model)
        logits = model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        if not gpt.post_process:
            return logits
        full = gather_from_tensor_model_parallel_region(logits)
        log_p = torch.log_softmax(full.to(torch.float64) / temperature, dim=-1)
        plain = labels.dim() == 2
        ids = labels[..., None] if plain else labels
        ignored = ids < 0
        picked = log_p.gather(-1, ids.clamp(min=0).long()).masked_fill(ignored, 0.0)
        entropy = torch.where(ignored.all(-1), 0.0, -(log_p.exp() * log_p).sum(-1))
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return (picked[..., 0] if plain else picked).to(dtype), entropy.to(dtype)


def full_log_probs(
    model: torch.nn.Module, rollout: PackedRollout, parallel: ActorParallel, *, temperature: float, align: int
) -> torch.Tensor | None:
    """fp64 ``log_softmax(logits / T)`` ``[T, V]`` of every response token (token-aligned, zero
    rows elsewhere), from the model's full logits gathered over TP; None off the last stage."""
    full = full_log_softmax(model, rollout, parallel, temperature=temperature, align=align)
    if full is None:
        return None
    log_softmax, mb, model_cp = full
    log_p = log_softmax.view(-1, log_softmax.shape[-1])
    out = torch.zeros(rollout.tokens.shape[0], log_p.shape[-1], dtype=torch.float64, device=log_p.device)
    index, keep = mb.token_index.view(-1), mb.loss_mask.view(-1)
    out[index[keep]] = log_p[keep]
    if model_cp > 1:
        dist.all_reduce(out, group=parallel.cp)
    return out


def teacher_parity(top: TopK, full: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """``max|Δ|`` of the top-k's log-probs at its ids, of its tails and of its k values sorted,
    against the teacher's fp64 full log-probs, over the response tokens."""
    ids = top.ids[mask]
    rows = full[mask]
    d_lp = float((top.log_probs[mask].double() - rows.gather(-1, ids)).abs().max())
    rest = rows.scatter(-1, ids, -torch.inf)
    tail = torch.logsumexp(rest, dim=-1)
    finite = torch.isfinite(tail)
    d_tail = float((top.tail_log_mass[mask].double() - tail)[finite].abs().max()) if bool(finite.any()) else 0.0
    d_values = float((top.log_probs[mask].double() - rows.topk(ids.shape[-1], dim=-1).values).abs().max())
    return d_lp, d_tail, d_values


def _build(config: DemoConfig, parallel: ActorParallel, seed: int, forward_fn=None) -> MegatronPPOActor:
    model = build_actor_model(
        config.model.shape(),
        sequence_parallel=config.layout.sp,
        temperature=config.head.temperature,
        backend=config.head.backend,
        buffer_budget_bytes=config.head.buffer_budget_bytes,
        params_dtype=config.model.dtype,
        seed=seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.ppo.lr, weight_decay=0.0)
    return MegatronPPOActor(model, optimizer, config.ppo.actor, parallel=parallel, forward_fn=forward_fn)


def run_distill_demo(config: DemoConfig) -> int:
    """Run the distillation demo (inside torchrun); returns the exit status (0 = PASS)."""
    from mcore_ppo_testing.ppo_demo import layout_name

    device = init_distributed()
    layout, cfg, tol = config.layout, config.ppo.actor, config.run.tolerance
    parallel = init_layout(layout.tp, layout.cp, layout.pp, cp_at_head=layout.cp_at_head)
    attention = "TransformerEngine" if te_available() else "SdpaAttention, K/V all-gathered over CP"
    name = layout_name(layout, "at the head: model cp=1" if layout.cp_at_head else f"inside the model ({attention})")
    student = _build(config, parallel, config.run.seed)
    reference = _build(config, parallel, config.run.seed, forward_fn=LogitsPathTopK())
    teacher = _build(config, parallel, config.run.seed + 1).model
    backend = "CUDA, NCCL" if device.type == "cuda" else "CPU, gloo"
    say(f"mcore_ppo distillation demo: {dist.get_world_size()} ranks ({backend}), layout {name}")
    model = config.model
    say(
        f"student and teacher: GPT {model.num_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size}, "
        f"{model.params_dtype} (teacher seed {config.run.seed + 1}); head: fused, T={cfg.temperature}, "
        f"backend={config.head.backend}"
    )
    say(
        f"distill: forward KL over the teacher's top-{cfg.distill_topk} ({cfg.distill_kl_mode}), coeff "
        f"{cfg.distill_coeff}, {'plus the PPO loss' if cfg.policy_loss else 'alone (no PPO loss)'}, "
        f"{cfg.loss_agg_mode}; {config.ppo.ppo_epochs} updates/rollout, AdamW lr {config.ppo.lr}; "
        "reference: the same student through full logits (fp64 log_softmax)"
    )
    worst = {"teacher": 0.0, "loss": 0.0, "actors": 0.0, "grad_norm": 0.0}
    steps, epochs = config.run.steps, config.ppo.ppo_epochs
    for step in range(1, steps + 1):
        rollout = synthetic_rollout(
            num_seqs=config.rollout.num_seqs,
            vocab_size=model.vocab_size,
            prompt_len=config.rollout.prompt_len,
            response_len=config.rollout.response_len,
            seed=config.rollout.seed + step,
            device=device,
        )
        mask = rollout.response_mask
        if cfg.policy_loss:
            old_lp, _ = student.compute_log_prob(rollout)
            rollout = dataclasses.replace(rollout, old_log_probs=old_lp)
        t0 = time.perf_counter()
        top = student.compute_teacher_topk(teacher, rollout)
        topk_s = time.perf_counter() - t0
        kw = {"temperature": cfg.temperature, "align": student.align}
        teacher_full = full_log_probs(teacher, rollout, parallel, **kw)
        student_full = full_log_probs(student.model, rollout, parallel, **kw)
        d_teacher = [0.0, 0.0, 0.0]
        kl_full = 0.0
        if teacher_full is not None:
            d_teacher = list(teacher_parity(top, teacher_full, mask))
            at_ids = student_full.gather(-1, top.ids.clamp(min=0))
            kl = topk_forward_kl(
                at_ids, top.log_probs.double(), top.tail_log_mass.double(), mode=cfg.distill_kl_mode, mask=mask
            )
            kl_full = float(kl[mask].mean())
        # Only the last pipeline stage has the full logits: every stage compares with its KL.
        kl_full = _from_last_stage(kl_full, parallel, device)
        d_teacher = _max_over_ranks(d_teacher, device)
        worst["teacher"] = max(worst["teacher"], *d_teacher)
        say(
            f"step {step}/{steps} teacher | fused_topk vs fp64 full logits ({int(mask.sum())} response tokens, "
            f"k={cfg.distill_topk}, {topk_s:.2f} s): max|Δlog_prob| {d_teacher[0]:.1e}, "
            f"max|Δtail_log_mass| {d_teacher[1]:.1e}, max|Δtop-k values| {d_teacher[2]:.1e}"
        )
        first = None
        for epoch in range(1, epochs + 1):
            m = student.update_policy(rollout, teacher=top)
            r = reference.update_policy(rollout, teacher=top)
            first = first or (m, r)
            d_loss = abs(m["loss"] - r["loss"])
            d_norm = abs(m["grad_norm"] - r["grad_norm"]) / max(r["grad_norm"], 1e-30)
            worst["actors"] = max(worst["actors"], d_loss)
            worst["grad_norm"] = max(worst["grad_norm"], d_norm)
            say(
                f"step {step}/{steps} update {epoch}/{epochs} | loss {m['loss']:+.5f} distill_kl {m['distill_kl']:.5f} "
                f"pg_loss {m['pg_loss']:+.5f} | entropy {m['entropy']:.4f} | grad_norm {m['grad_norm']:.4f} "
                f"| logits-path student: loss {r['loss']:+.5f} grad_norm {r['grad_norm']:.4f}"
            )
        d_kl = abs(first[0]["distill_kl"] - kl_full)
        (d_kl,) = _max_over_ranks([d_kl], device)
        worst["loss"] = max(worst["loss"], d_kl)
        say(
            f"step {step}/{steps} parity | distill loss: fused head vs fp64 full-logits path: max|Δ| {d_kl:.1e} "
            f"(KL {kl_full:.5f}) | fused vs logits-path student: |Δloss| {worst['actors']:.1e}, "
            f"|Δgrad_norm|/grad_norm {worst['grad_norm']:.1e}"
        )
    a = full_parameters(student.model, parallel.tp)
    b = full_parameters(reference.model, parallel.tp)
    (d_params,) = _max_over_ranks([max(float((a[k].double() - b[k].double()).abs().max()) for k in a)], device)
    say(f"after {steps} step(s): fused vs logits-path student max|Δparameter| {d_params:.1e} (all parameters, ranks)")
    failures = []
    if worst["teacher"] > tol.log_prob:
        failures.append(f"the teacher's top-k differs from its full logits by {worst['teacher']:.1e} > {tol.log_prob}")
    if worst["loss"] > tol.log_prob:
        failures.append(f"the distillation loss differs from the full-logits path by {worst['loss']:.1e}")
    if worst["actors"] > tol.log_prob:
        failures.append(f"the fused student's loss differs from the logits-path student's by {worst['actors']:.1e}")
    if worst["grad_norm"] > tol.params:
        failures.append(f"gradient norms differ by {worst['grad_norm']:.1e} (relative) > {tol.params}")
    if d_params > tol.params:
        failures.append(f"parameters differ from the logits-path student's by {d_params:.1e} > {tol.params}")
    if failures:
        say("FAIL: " + "; ".join(failures))
    else:
        say(
            f"PASS: distillation under {name}, {steps} step(s): teacher top-k == fp64 full logits to "
            f"{worst['teacher']:.1e}; distill loss == fp64 full-logits path to {worst['loss']:.1e}; fused student == "
            f"logits-path student (loss {worst['actors']:.1e}, grad norm {worst['grad_norm']:.1e} relative, parameters "
            f"after {steps * epochs} updates {d_params:.1e})"
        )
    destroy_layout()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0
