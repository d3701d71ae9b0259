"""PPO steps of a small Megatron GPT with the fused head, and what they prove (the README's main command).

Run it through ``scripts/launch.sh`` (torchrun). Every step: a fresh synthetic packed rollout
(random prompts + responses of varied lengths, GRPO-style advantages), a log-prob pass for the
old policy, ``ppo_epochs`` policy updates, and a log-prob pass of the updated policy. Printed per
update: loss, policy loss, KL to the old policy, entropy, clip fraction, gradient norm,
tokens/s; per step, the *parity line*: the largest ``|difference|`` of the head's log-probs and
entropies against the unfused path (the model's full logits gathered over TP, fp64
``log_softmax``), and, with CP, against the same steps run without CP. The last line is PASS or
FAIL with what was proven; a parity failure exits 1.

CPU (no CUDA): gloo, with ``mcore_ppo_testing.cpu_shims``. GPU: NCCL, one GPU per rank, no shims.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line: a config file and layout overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "ppo_demo.yaml"))
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's)")
    parser.add_argument("--cp", type=int, help="context-parallel size (default: the config's)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default: the config's)")
    parser.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallelism on")
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    parser.add_argument("--cp-mode", choices=["model", "head"], help="where CP runs (default: the config's)")
    parser.add_argument("--steps", type=int, help="PPO steps (default: the config's)")
    parser.add_argument("--backend", help="head backend (default: the config's)")
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML config with the command-line overrides applied."""
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    layout = cfg.setdefault("layout", {})
    for key in ("tp", "cp", "pp"):
        if getattr(args, key) is not None:
            layout[key] = getattr(args, key)
        layout.setdefault(key, 1)
    if args.sp is not None:
        layout["sequence_parallel"] = args.sp
    if args.cp_mode is not None:
        layout["cp_mode"] = args.cp_mode
    if args.steps is not None:
        cfg["run"]["steps"] = args.steps
    if args.backend is not None:
        cfg["head"]["backend"] = args.backend
    layout["sequence_parallel"] = bool(layout.get("sequence_parallel", False)) and layout["tp"] > 1
    return cfg


def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs()[mask].max()) if bool(mask.any()) else 0.0


def _layout_name(tp: int, cp: int, pp: int, sp: bool, cp_where: str) -> str:
    parts = [f"TP{tp}" + ("+SP" if sp else "")]
    if cp > 1:
        parts.append(f"CP{cp} ({cp_where})")
    if pp > 1:
        parts.append(f"PP{pp}")
    return " × ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 = every parity check passed)."""
    args = parse_args(argv)
    cfg = load_config(args)
    from mcore_ppo_testing.ppo_harness import init_distributed

    device = init_distributed()

    from mcore_ppo.actor import ActorParallel, MegatronPPOActor, PPOActorConfig
    from mcore_ppo.ppo_loss import kl_k3
    from mcore_ppo_testing.ppo_harness import (
        build_actor_model,
        destroy_layout,
        full_parameters,
        init_layout,
        logits_path_outputs,
        synthetic_rollout,
        te_available,
    )

    rank0 = dist.get_rank() == 0

    def say(msg: str) -> None:
        if rank0:
            print(msg, flush=True)

    layout, model_cfg, head_cfg, ppo_cfg = cfg["layout"], dict(cfg["model"]), cfg["head"], dict(cfg["ppo"])
    run_cfg, roll_cfg, tol = cfg["run"], cfg["rollout"], cfg["run"]["tolerance"]
    tp, cp, pp, sp = layout["tp"], layout["cp"], layout["pp"], layout["sequence_parallel"]
    cp_mode = layout.get("cp_mode", "model")
    cp_at_head = cp > 1 and cp_mode == "head"
    world = dist.get_world_size()
    parallel = init_layout(tp, cp, pp, cp_at_head=cp_at_head)
    attention = "TransformerEngine" if te_available() else "SdpaAttention, K/V all-gathered over CP"
    cp_where = "at the head: model cp=1" if cp_at_head else f"inside the model ({attention})"
    name = _layout_name(tp, cp, pp, sp, cp_where)
    dtype = _DTYPES[model_cfg.pop("params_dtype", "float32")]
    temperature = float(head_cfg.get("temperature", 1.0))
    lr = float(ppo_cfg.pop("lr", 1e-4))
    epochs = int(ppo_cfg.pop("ppo_epochs", 1))
    actor_cfg = PPOActorConfig(temperature=temperature, **ppo_cfg)

    def make_actor(actor_parallel: ActorParallel, **model_overrides) -> MegatronPPOActor:
        model = build_actor_model(
            {**model_cfg, **model_overrides},
            sequence_parallel=sp,
            temperature=temperature,
            backend=head_cfg.get("backend", "auto"),
            buffer_budget_bytes=head_cfg.get("buffer_budget_bytes"),
            params_dtype=dtype,
            seed=int(run_cfg.get("seed", 1234)),
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        return MegatronPPOActor(model, optimizer, actor_cfg, parallel=actor_parallel)

    actor = make_actor(parallel)
    reference = None
    if cp > 1 and run_cfg.get("cp1_reference", True):
        # The same steps without CP: a second model from the same seed, built with
        # context_parallel_size=1, every rank holding whole sequences (the CP ranks then act as
        # data-parallel replicas of the same data).
        reference = make_actor(
            ActorParallel(
                tp=parallel.tp, cp=None, dp=parallel.dp, grad_avg=parallel.grad_avg, pp=parallel.pp, model_runs_cp=False
            ),
            context_parallel_size=1,
        )

    n_params = sum(p.numel() for p in actor.model.parameters())
    say(f"mcore_ppo PPO demo: {world} ranks ({'CUDA, NCCL' if device.type == 'cuda' else 'CPU, gloo'}), layout {name}")
    say(
        f"model: GPT {model_cfg['num_layers']} layers, hidden {model_cfg['hidden_size']}, "
        f"{model_cfg['num_attention_heads']} heads, vocab {model_cfg['vocab_size']}, {str(dtype)[6:]}, "
        f"{n_params} params/rank; head: fused, T={temperature}, backend={head_cfg.get('backend', 'auto')}"
    )
    say(
        f"ppo: clip {actor_cfg.low}/{actor_cfg.high}, dual-clip {actor_cfg.clip_ratio_c}, entropy_coeff "
        f"{actor_cfg.entropy_coeff}, {actor_cfg.loss_agg_mode}, max_grad_norm {actor_cfg.max_grad_norm}, "
        f"{epochs} updates/rollout, AdamW lr {lr}; packing align {actor.align}"
    )
    if cp_at_head:
        say(
            "note: cp_mode=head: each CP rank runs the whole sequence through the decoder, the final "
            "hidden states are split as Megatron splits a CP batch (2·cp chunks, rank r keeps r and "
            "2cp-1-r; labels rolled before the split), and the head, loss, token counts and gradient "
            "reduction run under CP."
        )

    worst = {"log_prob": 0.0, "entropy": 0.0, "cp_log_prob": 0.0}
    failures: list[str] = []
    steps = int(run_cfg["steps"])
    for step in range(1, steps + 1):
        rollout = synthetic_rollout(
            num_seqs=int(roll_cfg["num_seqs"]),
            vocab_size=int(model_cfg["vocab_size"]),
            prompt_len=roll_cfg["prompt_len"],
            response_len=roll_cfg["response_len"],
            seed=int(roll_cfg.get("seed", 0)) + step,
            device=device,
        )
        mask = rollout.response_mask
        n_tokens, n_resp = rollout.tokens.numel(), int(mask.sum())
        t0 = time.perf_counter()
        old_lp, old_ent = actor.compute_log_prob(rollout, calculate_entropy=True)
        logprob_s = time.perf_counter() - t0
        rollout = rollout.with_fields(old_log_probs=old_lp)

        # Parity with the unfused path, on this step's rollout and the current policy.
        ref = logits_path_outputs(
            actor.model,
            rollout,
            parallel,
            temperature=temperature,
            align=actor.align,
            packed_attention=actor.packed_attention,
        )
        d_lp = d_ent = 0.0
        if ref is not None:
            d_lp, d_ent = _max_abs(old_lp, ref[0], mask), _max_abs(old_ent, ref[1], mask)
        d = torch.tensor([d_lp, d_ent], dtype=torch.float64, device=device)
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        d_lp, d_ent = d.tolist()
        worst["log_prob"], worst["entropy"] = max(worst["log_prob"], d_lp), max(worst["entropy"], d_ent)
        d_cp = None
        if reference is not None:
            ref_lp, _ = reference.compute_log_prob(rollout)
            d_cp = _max_abs(old_lp, ref_lp, mask)
            worst["cp_log_prob"] = max(worst["cp_log_prob"], d_cp)

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
            line += f" | CP{cp} vs cp1: max|Δlog_prob| {d_cp:.1e}"
        say(line + f" | kl(old||new) after the step {kl_after:.2e}")

    d_params = None
    if reference is not None:
        a = full_parameters(actor.model, parallel.tp)
        b = full_parameters(reference.model, parallel.tp)
        d_params = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        t = torch.tensor([d_params], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        d_params = float(t)
        say(f"after {steps} step(s): CP{cp} vs cp1 max|Δparameter| {d_params:.1e} (every parameter, all ranks)")

    if worst["log_prob"] > tol["log_prob"]:
        failures.append(f"head log-probs differ from the logits path by {worst['log_prob']:.1e} > {tol['log_prob']}")
    if worst["entropy"] > tol["entropy"]:
        failures.append(f"head entropy differs from the logits path by {worst['entropy']:.1e} > {tol['entropy']}")
    if reference is not None and worst["cp_log_prob"] > tol["log_prob"]:
        failures.append(f"CP{cp} log-probs differ from cp1 by {worst['cp_log_prob']:.1e} > {tol['log_prob']}")
    if d_params is not None and d_params > tol["params"]:
        failures.append(f"CP{cp} parameters differ from cp1 by {d_params:.1e} > {tol['params']}")

    if failures:
        say("FAIL: " + "; ".join(failures))
    else:
        proven = [
            f"head log-probs == fp64 full-logits path to {worst['log_prob']:.1e} "
            f"(entropy to {worst['entropy']:.1e}) under {name}, over {steps} step(s)"
        ]
        if reference is not None:
            proven.append(
                f"CP{cp} ({'at the head' if cp_at_head else 'in the model'}) == cp1: "
                f"log-probs to {worst['cp_log_prob']:.1e}, parameters after "
                f"{steps * epochs} updates to {d_params:.1e}"
            )
        say("PASS: " + "; ".join(proven))
    destroy_layout()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
