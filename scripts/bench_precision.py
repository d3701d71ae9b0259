#!/usr/bin/env python
"""fp32 inputs through the head under each ``precision``: error against fp64 and GPU time,
beside the bf16 one-GEMM floor and cuBLAS's IEEE fp32 GEMM of the same shape, in one run.

One rank's shard (``--shape``, ``--tp``: the vocab is ``V / tp``), ``--tokens`` tokens of fp32
hidden states and an fp32 weight drawn in fp32 (not bf16 values upcast, whose products the fp16 parts
would form exactly). Timed, in the order A B C D D C B A (medians of each visit's calls,
pooled; CUDA-event GPU time, host latency hidden behind a spin):

- ``bf16_gemm``: ``x @ w.T`` of the bf16-rounded operands (cuBLAS, bf16 logits): the one-GEMM
  floor the head's bf16 forward is measured against (``scripts/bench_head.py``'s);
- ``fp32_ieee_gemm``: cuBLAS's IEEE fp32 GEMM of the fp32 operands (TF32 off);
- ``faithful``: the head's forward (a training call: inputs require grad) with
  ``precision="fp32_faithful"``;
- ``ieee``: the same with ``precision="ieee"`` (cuBLAS's GEMMs in blocks, the default route);
- ``ieee_kernels``: the same through the kernels' own IEEE dots (``ieee_gemms="kernels"``;
  fewer calls: it is slow).

Printed and written (``--out DIR``: ``bench_precision.json``): the times, ``faithful_dot``
(how ``fp32_faithful`` forms its products), and ``faithful_rel_err`` / ``ieee_rel_err`` /
``ieee_kernels_rel_err`` (the log-probs' and the entropy's largest error over the tensor's
largest fp64 value), ``faithful_over_bf16_gemm``,
``ieee_over_fp32_ieee_gemm`` and ``ieee_kernels_over_fp32_ieee_gemm``.
With ``--sweep``, ``tiles_sweep``: for each precision and a few forward and backward tiles
(:data:`SWEEP`), with the probability buffer and without (the backward recomputes the
logits), the forward's and the forward + backward's GPU time and the gradients' error against
fp64.

Usage (GPU):  python scripts/bench_precision.py [--shape qwen7b] [--tp 8] [--tokens 4096] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mcore_ppo
from mcore_ppo.backends import TritonBackend, TritonConfig
from mcore_ppo.numerics import Numerics
from mcore_ppo_testing.bench import SHAPES, event_times


def fp64_forward(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, rows: int = 1024):
    """float64 log-probs and entropy of ``softmax(x @ w.T)``, ``rows`` tokens at a time."""
    log_probs, entropies = [], []
    w64 = w.double()
    for t0 in range(0, x.shape[0], rows):
        z = x[t0 : t0 + rows].double() @ w64.t()
        logp = torch.log_softmax(z, dim=-1)
        log_probs.append(logp.gather(1, labels[t0 : t0 + rows, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(log_probs), torch.cat(entropies)


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def fp64_gradients(x, w, labels, g, e, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(d_hidden, d_weight)`` of ``Σ g·log p(label) + e·H`` over ``softmax(x @ w.T)``,
    ``rows`` tokens at a time."""
    w64 = w.double().requires_grad_(True)
    d_hidden = []
    for t0 in range(0, x.shape[0], rows):
        x64 = x[t0 : t0 + rows].double().requires_grad_(True)
        logp = torch.log_softmax(x64 @ w64.t(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        loss = (logp.gather(1, labels[t0 : t0 + rows, None])[:, 0] * g[t0 : t0 + rows]).sum()
        (loss + (entropy * e[t0 : t0 + rows]).sum()).backward()
        d_hidden.append(x64.grad)
    return torch.cat(d_hidden), w64.grad


#: ``(precision, forward tiles, backward tiles)``: ``(M, N, K before fp32 halving, stages, warps)``,
#: None for the default; the forward's tiles per split are 2 (the default's at this shard).
SWEEP = (
    ("fp32_faithful", None, None),
    ("fp32_faithful", (128, 128, 64, 2, 8), None),
    ("fp32_faithful", (128, 128, 64, 2, 8), (128, 128, 64, 2, 8)),
    ("fp32_faithful", (128, 128, 64, 2, 8), (128, 128, 32, 3, 8)),
    ("ieee", None, None),
    ("ieee", (64, 64, 32, 2, 4), None),
    ("ieee", (64, 64, 32, 2, 4), (64, 64, 32, 2, 4)),
    ("ieee", (64, 64, 32, 2, 4), (128, 64, 32, 2, 8)),
    ("ieee", (64, 64, 32, 2, 4), (64, 128, 32, 2, 4)),
)


def _sweep(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, reps: int) -> dict[str, dict]:
    """Each :data:`SWEEP` entry's forward and forward + backward GPU time (ms), with the
    probability buffer (``buffer``) and without (``recompute``: the backward recomputes the
    logits at its own tiles), and the gradients' largest error over the largest fp64 value.
    Every entry is warmed before any is timed; the entries are timed in :data:`SWEEP`'s order
    and then in reverse, and each time is the median of the two visits' medians."""
    from mcore_ppo.backends.triton_host import GemmConfig

    def gemm(tiles, **extra):
        if tiles is None:
            return None
        bm, bn, bk, stages, warps = tiles
        return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps, use_tma=True, **extra)

    gen = torch.Generator(device="cuda").manual_seed(7)
    g, e = (torch.randn(x.shape[0], device="cuda", generator=gen) for _ in range(2))
    ref_dx, ref_dw = fp64_gradients(x, w, labels, g, e)
    results: dict[str, dict] = {}
    timed: dict[str, tuple] = {}  # name -> (forward, step, calls): the entries that ran
    for precision, forward_tiles, backward_tiles in SWEEP:
        for mode, budget in (("buffer", 1 << 30), ("recompute", 0)):
            name = f"{precision} fwd {forward_tiles or 'default'} bwd {backward_tiles or 'default'} {mode}"
            config = TritonConfig(
                precision=precision, buffer_budget_bytes=budget, forward_config=gemm(forward_tiles, tiles_per_split=2),
                backward_config=gemm(backward_tiles, tiles_per_split=1), ieee_gemms="kernels",  # the tiles' own dots
            )  # fmt: skip
            backend = TritonBackend(config)
            xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

            def forward(backend=backend, xg=xg, wg=wg):
                return mcore_ppo.fused_log_probs_and_entropy(xg, wg, labels, backend=backend)

            def step(forward=forward, xg=xg, wg=wg):
                xg.grad = wg.grad = None
                torch.autograd.backward(list(forward()), [g, e])

            try:  # the first step compiles, warms and gives the gradients' error
                step()
                results[name] = {
                    "d_hidden_rel_err": relative(xg.grad, ref_dx),
                    "d_weight_rel_err": relative(wg.grad, ref_dw),
                }
                xg.grad = wg.grad = None
                forward()
                timed[name] = (forward, step, reps if precision == "fp32_faithful" or forward_tiles else 2)
            except Exception as err:  # a tile that does not fit this GPU: say so, go on
                results[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            torch.cuda.empty_cache()
    # Timed in the order A B ... B A, each visit's median, the two visits pooled (as main's).
    visits: dict[str, dict[str, list[float]]] = {name: {"forward_ms": [], "step_ms": []} for name in timed}
    torch.cuda.synchronize()
    for name in [*timed, *reversed(timed)]:
        forward, step, calls = timed[name]
        visits[name]["forward_ms"].append(statistics.median(event_times(forward, calls)))
        visits[name]["step_ms"].append(statistics.median(event_times(step, max(2, calls // 2))))
    for name, times in visits.items():
        results[name].update({key: statistics.median(values) for key, values in times.items()})
        results[name]["visits_ms"] = times
    for name, row in results.items():
        print(name, row, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen7b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10, help="calls per visit (the IEEE head: a third)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time both precisions' forward and forward + backward (buffer and recompute) at other tiles, "
        "with the gradients' error against fp64",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_precision: needs a CUDA device", file=sys.stderr)
        return 2
    h, vocab = SHAPES[args.shape]
    v = vocab // args.tp
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    x = torch.randn(args.tokens, h, device="cuda", generator=gen)
    w = torch.randn(v, h, device="cuda", generator=gen) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (args.tokens,), device="cuda", generator=gen)
    x16, w16 = x.bfloat16(), w.bfloat16()
    torch.backends.cuda.matmul.allow_tf32 = False
    heads = {
        "faithful": TritonBackend(TritonConfig(precision="fp32_faithful")),
        "ieee": TritonBackend(TritonConfig(precision="ieee")),
        "ieee_kernels": TritonBackend(TritonConfig(precision="ieee", ieee_gemms="kernels")),
    }

    def head(name: str):
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        return lambda: mcore_ppo.fused_log_probs_and_entropy(xg, wg, labels, backend=heads[name])

    calls = {
        "bf16_gemm": (lambda: torch.mm(x16, w16.t()), args.reps),
        "fp32_ieee_gemm": (lambda: torch.mm(x, w.t()), args.reps),
        "faithful": (head("faithful"), args.reps),
        "ieee": (head("ieee"), args.reps),
        "ieee_kernels": (head("ieee_kernels"), max(1, args.reps // 3)),
    }
    ref_lp, ref_ent = fp64_forward(x, w, labels)
    errors = {}
    for name in heads:
        lp, ent = calls[name][0]()
        errors[name] = {"log_prob": relative(lp, ref_lp), "entropy": relative(ent, ref_ent)}
    for fn, _ in calls.values():  # warm every variant equally before any is timed
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for name in order + order[::-1]:
        fn, reps = calls[name]
        times[name].append(statistics.median(event_times(fn, reps)))
    ms = {name: statistics.median(visits) for name, visits in times.items()}
    sweep = _sweep(x, w, labels, args.reps) if args.sweep else {}
    report = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "shape": {"model": args.shape, "tp": args.tp, "n": args.tokens, "h": h, "v": v, "seed": args.seed},
        "faithful_dot": Numerics.of(torch.float32, "fp32_faithful").dot,
        "ms": ms,
        "visits_ms": times,
        "faithful_rel_err": max(errors["faithful"].values()),
        "ieee_rel_err": max(errors["ieee"].values()),
        "ieee_kernels_rel_err": max(errors["ieee_kernels"].values()),
        "errors": errors,
        "faithful_over_bf16_gemm": ms["faithful"] / ms["bf16_gemm"],
        "ieee_over_fp32_ieee_gemm": ms["ieee"] / ms["fp32_ieee_gemm"],
        "ieee_kernels_over_fp32_ieee_gemm": ms["ieee_kernels"] / ms["fp32_ieee_gemm"],
        "fp32_ieee_gemm_over_bf16_gemm": ms["fp32_ieee_gemm"] / ms["bf16_gemm"],
        "tiles_sweep": sweep,
    }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_precision.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
