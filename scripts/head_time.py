#!/usr/bin/env python
"""GPU time and idle-GPU time of the head's calls against one GEMM, per shard: for A/B runs of two trees.

For each shape and TP size (one rank's shard ``V/tp``; bf16, ``--tokens`` tokens, every label
valid, T = 0.7, the default ``triton`` backend, ``validate=False`` unless ``--validate``) it
times with CUDA events, medians of ``--reps`` calls after warm-up: one GEMM ``x @ W.T``, the
no-grad forward, the forward that keeps its graph (its backward is not run) and forward +
backward, each twice: with the host's work queued behind a GPU spin (``gpu``: the GPU's time,
as inside a model step) and from an idle GPU (``idle``: the host's work before the first kernel
counted). Ratios are to one GEMM's GPU time, and the idle times also to the GEMM's from idle
(``*_idle_x_gemm_idle``: an idle GPU's clock ramps during the call, which the GEMM's own idle
time carries too). Lighter than ``bench_head.py`` (no peers, no fp64 reference, no memory): it
is meant to run the same measurement on two checkouts in one device call, in A B B A order (copy
it into the other checkout's ``scripts/``: it imports the ``mcore_ppo`` beside it).

Usage (GPU):  python scripts/head_time.py [--shards qwen7b:1,qwen7b:8,v262k:1] [--reps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.bench import SHAPES, event_times, make_inputs, ours


def _median(fn, reps: int, *, hidden: bool, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_times(fn, reps, hide_host_latency=hidden))


def measure(shape: str, tp: int, tokens: int, reps: int, validate: bool = False) -> dict:
    """The timings of one shard (module doc), in ms."""
    h, vocab = SHAPES[shape]
    inputs = make_inputs(tokens, h, vocab // tp, torch.Generator(device="cuda").manual_seed(0))
    head = ours("triton", validate=validate)
    x, w, labels = inputs.x, inputs.w, inputs.labels
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def gemm():
        with torch.no_grad():
            return x @ w.t()

    def nograd():
        with torch.no_grad():
            return head(x, w, labels, 0.7)

    def forward():
        return head(xg, wg, labels, 0.7)

    def step():
        xg.grad = wg.grad = None
        torch.autograd.backward(list(head(xg, wg, labels, 0.7)), [inputs.g, inputs.e])

    out: dict[str, object] = {
        "shape": shape,
        "tp": tp,
        "h": h,
        "v": vocab // tp,
        "tokens": tokens,
        "validate": validate,
    }
    for name, fn, n in (("gemm", gemm, reps), ("nograd", nograd, reps), ("forward", forward, reps)):
        out[f"{name}_gpu_ms"] = _median(fn, n, hidden=True)
        out[f"{name}_idle_ms"] = _median(fn, n, hidden=False)
    out["step_gpu_ms"] = _median(step, max(3, reps // 2), hidden=True)
    gemm_ms = out["gemm_gpu_ms"]
    for key in ("nograd_gpu", "nograd_idle", "forward_gpu", "forward_idle", "gemm_idle"):
        out[f"{key}_x_gemm"] = out[f"{key}_ms"] / gemm_ms
    # From idle against the GEMM from idle: both start on the same clock (an idle GPU's clock
    # ramps during a call: the GEMM alone from idle takes up to 1.2x its GPU time).
    for key in ("nograd", "forward"):
        out[f"{key}_idle_x_gemm_idle"] = out[f"{key}_idle_ms"] / out["gemm_idle_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="qwen7b:1,qwen7b:4,qwen7b:8,v262k:1,v262k:8", help="shape:tp list")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=10, help="calls per median (forward + backward: half)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results")
    parser.add_argument(
        "--validate", action="store_true", help="the API's default validate=True (a checkout whose checks never sync)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("head_time.py needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for shard in args.shards.split(","):
        shape, tp = shard.split(":")
        results.append(measure(shape, int(tp), args.tokens, args.reps, args.validate))
        row = results[-1]
        print(
            f"{shape} tp{tp}: gemm {row['gemm_gpu_ms']:.3f} ms; nograd gpu {row['nograd_gpu_x_gemm']:.4f}x "
            f"idle {row['nograd_idle_x_gemm']:.4f}x; forward gpu {row['forward_gpu_x_gemm']:.4f}x "
            f"idle {row['forward_idle_x_gemm']:.4f}x (over the GEMM from idle: nograd "
            f"{row['nograd_idle_x_gemm_idle']:.4f}x, forward {row['forward_idle_x_gemm_idle']:.4f}x); "
            f"step {row['step_gpu_ms']:.3f} ms",
            flush=True,
        )
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
