"""Time text-edited variants of the teacher kernel (timing only: edited variants give wrong results).

As run on the H200 (reformatted for the linter): the one-per-pass kernel of
``2_one_per_pass_kernel.diff`` applied to the tree, then ``python 3_variants.py``.
"""

import importlib.util
import pathlib
import statistics
import sys

import torch

import mcore_ppo.kernels.topk as ktopk
from mcore_ppo import fused_log_probs_and_entropy, fused_topk

src = pathlib.Path(ktopk.__file__).read_text()
LOOP = "for j in range(0, tl.max(n_emit, 0)):"
FOLD = 'm_r, s_r = _fold(m_r, s_r, tl.where(emit, float("-inf"), z * LOG2E))'
assert LOOP in src and "if fill > CAP - BLOCK_N:" in src and FOLD in src
v2 = src.replace(LOOP, "for j in range(0, tl.minimum(tl.max(n_emit, 0), 0)):")
v3a = v2.replace("if fill > CAP - BLOCK_N:", "if fill > CAP * 8:")
v3b = v2.replace("if fill > CAP - BLOCK_N:", "if False:")
v4 = v3b.replace(FOLD, "m_r = tl.maximum(m_r, tl.max(z, 1))")
v5 = v4.replace(
    """        if t == 0:
            # The split's""",
    """        if t < 0:
            # The split's""",
)
variants = {
    "full": src,
    "no_append": v2,
    "no_append_compact_never": v3a,
    "no_append_no_compact": v3b,
    "max_only": v4,
    "max_only_no_first": v5,
}
mods = {}
for name, text in variants.items():
    path = pathlib.Path(f"/tmp/kv_{name}.py")
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"kv_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mods[name] = mod


def timeit(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


torch.manual_seed(0)
x = torch.randn(16384, 3584, device="cuda", dtype=torch.bfloat16)
W = torch.randn(151936, 3584, device="cuda", dtype=torch.bfloat16) * 0.02
labels = torch.randint(0, 18992, (16384,), device="cuda")
for tp, k in [(1, 8), (8, 8), (8, 64)]:
    w = W[: 151936 // tp]
    res = {"gemm_bf16": timeit(lambda w=w: torch.mm(x, w.T))}
    with torch.no_grad():
        res["head_fwd"] = timeit(lambda w=w: fused_log_probs_and_entropy(x, w, labels % w.shape[0], backend="triton"))
    for name, mod in mods.items():
        ktopk.topk_filter_kernel = mod.topk_filter_kernel
        try:
            res[name] = timeit(lambda w=w, k=k: fused_topk(x, w, k, impl="triton"))
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e)[:200]}"
    g = res["gemm_bf16"]
    cells = (f"{n} {v:.2f} ms ({v / g:.2f}x)" if isinstance(v, float) else f"{n} {v}" for n, v in res.items())
    print(f"tp {tp} k {k}: " + ", ".join(cells), flush=True)
