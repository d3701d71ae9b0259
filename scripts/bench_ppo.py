"""PPO step time and peak memory of a Megatron GPT: the fused head against the logits path.

    torchrun --standalone --nproc_per_node N scripts/bench_ppo.py --tp TP [--cp CP] [--sp | --no-sp]
        [--layers L --hidden H --heads A --ffn F --vocab V --micro-batch-tokens T ...] [--out DIR]

Both variants run the same PPO actor (:class:`mcore_ppo.actor.MegatronPPOActor`, Megatron's
forward-backward schedule, packed THD micro-batches) on the same model, from the same initial
parameters, on the same synthetic rollouts; they differ only in how log-probs and entropy leave
the model:

- ``fused``: the fused vocab-parallel head (``install_fused_head``): no logits are materialised.
- ``logits``: what a Megatron/verl user runs today (:class:`mcore_ppo_testing.logits_path.LogitsPath`):
  the model's output layer (``ColumnParallelLinear``) gives vocab-parallel logits (bf16 for a
  bf16 model), brought to fp32 and divided by T; log-probs ``= -vocab_parallel_cross_entropy``
  (Megatron-Core), entropy from verl's vocab-parallel entropy.

One PPO step = a no-grad log-prob pass with entropy (the old policy) + ``--ppo-epochs`` policy
updates (clipped surrogate, dual clip, entropy bonus, AdamW) on the same rollout. Per variant:
median step time over ``--steps`` steps after ``--warmup`` (log-prob pass / updates split; the
slowest rank per step), tokens/s, and peak memory (``torch.cuda.max_memory_allocated``, reset
before each variant; its optimizer state is created fresh, the parameters restored). The parity
line compares the two variants' log-probs and entropies on the first rollout before any update
(same parameters), with the bound bf16 rounding of the logits allows. No timing is asserted;
the exit status is 1 only if the parity is outside its bound.

CP runs at the head (the decoder sees whole sequences; see ``ActorParallel.cp_at_head``) unless
TransformerEngine is installed, as ``scripts/ppo_step.py`` does. Data-parallel replicas
(world > tp·cp) get the same rollouts. GPU defaults: NCCL, one GPU per rank, bf16, a
~1.8B-parameter GPT with vocab 151936, micro-batches of up to 8192 packed tokens, and (without
TransformerEngine) causal SDPA per packed sequence as the decoder's attention (``--attention
reference``, the O(t²) test attention, lowers the micro-batch default to 4096). CPU (no CUDA):
gloo with ``mcore_ppo_testing.cpu_shims``, a tiny fp32 model, for testing the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# Unit roundoff of the logits' dtype (the logits path rounds them to it; the fused head does not).
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
# Parity floor on top of the rounding bound: different GEMM kernels sum in different orders.
_PARITY_FLOOR = 5e-5

# GPU defaults: Qwen3-1.7B-like shape (learned positions, LayerNorm, GeLU MLP of Megatron's local
# spec), vocab 151936, ~4k packed tokens per micro-batch. CPU defaults: tiny, fp32, seconds.
_GPU_DEFAULTS = {
    "layers": 28,
    "hidden": 2048,
    "heads": 16,
    "ffn": 6144,
    "vocab": 151936,
    "attention": "sdpa",
    "micro_batch_tokens": 8192,  # 4096 with --attention reference (its O(t²) scores would not fit)
    "num_seqs": 48,
    "prompt_len": (128, 512),
    "response_len": (256, 1024),
    "dtype": "bfloat16",
    "steps": 3,
    "warmup": 1,
}
_CPU_DEFAULTS = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "ffn": 128,
    "vocab": 1000,
    "attention": "reference",
    "micro_batch_tokens": 96,
    "num_seqs": 8,
    "prompt_len": (4, 12),
    "response_len": (8, 32),
    "dtype": "float32",
    "steps": 2,
    "warmup": 1,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; unset sizes take the GPU or CPU defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: world / cp)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (at the head without TE)")
    parser.add_argument(
        "--sp", dest="sp", action="store_true", default=None, help="sequence parallelism (default: on when tp > 1)"
    )
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--ffn", type=int, help="MLP hidden size")
    parser.add_argument("--vocab", type=int, help="vocab size (padded up to a multiple of tp)")
    parser.add_argument("--micro-batch-tokens", type=int, help="packed (padded) tokens per micro-batch, at most")
    parser.add_argument("--num-seqs", type=int, help="sequences per rollout (one rollout per step)")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--response-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype")
    parser.add_argument("--steps", type=int, help="timed PPO steps per variant")
    parser.add_argument("--warmup", type=int, help="untimed PPO steps per variant before them")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="policy updates per rollout")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--entropy-coeff", type=float, default=1e-3, help="entropy bonus (non-zero: both variants differentiate it)"
    )
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--backend", default="auto", help="fused head backend")
    parser.add_argument(
        "--attention",
        choices=["reference", "sdpa"],
        help="decoder core attention without TransformerEngine: Megatron's unfused softmax over a "
        "block-diagonal mask (O(t²) memory and compute) or causal torch SDPA per packed sequence (varlen cost)",
    )
    parser.add_argument("--variants", default="fused,logits", help="comma-separated, run in this order")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON (default: $OUT, else none)")
    args = parser.parse_args(argv)
    defaults = dict(_GPU_DEFAULTS if torch.cuda.is_available() else _CPU_DEFAULTS)
    if torch.cuda.is_available() and args.attention == "reference":
        defaults["micro_batch_tokens"] = 4096
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - {"fused", "logits"})
    if unknown or not args.variants:
        parser.error(f"--variants takes fused and/or logits, got {args.variants}")
    return args


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _compiled_kernel_variants() -> int | None:
    """How many compiled variants of the head's Triton kernels this process holds (None when
    they are not JIT-compiled here: no Triton, or the CPU interpreter). A number that grows
    after the warm-up means Triton compiles in the middle of training steps."""
    try:
        from triton.runtime.jit import JITFunction

        import mcore_ppo.kernels as kernels
    except ImportError:
        return None
    total, seen = 0, False
    for name in kernels.__all__:
        kernel = getattr(kernels, name)
        if isinstance(kernel, JITFunction):
            seen = True
            total += sum(len(entry[0]) for entry in kernel.device_caches.values())
    return total if seen else None


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _masked_max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs()[mask].max()) if bool(mask.any()) else 0.0


def _global_param_count(model: torch.nn.Module, tp: int) -> int:
    """Parameters of the whole model: TP-sharded ones counted with every shard, the rest once."""
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())


def _gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30


def main(argv: list[str] | None = None) -> int:
    """Run both variants; returns the exit status (1: parity outside its bound)."""
    args = parse_args(argv)
    from mcore_ppo_testing.ppo_harness import init_distributed

    device = init_distributed()

    import megatron.core

    from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
    from mcore_ppo.batching import padded_length
    from mcore_ppo_testing.logits_path import LogitsPath
    from mcore_ppo_testing.ppo_harness import (
        build_actor_model,
        destroy_layout,
        init_layout,
        synthetic_rollout,
        te_available,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = device.type == "cuda"

    def say(msg: str = "") -> None:
        if rank == 0:
            print(msg, flush=True)

    cp = args.cp
    tp = args.tp if args.tp is not None else world // cp
    if tp < 1 or cp < 1 or world % (tp * cp):
        say(f"bench_ppo: world size {world} does not divide by tp*cp = {tp}*{cp}")
        dist.destroy_process_group()
        return 2
    sp = (tp > 1) if args.sp is None else (args.sp and tp > 1)
    dtype = _DTYPES[args.dtype]
    cp_at_head = cp > 1 and not te_available()
    parallel = init_layout(tp, cp, 1, cp_at_head=cp_at_head)
    dp = world // (tp * cp)

    vocab = math.ceil(args.vocab / tp) * tp  # Megatron's output layer needs V divisible by tp
    align = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    max_len = padded_length(args.prompt_len[1] + args.response_len[1], align)
    model_cfg = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "ffn_hidden_size": args.ffn,
        "vocab_size": vocab,
        "max_sequence_length": max_len,
    }
    model = build_actor_model(
        model_cfg,
        sequence_parallel=sp,
        temperature=args.temperature,
        backend=args.backend,
        params_dtype=dtype,
        seed=args.seed,
        attention=args.attention,
    )
    actor_cfg = PPOActorConfig(
        clip_ratio=0.2,
        clip_ratio_c=3.0,
        entropy_coeff=args.entropy_coeff,
        loss_agg_mode="token-mean",
        max_grad_norm=1.0,
        temperature=args.temperature,
        max_tokens_per_micro_batch=args.micro_batch_tokens,
    )
    # Every variant starts from these parameters (kept on the host: no GPU memory).
    initial = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}

    def make_actor(forward_fn: Any = None) -> MegatronPPOActor:
        # Fused AdamW on CUDA (no foreach temporaries); plain on CPU. Same for both variants.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=cuda)
        return MegatronPPOActor(model, optimizer, actor_cfg, parallel=parallel, forward_fn=forward_fn)

    n_steps = args.warmup + args.steps
    rollouts = [
        synthetic_rollout(
            num_seqs=args.num_seqs,
            vocab_size=args.vocab,  # token ids from the real vocab; the padding rows are never labels
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            seed=args.seed + 1 + step,
            device=device,
        )
        for step in range(n_steps)
    ]
    probe = make_actor()
    mbs = probe.micro_batches(rollouts[0])
    mb_tokens = [int(mb.input_ids.shape[1]) for mb in mbs]
    del probe, mbs
    tokens = [int(r.tokens.numel()) for r in rollouts]
    response_tokens = [int(r.response_mask.sum()) for r in rollouts]

    n_params = _global_param_count(model, tp)
    name = f"TP{tp}" + ("+SP" if sp else "")
    if cp > 1:
        name += f" × CP{cp} ({'at the head' if cp_at_head else 'in the model'})"
    if dp > 1:
        name += f" × DP{dp} (replicas of the same data)"
    gpu_name = torch.cuda.get_device_name() if cuda else "CPU"
    say(f"bench_ppo: {world} ranks ({gpu_name}, {'NCCL' if cuda else 'gloo'}), layout {name}")
    say(
        f"model: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, ffn {args.ffn}, vocab {args.vocab}"
        f"{f' (padded to {vocab})' if vocab != args.vocab else ''}, {args.dtype}, {n_params / 1e6:,.1f}M parameters; "
        f"head backend {args.backend}, T={args.temperature}; attention "
        f"{'TransformerEngine' if te_available() else args.attention + ' (THD, no TransformerEngine)'}"
    )
    say(
        f"rollout: {args.num_seqs} sequences, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, response "
        f"{args.response_len[0]}-{args.response_len[1]} tokens; step 1: {tokens[0]} tokens ({response_tokens[0]} "
        f"response) in {len(mb_tokens)} micro-batches of ≤ {args.micro_batch_tokens} (largest {max(mb_tokens)}, "
        f"mean {statistics.mean(mb_tokens):.0f} packed tokens); {args.ppo_epochs} updates per step, "
        f"{args.warmup} warmup + {args.steps} timed steps per variant"
    )

    # ---- parity: both variants on the same parameters and rollout, before any update
    logits_path = LogitsPath()
    logits_path.track_max_logit = True
    outputs = {}
    for variant in ("fused", "logits"):
        actor = make_actor(logits_path if variant == "logits" else None)
        outputs[variant] = actor.compute_log_prob(rollouts[0], calculate_entropy=True)
        del actor
    logits_path.track_max_logit = False
    mask = rollouts[0].response_mask
    d_lp, d_ent, max_z = _max_over_ranks(
        [
            _masked_max_abs(outputs["fused"][0], outputs["logits"][0], mask),
            _masked_max_abs(outputs["fused"][1], outputs["logits"][1], mask),
            logits_path.max_abs_logit,
        ],
        device,
    )
    del outputs
    # First-order bounds from rounding the logits z = hW/T to the model dtype (unit roundoff u):
    # |Δ log p| ≤ 2u·max|z| and |Δ H| = |Cov_p(Δz, z)| ≤ u·max|z|², doubled, plus a floor.
    u = _UNIT_ROUNDOFF[dtype]
    bound_lp = 2 * (2 * u * max_z) + _PARITY_FLOOR
    bound_ent = 2 * (u * max_z**2) + _PARITY_FLOOR
    parity_ok = d_lp <= bound_lp and d_ent <= bound_ent
    parity_line = (
        f"parity (fused vs logits, same parameters, step-1 rollout, {response_tokens[0]} response tokens): "
        f"max|Δlog_prob| {d_lp:.2e} (bound {bound_lp:.1e}), max|Δentropy| {d_ent:.2e} (bound {bound_ent:.1e}); "
        f"max|logit/T| {max_z:.2f}, {args.dtype} logits -> {'OK' if parity_ok else 'OUTSIDE THE BOUND'}"
    )
    say(parity_line)

    # ---- timed runs
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants:
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_(initial[pname])
                p.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        actor = make_actor(LogitsPath() if variant == "logits" else None)
        _sync()
        dist.barrier()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() if cuda else None
        steps: list[dict[str, Any]] = []
        for step, rollout in enumerate(rollouts):
            _sync()
            t0 = time.perf_counter()
            old_lp, _ = actor.compute_log_prob(rollout, calculate_entropy=True)
            _sync()
            t1 = time.perf_counter()
            rollout = rollout.with_fields(old_log_probs=old_lp)
            metrics = [actor.update_policy(rollout) for _ in range(args.ppo_epochs)]
            _sync()
            t2 = time.perf_counter()
            logprob_s, update_s = _max_over_ranks([t1 - t0, t2 - t1], device)
            steps.append(
                {
                    "step": step + 1,
                    "warmup": step < args.warmup,
                    "logprob_s": logprob_s,
                    "update_s": update_s,
                    "step_s": logprob_s + update_s,
                    "tokens": tokens[step],
                    "metrics": metrics,
                    "triton_kernel_variants": _compiled_kernel_variants(),
                }
            )
            m = metrics[0]
            say(
                f"  {variant:>6} step {step + 1}/{n_steps}{' (warmup)' if step < args.warmup else ''}: "
                f"log-prob pass {logprob_s:.3f} s, {args.ppo_epochs} updates {update_s:.3f} s | update 1: "
                f"loss {m['loss']:+.6f}, entropy {m['entropy']:.5f}, grad_norm {m['grad_norm']:.5f}, "
                f"clipfrac {m['pg_clipfrac']:.3f}"
                + (f" | compiled head kernels {steps[-1]['triton_kernel_variants']}" if cuda else "")
            )
        peak = torch.cuda.max_memory_allocated() if cuda else None
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, {"peak_bytes": peak, "resident_bytes": resident})
        timed = [s for s in steps if not s["warmup"]] or steps
        med = {k: statistics.median(s[k] for s in timed) for k in ("logprob_s", "update_s", "step_s")}
        mean_tokens = statistics.mean(s["tokens"] for s in timed)
        peaks = [r["peak_bytes"] for r in per_rank]
        residents = [r["resident_bytes"] for r in per_rank]
        results[variant] = {
            "median_logprob_s": med["logprob_s"],
            "median_update_s": med["update_s"],
            "median_step_s": med["step_s"],
            "tokens_per_s_step": mean_tokens / med["step_s"],
            "tokens_per_s_logprob": mean_tokens / med["logprob_s"],
            "tokens_per_s_update": mean_tokens * args.ppo_epochs / med["update_s"],
            "peak_gib_max_over_ranks": _gib(max(peaks)) if cuda else None,
            "peak_above_resident_gib_max_over_ranks": (
                _gib(max(p - r for p, r in zip(peaks, residents, strict=True))) if cuda else None
            ),
            "resident_gib_per_rank": [_gib(r) for r in residents] if cuda else None,
            "peak_gib_per_rank": [_gib(p) for p in peaks] if cuda else None,
            "steps": steps,
        }
        del actor, rollout, old_lp

    # ---- the table
    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    header = (
        f"| variant | log-prob pass (s) | {args.ppo_epochs} updates (s) | step (s) | tokens/s (step) | "
        f"peak memory (GiB) | peak above resident (GiB) |"
    )
    lines = [header, "|" + "---|" * 7]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {r['median_logprob_s']:.3f} | {r['median_update_s']:.3f} | {r['median_step_s']:.3f} | "
            f"{r['tokens_per_s_step']:,.0f} | {fmt(r['peak_gib_max_over_ranks'], '.2f')} | "
            f"{fmt(r['peak_above_resident_gib_max_over_ranks'], '.2f')} |"
        )
    if {"fused", "logits"} <= results.keys():
        f, lg = results["fused"], results["logits"]
        ratio = (
            f"fused/logits: step time {f['median_step_s'] / lg['median_step_s']:.3f}×, "
            f"log-prob pass {f['median_logprob_s'] / lg['median_logprob_s']:.3f}×, "
            f"updates {f['median_update_s'] / lg['median_update_s']:.3f}×"
        )
        if cuda:
            ratio += f"; peak memory {f['peak_gib_max_over_ranks'] - lg['peak_gib_max_over_ranks']:+.2f} GiB"
        lines.append("")
        lines.append(ratio)
        # The same rollouts from the same parameters: the updates' numbers track each other (to
        # rounding, which grows as the parameters drift apart in low precision).
        pairs = [
            (a, b)
            for sa, sb in zip(f["steps"], lg["steps"], strict=True)
            for a, b in zip(sa["metrics"], sb["metrics"], strict=True)
        ]
        d_loss = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
        d_norm = max(abs(a["grad_norm"] - b["grad_norm"]) / max(abs(b["grad_norm"]), 1e-30) for a, b in pairs)
        update_line = (
            f"updates (fused vs logits, same rollouts, {len(pairs)} updates): max|Δloss| {d_loss:.2e}, "
            f"max relative Δgrad_norm {d_norm:.2e}"
        )
        lines.append(update_line)
    lines.append(parity_line)
    table = "\n".join(lines)
    say()
    say(f"medians over {args.steps} timed step(s) (slowest rank per step), layout {name}:")
    say(table)

    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"tp{tp}_cp{cp}{'_sp' if sp else ''}_{args.attention}_mb{args.micro_batch_tokens}"
        path = os.path.join(args.out, f"bench_ppo_{tag}.json")
        report = {
            "layout": {"name": name, "world": world, "tp": tp, "cp": cp, "dp": dp, "sp": sp, "cp_at_head": cp_at_head},
            "device": gpu_name,
            "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", None),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "model": {**model_cfg, "params_dtype": args.dtype, "parameters": n_params},
            "rollout": {
                "tokens_per_step": tokens,
                "response_tokens_per_step": response_tokens,
                "micro_batch_tokens_step1": mb_tokens,
            },
            "parity": {
                "max_abs_d_log_prob": d_lp,
                "max_abs_d_entropy": d_ent,
                "bound_log_prob": bound_lp,
                "bound_entropy": bound_ent,
                "max_abs_logit_over_T": max_z,
                "ok": parity_ok,
            },
            "variants": results,
            "table": table,
        }
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
        say(f"wrote {path}")
    destroy_layout()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
