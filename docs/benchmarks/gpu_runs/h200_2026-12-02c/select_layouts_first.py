"""Time select_top_kernel alone on real candidates (TP 1 / TP 8 shards of V 151,936), by layout.

The first layout sweep (call 2), kept as it ran; ``same`` compares all six outputs with the first
layout's, the rest's fp32 sum included (``layout_same.py``: only that sum differs)."""

# ruff: noqa: B023  (each timing lambda is called within its own loop iteration)

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
wf = (torch.randn(151936, h, device="cuda", generator=g) * (2 / math.sqrt(h))).to(torch.bfloat16)
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


for tp, k in [(8, 8), (8, 128), (1, 64), (1, 128)]:
    w = wf[: 151936 // tp]
    T.fused_topk(x, w, k, impl="triton")
    tiles = captured["tiles"]
    width = tiles.values.shape[1]
    num_tiles = tiles.rest_m.shape[1]
    ref = None
    for block_r in (1, 2, 4, 8):
        for warps in (1, 2, 4, 8, 16):
            bw = T._next_pow2(width)
            if block_r * bw > 16384 or block_r * bw < 32 * warps:
                continue
            out = [
                torch.empty(n, k, device="cuda"),
                torch.empty(n, k, dtype=torch.int64, device="cuda"),
                torch.empty(n, num_tiles, dtype=torch.int8, device="cuda"),
                torch.empty(n, dtype=torch.int32, device="cuda"),
                torch.empty(n, device="cuda"),
                torch.empty(n, device="cuda"),
            ]
            f = lambda: select_top_kernel[(T.cdiv(n, block_r),)](
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
                BLOCK_R=block_r,
                BLOCK_W=bw,
                BLOCK_T=T._next_pow2(num_tiles),
                TOP=T._next_pow2(k),
                BY_SORT=True,
                num_warps=warps,
            )
            try:
                f()
                torch.cuda.synchronize()
            except Exception as err:
                print(f"tp {tp} k {k} R {block_r} warps {warps}: {type(err).__name__} {str(err)[:100]}")
                continue
            same = ref is None or all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
            if ref is None:
                ref = [t.clone() for t in out]
            print(f"tp {tp} k {k} W {width} R {block_r} warps {warps}: {med(f):.3f} ms same={same}", flush=True)
# host profile of one call, TP 8 k 8 (GPU kept busy; the sync's wait shows in its own line)
w = wf[: 151936 // 8]
for _ in range(3):
    T.fused_topk(x, w, 8, impl="triton")
torch.cuda.synchronize()
p = cProfile.Profile()
for _ in range(20):
    torch.cuda._sleep(20_000_000)
    p.enable()
    T.fused_topk(x, w, 8, impl="triton")
    p.disable()
    torch.cuda.synchronize()
st = io.StringIO()
pstats.Stats(p, stream=st).sort_stats("tottime").print_stats(25)
print(st.getvalue()[:6000])
# idle-GPU timing of the call phases
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(10):
    s.record()
    T.fused_topk(x, w, 8, impl="triton")
    e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
print("idle-GPU call ms", statistics.median(ts))
