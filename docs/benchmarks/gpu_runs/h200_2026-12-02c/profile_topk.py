"""One ``fused_topk`` call per configuration under torch.profiler (CPU and CUDA): its kernel
table and wall time per call (bf16, n 16,384, h 3584). The "host (GPU kept busy)" figure in the
logs is not a measure of host work: the call syncs once, so it includes the queued sleep."""

import math
import sys
import time

import torch

sys.path.insert(0, ".")
from mcore_ppo.distill.topk import fused_topk

g = torch.Generator(device="cuda").manual_seed(0)
n, h = 16384, 3584
x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
wf = (torch.randn(262144, h, device="cuda", generator=g) * (2 / math.sqrt(h))).to(torch.bfloat16)
for vocab, tp, k in [(151936, 8, 8), (151936, 8, 128), (151936, 1, 64)]:
    w = wf[: vocab // tp]

    def call(w=w, k=k):
        return fused_topk(x, w, k, impl="triton")

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda._sleep(int(50e6))
    t0 = time.perf_counter()
    call()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        call()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka) / 1e3
    print(
        f"== V {vocab} tp {tp} k {k}: wall {wall:.2f} ms/call, GPU busy {busy:.2f} ms, "
        f"host (GPU kept busy) {host:.2f} ms"
    )
    print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
