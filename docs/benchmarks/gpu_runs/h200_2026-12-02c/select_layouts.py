"""Time select_top_kernel alone on real candidates by layout, and one fused_topk call's phases."""

import cProfile
import io
import math
import pstats
import statistics
import sys

sys.path.insert(0, ".")
import torch

from mcore_ppo.distill import topk as T
from mcore_ppo.kernels.topk import select_top_kernel

g = torch.Generator(device="cuda").manual_seed(0)
n, h = 16384, 3584
x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
wf = (torch.randn(262144, h, device="cuda", generator=g) * (2 / math.sqrt(h))).to(torch.bfloat16)
captured = {}
orig = T._select_from_tiles


def spy(tokens, weight, tiles, c_out, temperature, cfg):
    captured["tiles"] = tiles
    return orig(tokens, weight, tiles, c_out, temperature, cfg)


T._select_from_tiles = spy


def med(fn, reps=15):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(5_000_000)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


for vocab, tp, k in [(151936, 8, 8), (151936, 8, 128), (151936, 1, 64), (151936, 1, 128), (262144, 1, 64)]:
    w = wf[: vocab // tp]
    T.fused_topk(x, w, k, impl="triton")
    tiles = captured["tiles"]
    width = tiles.values.shape[1]
    num_tiles = tiles.rest_m.shape[1]
    bw = T._next_pow2(width)
    default = max(1, min(8, bw // 512))
    for warps in sorted({default, max(1, default // 2), min(16, default * 2)}):
        out = [
            torch.empty(n, k, device="cuda"),
            torch.empty(n, k, dtype=torch.int64, device="cuda"),
            torch.empty(n, num_tiles, dtype=torch.int8, device="cuda"),
            torch.empty(n, dtype=torch.int32, device="cuda"),
            torch.empty(n, device="cuda"),
            torch.empty(n, device="cuda"),
        ]

        def f(tiles=tiles, out=out, width=width, k=k, num_tiles=num_tiles, bw=bw, warps=warps):
            select_top_kernel[(n,)](
                tiles.values,
                tiles.cols,
                tiles.rest_m,
                tiles.rest_s,
                *out,
                n,
                width,
                k,
                num_tiles,
                C=5,
                BLOCK_R=1,
                BLOCK_W=bw,
                BLOCK_T=T._next_pow2(num_tiles),
                TOP=T._next_pow2(k),
                BY_SORT=True,
                num_warps=warps,
            )

        f()
        torch.cuda.synchronize()
        mark = " (default)" if warps == default else ""
        print(f"V {vocab} tp {tp} k {k} W {width} warps {warps}{mark}: {med(f):.3f} ms", flush=True)
w = wf[: 151936 // 8]
for _ in range(3):
    T.fused_topk(x, w, 8, impl="triton")
torch.cuda.synchronize()
ts = []
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    T.fused_topk(x, w, 8, impl="triton")
    e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
print("V 151936 tp 8 k 8: idle-GPU call ms", statistics.median(ts))
p = cProfile.Profile()
for _ in range(20):
    torch.cuda._sleep(20_000_000)
    p.enable()
    T.fused_topk(x, w, 8, impl="triton")
    p.disable()
    torch.cuda.synchronize()
st = io.StringIO()
pstats.Stats(p, stream=st).sort_stats("tottime").print_stats(30)
print(st.getvalue()[:7000])
