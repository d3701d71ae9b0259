"""A/B in one process: d_W into an unfilled buffer (one GEMM, overwrite) against the previous
zero-filled buffer + accumulate, in the head's backward (TP 8 and TP 1 shards of qwen7b, bf16,
16,384 tokens). Steady host time per backward (N back to back behind one spin) and GPU time of
the backward (CUDA events), A B B A order, medians."""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from mcore_ppo import function as fn_mod
from mcore_ppo import fused_log_probs_and_entropy

SPIN = 400_000_000
original = fn_mod.weight_grad_buffer


def zero_filled(weight, accumulate, backend, *, backend_writes_rows=True):
    buffer, unset = original(weight, accumulate, backend, backend_writes_rows=backend_writes_rows)
    if unset:
        return torch.zeros_like(buffer), False
    return buffer, unset


def run(v, calls):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(16384, 3584, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(v, 3584, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, v, (16384,), device="cuda", generator=g)
    grads = [torch.randn(16384, device="cuda", generator=g) for _ in range(2)]

    def head():
        return fused_log_probs_and_entropy(x, w, labels, temperature=0.7, validate=False)

    def host(mode):
        fn_mod.weight_grad_buffer = original if mode == "unset" else zero_filled
        outs = [head() for _ in range(calls)]
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN)
        t = time.perf_counter()
        for o in outs:
            torch.autograd.backward(list(o), grads)
        dt = (time.perf_counter() - t) * 1e3 / calls
        torch.cuda.synchronize()
        return dt

    def gpu(mode):
        fn_mod.weight_grad_buffer = original if mode == "unset" else zero_filled
        o = head()
        x.grad = w.grad = None
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.backward(list(o), grads)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)

    for m in ("unset", "zeros"):
        host(m)
        gpu(m)
    res = {"unset": {"host": [], "gpu": []}, "zeros": {"host": [], "gpu": []}}
    for _ in range(5):
        for m in ("unset", "zeros", "zeros", "unset"):
            res[m]["host"].append(host(m))
            res[m]["gpu"].append(gpu(m))
    fn_mod.weight_grad_buffer = original
    return {m: {k: statistics.median(vals) for k, vals in r.items()} for m, r in res.items()}


out = {}
for v, calls in ((19008, 10), (152064, 4)):
    out[v] = run(v, calls)
    print(v, json.dumps(out[v]))
