"""PPO step time and peak memory of a Megatron GPT: the fused head against the logits path.

    torchrun --standalone --nproc_per_node N scripts/bench_ppo.py --tp TP [--cp CP] [--sp | --no-sp]
        [--layers L --hidden H --heads A --ffn F --vocab V --micro-batch-tokens T ...]
        [--long-context 8192,16384,32768] [--out DIR]
    torchrun --standalone --nproc_per_node 1 scripts/bench_ppo.py --max-micro-batch 8192,16384,... [--out DIR]

What is timed and how it is kept fair: :mod:`mcore_ppo_testing.ppo_bench` (every variant warmed
on every rollout, then timed passes A B B A; new-shape steps on each variant's own fresh
rollouts; long sequences one per micro-batch; the largest micro-batch on one GPU). SP is on
whenever TP > 1 (``--no-sp`` turns it off) and CP runs inside the model (SdpaAttention without
TransformerEngine; ``--cp-at-head`` for the old CP-at-the-head mode). GPU defaults: NCCL, one GPU
per rank, bf16, a ~1.8B-parameter GPT with vocab 151936, micro-batches of up to 8192 packed tokens.
CPU (no CUDA): gloo with the CPU shims and a tiny fp32 model, for testing the script.

No timing is asserted; the exit status is 1 only if the parity of the two variants is outside
its bound. The JSON (``--out``) is rewritten after every phase, so a run cut short keeps what
it measured.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# `python scripts/bench_ppo.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.reports import DefaultsHelpFormatter

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# GPU defaults: Qwen3-1.7B-like shape (learned positions, LayerNorm, GeLU MLP of Megatron's local
# spec), vocab 151936. CPU defaults: tiny, fp32, seconds.
_GPU_DEFAULTS = {
    "layers": 28,
    "hidden": 2048,
    "heads": 16,
    "ffn": 6144,
    "vocab": 151936,
    "micro_batch_tokens": 8192,
    "num_seqs": 48,
    "prompt_len": (128, 512),
    "response_len": (256, 1024),
    "dtype": "bfloat16",
    "rollouts": 2,
    "probe_seq_len": 2048,
}
_CPU_DEFAULTS = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "ffn": 128,
    "vocab": 1000,
    "micro_batch_tokens": 96,
    "num_seqs": 8,
    "prompt_len": (4, 12),
    "response_len": (8, 32),
    "dtype": "float32",
    "rollouts": 2,
    "probe_seq_len": 32,
}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _default(key: str) -> str:
    gpu, cpu = _GPU_DEFAULTS[key], _CPU_DEFAULTS[key]
    show = lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return f" (default: {show(gpu)} on a GPU, {show(cpu)} on the CPU)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; unset sizes take the GPU or CPU defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: world / cp)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (inside the model)")
    parser.add_argument(
        "--cp-at-head", action="store_true", help="CP at the head only (the decoder sees whole sequences)"
    )
    parser.add_argument(
        "--sp", dest="sp", action="store_true", default=None, help="sequence parallelism (default: on when tp > 1)"
    )
    parser.add_argument(
        "--no-sp", dest="sp", action="store_false", help="sequence parallelism off (default: on when tp > 1)"
    )
    parser.add_argument("--layers", type=int, help="decoder layers" + _default("layers"))
    parser.add_argument("--hidden", type=int, help="hidden size" + _default("hidden"))
    parser.add_argument("--heads", type=int, help="attention heads" + _default("heads"))
    parser.add_argument("--ffn", type=int, help="MLP hidden size" + _default("ffn"))
    parser.add_argument("--vocab", type=int, help="vocab size (padded up to a multiple of tp)" + _default("vocab"))
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="packed (padded) tokens per micro-batch, at most" + _default("micro_batch_tokens"),
    )
    parser.add_argument("--num-seqs", type=int, help="sequences per rollout" + _default("num_seqs"))
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="prompt lengths" + _default("prompt_len")
    )
    parser.add_argument(
        "--response-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="response lengths" + _default("response_len")
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype" + _default("dtype"))
    parser.add_argument(
        "--rollouts", type=int, help="rollouts warmed and timed per variant (one PPO step each)" + _default("rollouts")
    )
    parser.add_argument("--new-shape-rollouts", type=int, default=1, help="fresh-length rollouts per variant")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="policy updates per rollout")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument(
        "--entropy-coeff", type=float, default=1e-3, help="entropy bonus (both variants differentiate it)"
    )
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    parser.add_argument("--backend", default="auto", help="fused head backend")
    parser.add_argument("--attention", choices=["reference", "sdpa"], default="sdpa", help="core attention without TE")
    parser.add_argument("--variants", default="fused,logits", help="comma-separated (timed A B B A)")
    parser.add_argument(
        "--long-context", type=_int_list, default=[], help="sequence lengths, one sequence per micro-batch"
    )
    parser.add_argument("--max-micro-batch", type=_int_list, default=[], help="micro-batch sizes to try (one rank)")
    parser.add_argument(
        "--probe-seq-len",
        type=int,
        help="sequence length filling the --max-micro-batch micro-batches" + _default("probe_seq_len"),
    )
    parser.add_argument("--skip-timing", action="store_true", help="only the memory measurements asked for")
    parser.add_argument("--profile", action="store_true", help="GPU kernel time of one step per variant, by category")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the model and rollouts")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON (default: $OUT, else none)")
    args = parser.parse_args(argv)
    defaults = _GPU_DEFAULTS if torch.cuda.is_available() else _CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - {"fused", "logits"})
    if unknown or not args.variants:
        parser.error(f"--variants takes fused and/or logits, got {args.variants}")
    if args.cp > 1 and not args.cp_at_head and args.attention != "sdpa":
        parser.error("CP inside the model needs --attention sdpa (or --cp-at-head)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run what the arguments ask; returns the exit status (1: parity outside its bound)."""
    args = parse_args(argv)
    from mcore_ppo_testing.ppo_harness import init_distributed

    device = init_distributed()

    import megatron.core

    from mcore_ppo.actor import PPOActorConfig
    from mcore_ppo.actor.batching import padded_length
    from mcore_ppo_testing import ppo_bench, ppo_bench_memory, ppo_profile
    from mcore_ppo_testing.ppo_harness import build_actor_model, destroy_layout, init_layout, te_available

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
    parallel = init_layout(tp, cp, 1, cp_at_head=args.cp_at_head)
    dp = world // (tp * cp)
    vocab = math.ceil(args.vocab / tp) * tp  # Megatron's output layer needs V divisible by tp
    align = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    longest = max([args.prompt_len[1] + args.response_len[1], *args.long_context, args.probe_seq_len])
    model_cfg = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "ffn_hidden_size": args.ffn,
        "vocab_size": vocab,
        "max_sequence_length": padded_length(longest, align),
    }
    attention = "TransformerEngine" if te_available() else args.attention
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
    bench = ppo_bench.Bench(model, actor_cfg, parallel, args.lr, device, args.vocab, args.ppo_epochs)

    name = f"TP{tp}" + ("+SP" if sp else "")
    if cp > 1:
        name += f" × CP{cp} ({'at the head' if args.cp_at_head else 'in the model'})"
    if dp > 1:
        name += f" × DP{dp} (replicas of the same data)"
    n_params = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())
    gpu_name = torch.cuda.get_device_name() if cuda else "CPU"
    say(f"bench_ppo: {world} ranks ({gpu_name}, {'NCCL' if cuda else 'gloo'}), layout {name}")
    say(
        f"model: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, ffn {args.ffn}, "
        f"vocab {args.vocab}, {args.dtype}, {n_params / 1e6:,.1f}M parameters; head backend {args.backend}, "
        f"T={args.temperature}; attention {attention}"
    )
    tag = f"tp{tp}_cp{cp}{'_sp' if sp else ''}{'_head' if args.cp_at_head else ''}_mb{args.micro_batch_tokens}"
    if args.max_micro_batch:
        tag = f"max_micro_batch_tp{tp}"
    report = ppo_bench.Report(
        os.path.join(args.out, f"bench_ppo_{tag}.json") if args.out else None,
        {
            "layout": {
                "name": name,
                "world": world,
                "tp": tp,
                "cp": cp,
                "dp": dp,
                "sp": sp,
                "cp_at_head": args.cp_at_head,
            },
            "device": gpu_name,
            "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", None),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "model": {**model_cfg, "params_dtype": args.dtype, "parameters": n_params, "attention": attention},
        },
    )

    ok = True
    if not args.skip_timing and not args.max_micro_batch:
        ok = _timing(args, bench, report, say, dtype, cuda)
    if args.profile:
        rollout = ppo_bench.rollouts_for(
            count=1, seed=args.seed + 1, num_seqs=args.num_seqs, vocab=args.vocab, prompt_len=args.prompt_len,
            response_len=args.response_len, device=device,
        )[0]  # fmt: skip
        report.add("profile", ppo_profile.profile_step(bench, rollout, args.variants, say))
    if args.long_context:
        say(f"long context ({name}): one sequence per micro-batch, a warm step then a timed one")
        rows = ppo_bench_memory.long_context(bench, args.long_context, args.variants, args.seed + 1000, say)
        report.add("long_context", rows)
    if args.max_micro_batch:
        say(f"largest micro-batch on one GPU: sequences of {args.probe_seq_len} tokens, log-prob pass + 1 update")
        largest = ppo_bench_memory.max_micro_batch(
            bench, args.max_micro_batch, args.variants, args.probe_seq_len, args.seed + 2000, say
        )
        report.add("max_micro_batch", largest)
        for variant, r in largest.items():
            best = r["largest"]
            say(
                f"  {variant}: largest micro-batch {best['micro_batch_tokens'] if best else 'none'} tokens"
                + (f", {best['tokens_per_s']:,.0f} tokens/s" if best else "")
            )
    if report.path:
        say(f"wrote {report.path}")
    destroy_layout()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _timing(args, bench, report, say, dtype, cuda) -> bool:
    """Parity, the warmed A B B A timing, and the new-shape steps; returns the parity verdict."""
    from mcore_ppo_testing import ppo_bench

    common = {
        "num_seqs": args.num_seqs,
        "vocab": args.vocab,  # token ids from the real vocab; the padding rows are never labels
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "device": bench.device,
    }
    rollouts = ppo_bench.rollouts_for(count=args.rollouts, seed=args.seed + 1, **common)
    tokens = [int(r.tokens.numel()) for r in rollouts]
    say(
        f"rollouts: {args.rollouts} of {args.num_seqs} sequences (prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"response {args.response_len[0]}-{args.response_len[1]}; {', '.join(map(str, tokens))} tokens), "
        f"micro-batches of ≤ {args.micro_batch_tokens} packed tokens, {args.ppo_epochs} updates per step"
    )
    parity = ppo_bench.parity(bench, rollouts[0], dtype)
    report.add("parity", parity)
    say(
        f"parity (fused vs logits, same parameters, {parity['response_tokens']} response tokens): max|Δlog_prob| "
        f"{parity['max_abs_d_log_prob']:.2e} (bound {parity['bound_log_prob']:.1e}), max|Δentropy| "
        f"{parity['max_abs_d_entropy']:.2e} (bound {parity['bound_entropy']:.1e}) -> "
        f"{'OK' if parity['ok'] else 'OUTSIDE THE BOUND'}"
    )
    say(
        "timing: every variant warmed on every rollout, then timed passes "
        + " ".join(args.variants + list(reversed(args.variants)))
    )
    results = ppo_bench.warmed_timing(bench, rollouts, args.variants, say)
    report.add("variants", results)
    # Fresh lengths per variant: seeds no other step used, different for each variant.
    fresh = {
        v: ppo_bench.rollouts_for(count=args.new_shape_rollouts, seed=args.seed + 500 + 100 * i, **common)
        for i, v in enumerate(args.variants)
    }
    new_shapes = ppo_bench.new_shape_timing(bench, fresh, results, say)
    report.add("new_shapes", new_shapes)
    lines = [*ppo_bench.table(results, args.ppo_epochs), "", *ppo_bench.ratio_lines(results, cuda)]
    for v, r in new_shapes.items():
        lines.append(
            f"{v}: new-shape step / seen-shape median = {', '.join(f'{x:.2f}' for x in r['ratio_to_seen_median'])}"
        )
    report.add("table", "\n".join(lines))
    say(f"\nmedians over {2 * args.rollouts} timed steps per variant (slowest rank per step):")
    say("\n".join(lines))
    return bool(parity["ok"])


if __name__ == "__main__":
    sys.exit(main())
