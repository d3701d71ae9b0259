#!/usr/bin/env python
"""The warp-specialised Hopper forward (issue 14) beside ``stats_kernel`` and the cuBLAS GEMM.

Per shape (per-rank shard, bf16, N tokens, T, a fraction of ignored labels): the no-grad
statistics of the triton backend with its portable ``stats_kernel`` and with each
warp-specialised configuration (``--ws split_tiles,group_m,a_stages,b_stages,lag[,block_k];...``), and
one ``x @ W.T`` GEMM, timed in rounds whose order rotates (no variant always first or warmest);
medians over rounds of per-round medians. Every variant's log-prob and entropy are checked
against a float64 reference of all tokens (normwise relative error) before it is timed.

    python scripts/bench_ws_forward.py [--shapes qwen7b:1,qwen7b:8] [--smoke] [--out DIR]

``--smoke``: small shapes (ragged V and h, ignored rows, fewer rows than one CTA's 256), all
configurations, correctness only; exit 1 on any error over the bound. Writes
``<out>/bench_ws_forward.json``.
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

from mcore_ppo.backends.hopper_ws import WsConfig
from mcore_ppo.backends.triton_backend import TritonBackend
from mcore_ppo_testing.bench import SHAPES, fp64_reference, make_inputs, rel_err, time_ms
from parallel.combine import combine_shard_statistics

DEFAULT_WS = "1,8,3,8,3;1,8,3,8,0;1,8,3,8,5;2,8,4,6,3;1,8,2,3,1,128;2,8,2,3,2,128"
SMOKE_SHAPES = [(300, 200, 1000), (513, 264, 4093), (128, 4096, 777), (1024, 3584, 2376)]
ERROR_BOUND = 2e-5  # log-prob and entropy, normwise relative, against fp64 (the kernel's is ~4e-6)


def parse_ws(spec: str) -> dict[str, WsConfig]:
    configs = {}
    for item in filter(None, spec.split(";")):
        split, group, a, b, lag, *bk = (int(v) for v in item.split(","))
        configs[f"ws[{item}]"] = WsConfig(
            split_tiles=split, group_m=group, a_stages=a, b_stages=b, lag=lag, block_k=bk[0] if bk else 64
        )
    return configs


def head_outputs(backend: TritonBackend, x, w, labels, temperature):
    valid = labels != -100
    local = torch.where(valid, labels, -1)
    with torch.no_grad():
        stats = backend.shard_statistics(x, w, local, valid, temperature)
        lse, ent, label_logit = combine_shard_statistics(*stats.tensors(), None)
    logp = torch.where(valid, label_logit - lse, 0.0)
    return logp, torch.where(valid, ent, 0.0)


def run_shape(n, h, v, variants, args, generator, timed=True) -> dict:
    inputs = make_inputs(n, h, v, generator, ignored_fraction=args.ignored)
    x, w, labels = inputs.x, inputs.w, inputs.labels
    ref_logp, ref_ent, _, _ = fp64_reference(inputs, args.temperature, need_grads=False)
    row = {"n": n, "h": h, "v": v, "errors": {}, "ms": {}}
    ok = True
    for name, backend in variants.items():
        logp, ent = head_outputs(backend, x, w, labels, args.temperature)
        torch.cuda.synchronize()
        err = (rel_err(logp, ref_logp), rel_err(ent, ref_ent))
        row["errors"][name] = err
        ok &= all(e is not None and e <= ERROR_BOUND for e in err)
        print(f"  {name:<22} logp err {err[0]:.2e}  entropy err {err[1]:.2e}", flush=True)
    row["ok"] = ok
    if not timed:
        return row
    calls = {name: (lambda b=b: head_outputs(b, x, w, labels, args.temperature)) for name, b in variants.items()}
    calls["gemm"] = lambda: torch.mm(x, w.t())
    names = list(calls)
    per_round = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            per_round[name].append(time_ms(calls[name], args.reps, warmup=1))
    for name in names:
        row["ms"][name] = statistics.median(per_round[name])
    gemm = row["ms"]["gemm"]
    for name in names:
        print(f"  {name:<22} {row['ms'][name]:8.3f} ms  {row['ms'][name] / gemm:6.3f}x GEMM", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen7b:1,qwen7b:8,llama3-8b:8,v262k:8")
    parser.add_argument("--ws", default=DEFAULT_WS)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--ignored", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("MCORE_PPO_TEST_SEED", "0")))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    print(f"seed {args.seed} (override with --seed); {torch.cuda.get_device_name()}; torch {torch.__version__}")
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    variants = {"stats_kernel": TritonBackend(buffer_budget_bytes=0)}
    for name, config in parse_ws(args.ws).items():
        variants[name] = TritonBackend(buffer_budget_bytes=0, ws_forward=config)
    report = {"args": vars(args), "rows": []}
    out = Path(args.out) / "bench_ws_forward.json"
    ok = True
    if args.smoke:
        shapes = SMOKE_SHAPES
    else:
        shapes = []
        for item in args.shapes.split(","):
            name, tp = item.split(":")
            h, vocab = SHAPES[name]
            shapes.append((args.n, h, vocab // int(tp)))
    for n, h, v in shapes:
        print(f"n {n} h {h} V {v}", flush=True)
        start = time.time()
        row = run_shape(n, h, v, variants, args, generator, timed=not args.smoke)
        row["seconds"] = time.time() - start
        report["rows"].append(row)
        ok &= row["ok"]
        out.write_text(json.dumps(report, indent=1))
    print("PASS" if ok else f"FAIL: an error above {ERROR_BOUND}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
