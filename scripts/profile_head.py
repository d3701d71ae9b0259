#!/usr/bin/env python
"""Where the head's time goes on the GPU: a per-kernel table from ``torch.profiler``.

For each shape and TP size (per-rank shard V/tp, one GPU) it profiles a few calls of the
no-grad forward and of forward+backward of ``fused_log_probs_and_entropy`` (bf16, N tokens,
T = 0.7), and prints per phase: the wall time per call (CUDA events), the summed GPU time of
every kernel per call, the gap between the two (host latency and idle GPU), and the kernels
sorted by time. ``--buffer`` also profiles the budgeted probability buffer.

``--sweep`` instead times forward+backward (API call, CUDA events, medians of interleaved
rounds) under variants of the triton backend's settings (the TMA stores, the buffer's dz
kernel tiling; ``--sweep-forward``: the forward's tile configs), each a ``TritonConfig`` whose
``TritonBackend`` is passed to the API, to choose them by measurement.

Usage (GPU):  python scripts/profile_head.py [--shapes qwen7b] [--tp 1,8] [--buffer] [--sweep] [--out DIR]
Writes ``<out>/profile_head.json`` (or ``profile_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# `python scripts/profile_head.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.bench import SHAPES, HeadInputs, make_inputs, ours, time_ms


def kernel_table(fn, calls: int) -> dict[str, float]:
    """Summed GPU time (ms per call) of each kernel launched by ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:90]] += event.device_time / 1000.0 / calls
    return dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def seeded_inputs(h: int, v: int, n: int) -> HeadInputs:
    """bf16 inputs of one shard (N tokens, V/tp rows), the same for every call of the script."""
    return make_inputs(n, h, v, torch.Generator(device="cuda").manual_seed(0))


def head_calls(inputs: HeadInputs, temperature: float, backend: Any = "triton", **head_options):
    """Three calls on ``inputs``: the no-grad forward and the forward+backward of
    ``fused_log_probs_and_entropy`` (``backend``: a name or a backend object; ``head_options``
    passed on), and the one-GEMM floor ``x @ W.T``."""
    head = ours(backend, **head_options)
    x, w = inputs.x.requires_grad_(True), inputs.w.requires_grad_(True)

    def nograd():
        with torch.no_grad():
            head(x, w, inputs.labels, temperature)

    def step():
        x.grad = w.grad = None
        torch.autograd.backward(list(head(x, w, inputs.labels, temperature)), [inputs.g, inputs.e])

    def one_gemm():
        with torch.no_grad():
            return x @ w.t()

    return nograd, step, one_gemm


def profile_case(h: int, v: int, n: int, temperature: float, buffer: bool, calls: int) -> dict:
    inputs = seeded_inputs(h, v, n)
    from mcore_ppo.backends import TritonBackend, TritonConfig

    backend = TritonBackend(TritonConfig(buffer_budget_bytes=2**40 if buffer else 0))
    nograd, step, one_gemm = head_calls(inputs, temperature, backend)
    out = {}
    for phase, fn in (("forward_nograd", nograd), ("forward_backward", step)):
        wall = time_ms(fn, calls)
        kernels = kernel_table(fn, calls)
        busy = sum(kernels.values())
        out[phase] = {"wall_ms": wall, "kernels_ms": busy, "gap_ms": wall - busy, "kernels": kernels}
    out["one_gemm_ms"] = time_ms(one_gemm, calls)
    return out


def sweep_variants() -> dict[str, Any]:
    """Settings of the triton backend to compare (name → ``TritonConfig``)."""
    from mcore_ppo.backends.triton_config import TritonConfig

    recompute, buffer = TritonConfig(buffer_budget_bytes=0), TritonConfig(buffer_budget_bytes=2**40)
    dz = buffer.buffer_dz_config
    return {
        "recompute": recompute,
        "recompute, dz pointer stores": replace(recompute, dz_store_tma=False),
        "recompute, 1 GiB dz workspace": replace(recompute, workspace_bytes=2**30),
        "buffer": buffer,
        "buffer, pointer stores": replace(buffer, buffer_store_tma=False),
        "buffer, fp32 log2": replace(buffer, buffer_dz_config=replace(dz, fast_log2=False)),
        "buffer, dz 16 rows": replace(buffer, buffer_dz_config=replace(dz, block_m=16)),
        "buffer, dz 32 rows 8 warps": replace(buffer, buffer_dz_config=replace(dz, block_m=32, num_warps=8)),
    }


def forward_variants() -> dict[str, Any]:
    """Tile configurations of the forward kernel to compare (name → ``TritonConfig``)."""
    from mcore_ppo.backends.triton_config import GPU_FORWARD, TritonConfig

    base = GPU_FORWARD
    configs = {
        "default": base,  # 2 tiles per split whatever the shard
        "2 tiles/split": replace(base, tiles_per_split=2),
        "8 tiles/split": replace(base, tiles_per_split=8),
        "16 tiles/split": replace(base, tiles_per_split=16),
        "GROUP_M 8": replace(base, group_m=8),
        "GROUP_M 32": replace(base, group_m=32),
        "4 stages": replace(base, num_stages=4),
        "4 stages, 4 tiles/split": replace(base, num_stages=4, tiles_per_split=4),
        "1 tile/split": replace(base, tiles_per_split=1),
        "4 tiles/split": replace(base, tiles_per_split=4),
        "BLOCK_N 128": replace(base, block_n=128),
        "BLOCK_N 128, 4 tiles/split": replace(base, block_n=128, tiles_per_split=4),
        # One warpgroup per 128 x 128 tile: two programs fit one SM (registers and shared
        # memory), so one's softmax can run while the other's MMAs do.
        "BLOCK_N 128, 4 warps": replace(base, block_n=128, num_warps=4),
        "BLOCK_N 128, 4 warps, 4 tiles/split": replace(base, block_n=128, num_warps=4, tiles_per_split=4),
        "BLOCK_M 64, 4 warps, 2 stages": replace(base, block_m=64, num_warps=4, num_stages=2),
        "BLOCK_M 64": replace(base, block_m=64),
        "BLOCK_M 64, 4 warps": replace(base, block_m=64, num_warps=4),
        "BLOCK_K 128, 2 stages": replace(base, block_k=128, num_stages=2),
    }
    # "by shard": the backend's own choice (tiles per split by shard size), the others as given.
    return {"by shard": TritonConfig()} | {name: TritonConfig(forward_config=cfg) for name, cfg in configs.items()}


def sweep_case(
    h: int, v: int, n: int, temperature: float, calls: int, rounds: int = 3, forward: bool = False, only=()
) -> dict:
    """Forward+backward (or, with ``forward``, no-grad forward) medians per variant, variants
    interleaved round by round (clock drift)."""
    from mcore_ppo.backends.triton_backend import TritonBackend

    inputs = seeded_inputs(h, v, n)
    one_gemm = head_calls(inputs, temperature)[2]
    runs = {}
    variants = forward_variants() if forward else sweep_variants()
    if only:
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {list(variants)}")
        variants = {k: val for k, val in variants.items() if k in only}
    for name, config in variants.items():
        nograd, step, _ = head_calls(inputs, temperature, TritonBackend(config))
        runs[name] = nograd if forward else step
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        times["one GEMM"].append(time_ms(one_gemm, calls))
        for name, run in runs.items():
            try:
                times[name].append(time_ms(run, calls))
            except Exception as err:  # a variant that fails to compile is reported, not fatal
                times[name].append(float("nan"))
                print(f"  {name}: {type(err).__name__}: {str(err)[:200]}")
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen7b")
    parser.add_argument("--tp", default="1,8")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--buffer", action="store_true", help="also profile the budgeted probability buffer")
    parser.add_argument("--sweep", action="store_true", help="time forward+backward under setting variants")
    parser.add_argument("--sweep-forward", action="store_true", help="time the no-grad forward under tile configs")
    parser.add_argument(
        "--variants", default="", help="with --sweep / --sweep-forward: ';'-separated names (default: all)"
    )
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_head.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sweep or args.sweep_forward:
        report = {"device": torch.cuda.get_device_name(), "args": vars(args), "cases": []}
        for shape in args.shapes.split(","):
            h, vocab = SHAPES[shape]
            for tp in (int(t) for t in args.tp.split(",")):
                fwd = args.sweep_forward
                only = [name for name in args.variants.split(";") if name]
                medians = sweep_case(h, vocab // tp, args.tokens, args.temperature, args.calls, forward=fwd, only=only)
                key, gemms = ("nograd_fwd_ms", 1) if fwd else ("fwd_bwd_ms", 4)
                report["cases"].append({"shape": shape, "tp": tp, key: medians})
                gemm = medians["one GEMM"]
                print(f"== {shape} tp {tp}: {key} (ratio to {gemms} x one GEMM {gemms * gemm:.3f} ms)")
                for name, ms in medians.items():
                    print(f"  {name:32s} {ms:9.3f}  {ms / (gemms * gemm):.3f}")
                sys.stdout.flush()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "profile_sweep_forward.json" if args.sweep_forward else "profile_sweep.json"
        (Path(args.out) / name).write_text(json.dumps(report, indent=1))
        return 0
    report = {"device": torch.cuda.get_device_name(), "args": vars(args), "cases": []}
    for shape in args.shapes.split(","):
        h, vocab = SHAPES[shape]
        for tp in (int(t) for t in args.tp.split(",")):
            for buffer in (False, True) if args.buffer else (False,):
                case = profile_case(h, vocab // tp, args.tokens, args.temperature, buffer, args.calls)
                case.update(shape=shape, tp=tp, buffer=buffer)
                report["cases"].append(case)
                print(f"== {shape} tp {tp} buffer {buffer}: one GEMM {case['one_gemm_ms']:.3f} ms")
                for phase in ("forward_nograd", "forward_backward"):
                    p = case[phase]
                    print(
                        f"  {phase}: wall {p['wall_ms']:.3f} ms, kernels {p['kernels_ms']:.3f} ms, "
                        f"gap {p['gap_ms']:.3f} ms"
                    )
                    for name, ms in list(p["kernels"].items())[:14]:
                        print(f"    {ms:9.3f}  {name}")
                sys.stdout.flush()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_head.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
