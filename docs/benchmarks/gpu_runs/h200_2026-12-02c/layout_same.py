"""Which select_top_kernel outputs depend on the launch layout (rows per program, warps)."""

import math
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
names = ("top values", "top ids", "full", "full count", "rest m", "rest s")
for tp, k in [(8, 8), (8, 128), (1, 64)]:
    T.fused_topk(x, wf[: 151936 // tp], k, impl="triton")
    tiles = captured["tiles"]
    width, num_tiles = tiles.values.shape[1], tiles.rest_m.shape[1]
    bw = T._next_pow2(width)
    outs = {}
    for block_r, warps in [(1, 1), (1, 2), (1, 4), (2, 4), (4, 8)]:
        out = [
            torch.empty(n, k, device="cuda"),
            torch.empty(n, k, dtype=torch.int64, device="cuda"),
            torch.empty(n, num_tiles, dtype=torch.int8, device="cuda"),
            torch.empty(n, dtype=torch.int32, device="cuda"),
            torch.empty(n, device="cuda"),
            torch.empty(n, device="cuda"),
        ]
        select_top_kernel[(T.cdiv(n, block_r),)](
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
        outs[(block_r, warps)] = out
    ref = outs[(1, 1)]
    for key, out in outs.items():
        diff = [name for name, a, b in zip(names, ref, out, strict=True) if not torch.equal(a, b)]
        rel = ((out[5] - ref[5]).abs() / ref[5].abs()).max().item()
        where = f"tp {tp} k {k} rows/program {key[0]} warps {key[1]}"
        print(f"{where}: differs from (1, 1) in {diff or 'nothing'}; rest s max rel diff {rel:.1e}")
