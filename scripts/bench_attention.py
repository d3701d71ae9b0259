"""Where a PPO step's cost on never-seen sequence lengths goes: core attention on new vs seen shapes.

    python scripts/bench_attention.py [--seqs 16] [--len 384 1536] [--heads 16] [--dim 128] [--out DIR]

A packed micro-batch of ``--seqs`` sequences (random lengths in ``--len``), bf16, causal,
forward + backward, timed three ways:

- ``sdpa-loop``: one ``scaled_dot_product_attention`` per sequence (the benchmark attention of the
  earlier runs), with torch's default SDPA backend choice;
- ``sdpa-loop-no-cudnn``: the same with the cuDNN SDPA backend switched off;
- ``varlen``: :class:`mcore_ppo_testing.attention.SdpaAttention`'s path, one flash varlen call.

For each: the median of 5 calls on lengths already run (seen), and of 5 first calls on fresh
lengths (new); their ratio is the per-new-shape cost. A ``torch.profiler`` table of one
new-shape call of ``sdpa-loop`` names where its time goes. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# `python scripts/bench_attention.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.attention import _plan, _segments_sdpa, _segments_varlen
from mcore_ppo_testing.reports import DefaultsHelpFormatter


def _lengths(gen: torch.Generator, args: argparse.Namespace) -> tuple[int, ...]:
    lo, hi = args.len
    lengths = torch.randint(lo, hi + 1, (args.seqs,), generator=gen).tolist()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return tuple(bounds)


def _inputs(bounds: tuple[int, ...], args: argparse.Namespace):
    total = bounds[-1]
    q, k, v = (
        torch.randn(total, args.heads, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    return q, k, v, torch.randn(total, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)


def _call(method: str, bounds: tuple[int, ...], args: argparse.Namespace) -> float:
    """Seconds of one forward + backward on fresh tensors of the given packed layout."""
    q, k, v, grad = _inputs(bounds, args)
    plan = _plan(bounds, 1, 0)
    scale = args.dim**-0.5
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if method == "varlen":
        out = _segments_varlen(q, k, v, plan, scale)
    elif method == "sdpa-loop-no-cudnn":
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = _segments_sdpa(q, k, v, plan, scale, 0.0)
    else:
        out = _segments_sdpa(q, k, v, plan, scale, 0.0)
    out.backward(grad)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16, help="sequences per packed batch")
    parser.add_argument(
        "--len",
        type=int,
        nargs=2,
        default=(384, 1536),
        metavar=("MIN", "MAX"),
        help="sequence lengths drawn from [MIN, MAX]",
    )
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--dim", type=int, default=128, help="head dimension")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per path and shape set")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the lengths and data")
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for the JSON report (default: $OUT, else none)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs CUDA", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"bench_attention: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.seqs} sequences of "
        f"{args.len[0]}-{args.len[1]} tokens, {args.heads} heads × {args.dim}, bf16, causal, forward + backward; "
        f"cuDNN SDPA enabled: {torch.backends.cuda.cudnn_sdp_enabled()}"
    )
    # Warm every method's kernels once on an unrelated layout (first-launch costs are not the point).
    warm = _lengths(gen, args)
    methods = ("sdpa-loop", "sdpa-loop-no-cudnn", "varlen")
    for method in methods:
        _call(method, warm, args)
    results = {}
    # Interleave the methods so none runs on a quieter machine.
    seen_layout = _lengths(gen, args)
    for method in methods:
        _call(method, seen_layout, args)
    seen = {m: [] for m in methods}
    new = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:
            seen[method].append(_call(method, seen_layout, args))
            new[method].append(_call(method, _lengths(gen, args), args))
    for method in methods:
        s, n = statistics.median(seen[method]), statistics.median(new[method])
        results[method] = {"seen_ms": 1e3 * s, "new_ms": 1e3 * n, "new_over_seen": n / s}
        print(f"  {method:<20} seen lengths {1e3 * s:8.2f} ms   new lengths {1e3 * n:8.2f} ms   new/seen {n / s:6.2f}")

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        _call("sdpa-loop", _lengths(gen, args), args)
    profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print("profile of one sdpa-loop call on new lengths (top 15 by self CPU time):")
    print(profile)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump(
                {"args": vars(args), "torch": torch.__version__, "results": results, "profile": profile}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
