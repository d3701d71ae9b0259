"""Host time of the head backward's two cuBLAS GEMMs, by torch entry point and BLAS library.

The backward's GEMMs at a TP 8 shard of a 152k vocab (bf16, n 16,384, h 3,584, V/tp 19,008):
``d_hidden = dz @ W`` with an fp32 output (``mm(..., out_dtype=float32)``) and
``d_W = dzᵀ @ x`` into a bf16 buffer (``mm(..., out=)``). Each variant: ``--calls`` calls back to
back behind one GPU spin (host time per call, as a training loop issues them), and the GPU time
per call (CUDA events around the same calls). Rounds alternate the variants' order.
"""

import argparse
import json
import statistics
import time

import torch

SPIN = 400_000_000


def host_and_gpu(fn, calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) * 1e6 / calls
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--h", type=int, default=3584)
    p.add_argument("--v", type=int, default=19008)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = torch.randn(a.n, a.v, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(a.v, a.h, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(a.n, a.h, device="cuda", generator=g).to(torch.bfloat16)
    dw = torch.empty(a.v, a.h, device="cuda", dtype=torch.bfloat16)
    dh32 = torch.empty(a.n, a.h, device="cuda", dtype=torch.float32)
    small = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    variants = {
        "d_hidden mm out_dtype fp32": lambda: torch.mm(dz, w, out_dtype=torch.float32),
        "d_hidden mm bf16": lambda: torch.mm(dz, w),
        "d_hidden addmm out_dtype fp32 beta0 out=": lambda: torch.addmm(
            dh32, dz, w, beta=0, out_dtype=torch.float32, out=dh32
        ),
        "d_W mm out= bf16": lambda: torch.mm(dz.t(), x, out=dw),
        "d_W mm bf16 new": lambda: torch.mm(dz.t(), x),
        "small mm out_dtype fp32": lambda: torch.mm(small, small, out_dtype=torch.float32),
        "empty n x h fp32": lambda: torch.empty(a.n, a.h, device="cuda", dtype=torch.float32),
    }
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "shape": vars(a), "results": {}}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        names = list(variants)
        for name in names:  # warm: heuristics, allocator
            for _ in range(3):
                variants[name]()
        host = {n: [] for n in names}
        gpu = {n: [] for n in names}
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                h_us, g_us = host_and_gpu(variants[name], a.calls)
                host[name].append(h_us)
                gpu[name].append(g_us)
        report["results"][lib] = {
            n: {"host_us": round(statistics.median(host[n]), 1), "gpu_us": round(statistics.median(gpu[n]), 1)}
            for n in names
        }
        for n in names:
            print(
                f"{lib:9s} {n:45s} host {report['results'][lib][n]['host_us']:8.1f} us  "
                f"GPU {report['results'][lib][n]['gpu_us']:9.1f} us",
                flush=True,
            )
    torch.backends.cuda.preferred_blas_library("default")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
