"""Host cost of primitives on this machine (GPU kept busy)."""

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl

from mcore_ppo.backends.triton_launch import launch


@triton.jit
def k1(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a.new_empty(a.shape), None

    @staticmethod
    def backward(ctx, g, h):
        return g, None


def med(fn, reps=300):
    t = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    torch.cuda.synchronize()
    return statistics.median(t) * 1e6


x = torch.randn(4096, device="cuda")
y = torch.empty_like(x)
xr = x.clone().requires_grad_(True)
launch(k1, (4,), (x, y, 4096), {"BLOCK": 1024}, ("k1",))
launch(k1, (4,), (x, y, 4096), {"BLOCK": 1024}, ("k1",))


def py_floor():
    def f(a):
        return a

    for i in range(1000):
        f(i)


print(f"calib 1000 py calls: {med(py_floor):.1f} us")
print(f"torch.empty 16384 f32: {med(lambda: torch.empty(16384, device='cuda')):.2f} us")
print(f"5x torch.empty: {med(lambda: [torch.empty(16384, device='cuda') for _ in range(5)]):.2f} us")
print(f"launch(site) raw: {med(lambda: launch(k1, (4,), (x, y, 4096), {'BLOCK': 1024}, ('k1',))):.2f} us")
print(f"k1[grid] normal: {med(lambda: k1[(4,)](x, y, 4096, BLOCK=1024)):.2f} us")
print(f"Function.apply(grad): {med(lambda: Ident.apply(xr, None)):.2f} us")
print(f"x.view(-1): {med(lambda: x.view(-1)):.2f} us  x.t(): {med(lambda: x.t()):.2f}")
print(f"x.zero_(): {med(lambda: x.zero_()):.2f} us")
