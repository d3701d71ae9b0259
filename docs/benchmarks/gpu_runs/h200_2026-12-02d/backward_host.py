"""Where the head backward's host time goes, in steady state (back to back behind one GPU spin).

N forwards are kept, then the N backwards are timed back to back; wrappers add up the host time
inside named functions. Baselines: a no-op autograd.Function's backward on CUDA tensors, and
single torch ops, timed the same way.
"""

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, ".")
from mcore_ppo import function as fn_mod
from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends import triton_backend as tb
from mcore_ppo.backends import triton_host as th
from mcore_ppo.backends import triton_launch as tl

SPIN = 400_000_000
acc = defaultdict(float)
cnt = defaultdict(int)


def wrap(mod, name, label=None):
    f = getattr(mod, name)
    label = label or f"{mod.__name__.split('.')[-1]}.{name}"

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1

    setattr(mod, name, g)


def steady(fn, calls):
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    dt = (time.perf_counter() - t) * 1e3 / calls
    torch.cuda.synchronize()
    return dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--v", type=int, default=19008)
    p.add_argument("--h", type=int, default=3584)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--instrument", action="store_true")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(a.n, a.h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(a.v, a.h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, a.v, (a.n,), device="cuda", generator=g)
    grads = [torch.randn(a.n, device="cuda", generator=g) for _ in range(2)]

    def head():
        return fused_log_probs_and_entropy(x, w, labels, temperature=0.7, validate=False)

    for _ in range(3):
        lp, ent = head()
        torch.autograd.backward([lp, ent], grads)
    torch.cuda.synchronize()
    res = {}

    def bwd_round(accumulate):
        outs = [head() for _ in range(a.calls)]
        torch.cuda.synchronize()
        if not accumulate:
            x.grad = w.grad = None

        def one(i):
            if not accumulate:
                x.grad = w.grad = None
            torch.autograd.backward(list(outs[i]), grads)

        return steady(one, a.calls)

    res["fwd_steady"] = statistics.median(steady(lambda i: head(), a.calls) for _ in range(a.rounds))
    res["bwd_steady_accumulate"] = statistics.median(bwd_round(True) for _ in range(a.rounds))
    res["bwd_steady_fresh_grads"] = statistics.median(bwd_round(False) for _ in range(a.rounds))

    # Floors: a no-op Function's backward; single ops.
    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, gr):
            return gr

    s = torch.zeros(a.n, device="cuda", requires_grad=True)
    gs = torch.ones(a.n, device="cuda")

    def noop_round():
        outs = [Noop.apply(s) for _ in range(a.calls)]
        return steady(lambda i: torch.autograd.backward([outs[i]], [gs]), a.calls)

    res["noop_function_bwd"] = statistics.median(noop_round() for _ in range(a.rounds))
    small = torch.zeros(8, device="cuda")
    res["torch_empty"] = statistics.median(
        steady(lambda i: torch.empty(a.n, a.h, device="cuda", dtype=torch.bfloat16), 50) for _ in range(a.rounds)
    )
    res["torch_add_small"] = statistics.median(steady(lambda i: small.add(1), 50) for _ in range(a.rounds))
    bb = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    res["torch_mm_small_out_fp32"] = statistics.median(
        steady(lambda i: torch.mm(bb, bb, out_dtype=torch.float32), 50) for _ in range(a.rounds)
    )

    if a.instrument:
        wrap(torch.autograd, "backward", "autograd.backward")
        wrap(fn_mod.FusedPPOHeadFunction, "_backward", "Function._backward")
        wrap(fn_mod, "_weight_grad_buffer")
        wrap(tb.TritonBackend, "shard_gradients")
        for name in ("mm_fp32", "addmm_fp32", "gathered_rows", "scatter_rows", "upstream_gradients"):
            if hasattr(tb, name):
                wrap(tb, name)
        wrap(tb, "_inverse_temperature")
        wrap(tb, "launch", "triton_backend.launch")
        wrap(th, "launch", "triton_host.launch")
        acc.clear()
        cnt.clear()
        calls = 0
        for _ in range(a.rounds):
            bwd_round(True)
            calls += a.calls
        acc.clear()
        cnt.clear()
        total = 0.0
        for _ in range(a.rounds):
            total += bwd_round(True) * a.calls
            calls = a.calls * a.rounds
        res["instrumented_bwd_ms"] = total / calls
        res["inside_us_per_bwd"] = {k: round(acc[k] * 1e6 / calls, 1) for k in sorted(acc, key=lambda k: -acc[k])}
        res["calls_per_bwd"] = {k: cnt[k] / calls for k in cnt}
    res["launch_count"] = tl.launch_count() if hasattr(tl, "launch_count") else None
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
