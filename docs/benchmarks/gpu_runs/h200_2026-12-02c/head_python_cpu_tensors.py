"""The head's Python with CPU tensors under TRITON_INTERPRET=1, its kernel launches replaced by
no-ops: the host cost of everything but launches, medians of back-to-back calls."""

import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.getcwd())
import torch

import mcore_ppo.backends.triton_backend as tb
import mcore_ppo.backends.triton_host as th

calls = [0]


def noop(kernel, grid, args, kwargs, site=None):
    calls[0] += 1


tb.launch = noop
th.launch = noop
from mcore_ppo import fused_log_probs_and_entropy  # noqa: E402  (after the launch patch)

n, h, v = int(os.environ.get("N", 2048)), 64, 4096
x = torch.randn(n, h, dtype=torch.bfloat16).requires_grad_(True)
w = torch.randn(v, h, dtype=torch.bfloat16).requires_grad_(True)
labels = torch.randint(0, v, (n,))


def call():
    return fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend="triton", validate=False)


def nograd():
    with torch.no_grad():
        call()


def fwd():
    out = call()
    del out


def py_floor():
    # calibration: a loop of trivial Python calls
    def f(a):
        return a

    for i in range(1000):
        f(i)


for fn in (nograd, fwd):
    for _ in range(20):
        fn()


def med(fn, reps=200):
    t = []
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e6


empty_us = med(lambda: torch.empty(n, dtype=torch.float32))
print(f"calib 1000 py calls: {med(py_floor):.1f} us; torch.empty: {empty_us:.2f} us")
c0 = calls[0]
nograd()
print("launches/nograd", calls[0] - c0)
c0 = calls[0]
fwd()
print("launches/fwd", calls[0] - c0)
print(f"nograd {med(nograd):.1f} us  fwd(+free) {med(fwd):.1f} us")
if os.environ.get("PROF"):
    p = cProfile.Profile()
    for _ in range(200):
        p.enable()
        (fwd if os.environ["PROF"] == "fwd" else nograd)()
        p.disable()
    st = pstats.Stats(p)
    st.sort_stats("tottime").print_stats(25)
