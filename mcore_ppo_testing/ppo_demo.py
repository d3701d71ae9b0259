"""The PPO demo behind ``scripts/ppo_step.py`` (the README's main command), and its verdict.

:func:`run_demo` runs under torchrun. Every step: a fresh synthetic packed rollout (random
prompts + responses of varied lengths, GRPO-style advantages), a log-prob pass for the old
policy, ``ppo_epochs`` policy updates, and a log-prob pass of the updated policy. Printed per
update: loss, policy loss, KL to the old policy, entropy, clip fraction, gradient norm,
tokens/s; per step, the *parity line*: the largest ``|difference|`` of the head's log-probs and
entropies against the unfused path (the model's full logits gathered over TP, fp64
``log_softmax``), and, with CP, against the same steps run without CP (a second actor, the
*cp=1 reference*). The last line is ``PASS: ...`` (what was proven) or ``FAIL: ...``;
``tests/test_launch.py`` parses these lines.

CPU (no CUDA): gloo, with ``mcore_ppo_testing.cpu_shims``. GPU: NCCL, one GPU per rank, no shims.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_ppo.actor import ActorParallel, MegatronPPOActor
from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo.actor.ppo_loss import kl_k3
from mcore_ppo_testing.demo_config import DemoConfig, LayoutConfig
from mcore_ppo_testing.ppo_harness import (
    build_actor_model,
    destroy_layout,
    full_parameters,
    init_distributed,
    init_layout,
    logits_path_outputs,
    synthetic_rollout,
    te_available,
)

__all__ = ["layout_name", "run_demo"]


def say(msg: str) -> None:
    """Print on rank 0 only (every rank computes the same lines)."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs()[mask].max()) if bool(mask.any()) else 0.0


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def layout_name(layout: LayoutConfig, cp_where: str) -> str:
    """``TP2+SP × CP2 (where) × PP2``: the layout as the demo prints it."""
    parts = [f"TP{layout.tp}" + ("+SP" if layout.sp else "")]
    if layout.cp > 1:
        parts.append(f"CP{layout.cp} ({cp_where})")
    if layout.pp > 1:
        parts.append(f"PP{layout.pp}")
    return " × ".join(parts)


def _build_actor(config: DemoConfig, parallel: ActorParallel, **model_overrides) -> MegatronPPOActor:
    model = build_actor_model(
        {**config.model.shape(), **model_overrides},
        sequence_parallel=config.layout.sp,
        temperature=config.head.temperature,
        backend=config.head.backend,
        buffer_budget_bytes=config.head.buffer_budget_bytes,
        params_dtype=config.model.dtype,
        seed=config.run.seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.ppo.lr, weight_decay=0.0)
    return MegatronPPOActor(model, optimizer, config.ppo.actor, parallel=parallel)


def _cp1_reference(config: DemoConfig, parallel: ActorParallel) -> MegatronPPOActor | None:
    """The same steps without CP: a second model from the same seed, built with
    ``context_parallel_size=1``, every rank holding whole sequences (the CP ranks then act as
    data-parallel replicas of the same data). None without CP or when the config turns it off."""
    if config.layout.cp == 1 or not config.run.cp1_reference:
        return None
    # The CP ranks are data-parallel replicas here, so they count as DP ranks (the global counts
    # then cover every copy, and the DP×CP gradient average gives the objective's gradient once).
    # Megatron's schedule still runs with parallel_state's CP group: the reference says so.
    no_cp = ActorParallel(
        tp=parallel.tp,
        cp=None,
        dp=parallel.grad_avg,
        grad_avg=parallel.grad_avg,
        pp=parallel.pp,
        model_runs_cp=False,
        schedule_cp_size=parallel.schedule_cp_size,
    )
    return _build_actor(config, no_cp, context_parallel_size=1)


def _print_header(config: DemoConfig, actor: MegatronPPOActor, name: str, device: torch.device) -> None:
    model, head, ppo, cfg = config.model, config.head, config.ppo, config.ppo.actor
    n_params = sum(p.numel() for p in actor.model.parameters())
    backend = "CUDA, NCCL" if device.type == "cuda" else "CPU, gloo"
    say(f"mcore_ppo PPO demo: {dist.get_world_size()} ranks ({backend}), layout {name}")
    say(
        f"model: GPT {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads, vocab {model.vocab_size}, {model.params_dtype}, "
        f"{n_params} params/rank; head: fused, T={head.temperature}, backend={head.backend}"
    )
    say(
        f"ppo: clip {cfg.low}/{cfg.high}, dual-clip {cfg.clip_ratio_c}, entropy_coeff "
        f"{cfg.entropy_coeff}, {cfg.loss_agg_mode}, max_grad_norm {cfg.max_grad_norm}, "
        f"{ppo.ppo_epochs} updates/rollout, AdamW lr {ppo.lr}; packing align {actor.align}"
    )
    if config.layout.cp_at_head:
        say(
            "note: cp_mode=head: each CP rank runs the whole sequence through the decoder, the final "
            "hidden states are split as Megatron splits a CP batch (2·cp chunks, rank r keeps r and "
            "2cp-1-r; labels rolled before the split), and the head, loss, token counts and gradient "
            "reduction run under CP."
        )


@dataclass
class _Worst:
    """The largest differences over every step (max over ranks)."""

    log_prob: float = 0.0
    entropy: float = 0.0
    cp_log_prob: float = 0.0
    params: float | None = None  # CP vs cp1, after the last step


class _Demo:
    """One demo run: the actor, its cp=1 reference and what the steps found."""

    def __init__(self, config: DemoConfig, parallel: ActorParallel, device: torch.device):
        self.config, self.parallel, self.device = config, parallel, device
        self.actor = _build_actor(config, parallel)
        self.reference = _cp1_reference(config, parallel)
        self.worst = _Worst()

    def step(self, step: int) -> None:
        """One PPO step on a fresh rollout, with its update lines and parity line."""
        config, actor, reference = self.config, self.actor, self.reference
        steps, epochs = config.run.steps, config.ppo.ppo_epochs
        rollout = synthetic_rollout(
            num_seqs=config.rollout.num_seqs,
            vocab_size=config.model.vocab_size,
            prompt_len=config.rollout.prompt_len,
            response_len=config.rollout.response_len,
            seed=config.rollout.seed + step,
            device=self.device,
        )
        mask = rollout.response_mask
        n_tokens, n_resp = rollout.tokens.numel(), int(mask.sum())
        t0 = time.perf_counter()
        old_lp, old_ent = actor.compute_log_prob(rollout, calculate_entropy=True)
        logprob_s = time.perf_counter() - t0
        rollout = dataclasses.replace(rollout, old_log_probs=old_lp)
        d_lp, d_ent = self._logits_path_parity(rollout, old_lp, old_ent)
        d_cp = None
        if reference is not None:
            ref_lp, _ = reference.compute_log_prob(rollout)
            d_cp = _max_abs(old_lp, ref_lp, mask)
            self.worst.cp_log_prob = max(self.worst.cp_log_prob, d_cp)

        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            m = actor.update_policy(rollout)
            update_s = time.perf_counter() - t0
            if reference is not None:
                reference.update_policy(rollout)
            say(
                f"step {step}/{steps} update {epoch}/{epochs} | loss {m['loss']:+.5f} pg_loss {m['pg_loss']:+.5f} "
                f"| kl(old||new) {m['kl_k3']:.2e} | entropy {m['entropy']:.4f} | clipfrac {m['pg_clipfrac']:.3f} "
                f"| grad_norm {m['grad_norm']:.4f} | {n_tokens / update_s:,.0f} tok/s (update), "
                f"{n_tokens / logprob_s:,.0f} tok/s (log-prob pass)"
            )
        new_lp, _ = actor.compute_log_prob(rollout)
        kl_after = float(kl_k3(old_lp.double(), new_lp.double())[mask].mean())
        line = (
            f"step {step}/{steps} parity | head vs fp64 full-logits path ({n_resp} response tokens): "
            f"max|Δlog_prob| {d_lp:.1e}, max|Δentropy| {d_ent:.1e}"
        )
        if d_cp is not None:
            line += f" | CP{config.layout.cp} vs cp1: max|Δlog_prob| {d_cp:.1e}"
        say(line + f" | kl(old||new) after the step {kl_after:.2e}")

    def _logits_path_parity(
        self, rollout: PackedRollout, log_probs: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[float, float]:
        """The head's outputs against the unfused path on this rollout and the current policy."""
        ref = logits_path_outputs(
            self.actor.model,
            rollout,
            self.parallel,
            temperature=self.config.head.temperature,
            align=self.actor.align,
            packed_attention=self.actor.packed_attention,
        )
        d_lp = d_ent = 0.0
        if ref is not None:  # the last pipeline stage has it
            mask = rollout.response_mask
            d_lp, d_ent = _max_abs(log_probs, ref[0], mask), _max_abs(entropy, ref[1], mask)
        d_lp, d_ent = _max_over_ranks([d_lp, d_ent], self.device)
        self.worst.log_prob, self.worst.entropy = max(self.worst.log_prob, d_lp), max(self.worst.entropy, d_ent)
        return d_lp, d_ent

    def compare_parameters(self) -> None:
        """CP vs cp1: every parameter after the last step, max over ranks."""
        if self.reference is None:
            return
        a = full_parameters(self.actor.model, self.parallel.tp)
        b = full_parameters(self.reference.model, self.parallel.tp)
        d_params = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        (self.worst.params,) = _max_over_ranks([d_params], self.device)
        layout = self.config.layout
        say(
            f"after {self.config.run.steps} step(s): CP{layout.cp} vs cp1 max|Δparameter| {self.worst.params:.1e} "
            "(every parameter, all ranks)"
        )


def verdict(config: DemoConfig, worst: _Worst, name: str) -> tuple[bool, str]:
    """``(passed, the PASS/FAIL line)`` for the differences found, against the config's tolerances."""
    tol, cp, worst_params = config.run.tolerance, config.layout.cp, worst.params
    failures = []
    if worst.log_prob > tol.log_prob:
        failures.append(f"head log-probs differ from the logits path by {worst.log_prob:.1e} > {tol.log_prob}")
    if worst.entropy > tol.entropy:
        failures.append(f"head entropy differs from the logits path by {worst.entropy:.1e} > {tol.entropy}")
    if worst_params is not None and worst.cp_log_prob > tol.log_prob:
        failures.append(f"CP{cp} log-probs differ from cp1 by {worst.cp_log_prob:.1e} > {tol.log_prob}")
    if worst_params is not None and worst_params > tol.params:
        failures.append(f"CP{cp} parameters differ from cp1 by {worst_params:.1e} > {tol.params}")
    if failures:
        return False, "FAIL: " + "; ".join(failures)
    steps = config.run.steps
    proven = [
        f"head log-probs == fp64 full-logits path to {worst.log_prob:.1e} "
        f"(entropy to {worst.entropy:.1e}) under {name}, over {steps} step(s)"
    ]
    if worst_params is not None:
        proven.append(
            f"CP{cp} ({'at the head' if config.layout.cp_at_head else 'in the model'}) == cp1: "
            f"log-probs to {worst.cp_log_prob:.1e}, parameters after "
            f"{steps * config.ppo.ppo_epochs} updates to {worst_params:.1e}"
        )
    return True, "PASS: " + "; ".join(proven)


def run_demo(config: DemoConfig) -> int:
    """Run the demo (inside torchrun) and print its verdict; returns the exit status (0 = PASS)."""
    if config.ppo.actor.distill:  # ppo.distill_coeff > 0: the distillation demo
        from mcore_ppo_testing.distill_demo import run_distill_demo

        return run_distill_demo(config)
    device = init_distributed()
    layout = config.layout
    parallel = init_layout(layout.tp, layout.cp, layout.pp, cp_at_head=layout.cp_at_head)
    attention = "TransformerEngine" if te_available() else "SdpaAttention, K/V all-gathered over CP"
    cp_where = "at the head: model cp=1" if layout.cp_at_head else f"inside the model ({attention})"
    name = layout_name(layout, cp_where)
    demo = _Demo(config, parallel, device)
    _print_header(config, demo.actor, name, device)
    for step in range(1, config.run.steps + 1):
        demo.step(step)
    demo.compare_parameters()
    passed, line = verdict(config, demo.worst, name)
    say(line)
    destroy_layout()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1
