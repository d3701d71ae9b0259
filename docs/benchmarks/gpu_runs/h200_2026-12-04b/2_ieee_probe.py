"""IEEE fp32 forward through cuBLAS chunks (the torch backend's pass) against cuBLAS's IEEE GEMM.

qwen7b TP 8 shard, 4,096 tokens, fp32 hidden and weight; the torch backend's forward (no grad and
with grad) at several chunk sizes; medians of CUDA-event times, warmed first, alternating order.
"""

import json
import statistics
import sys

import torch

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends import TorchBackend, TorchConfig

torch.backends.cuda.matmul.allow_tf32 = False
n, h, v = int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 3584, 152064 // 8
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, h, device="cuda", generator=gen)
w = torch.randn(v, h, device="cuda", generator=gen) * 0.02
labels = torch.randint(0, v, (n,), device="cuda", generator=gen)


def timed(fn, reps=5):
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


variants = {"gemm": lambda: torch.mm(x, w.t())}
for tc, vc in ((2048, 4096), (4096, 8192), (4096, 19008), (8192, 8192)):
    be = TorchBackend(TorchConfig(token_chunk=tc, vocab_chunk=vc))
    variants[f"torch_{tc}x{vc}"] = lambda be=be: fused_log_probs_and_entropy(x, w, labels, backend=be, validate=False)
for fn in variants.values():
    fn()
    fn()
torch.cuda.synchronize()
ms = {k: [] for k in variants}
for r in range(4):
    names = list(variants) if r % 2 == 0 else list(reversed(variants))
    for k in names:
        ms[k].append(timed(variants[k], 2))
res = {k: statistics.median(v) for k, v in ms.items()}
res.update({f"{k}_over_gemm": res[k] / res["gemm"] for k in variants if k != "gemm"})
print(json.dumps(res, indent=1))
