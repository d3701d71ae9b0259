"""Plain torch CPU ops (an allocation, an add, a view, a transpose, a copy; 20 rounds) timed in a
loop and right after the thread slept 0.1 s; run on the 2-core CPU machine."""

import statistics
import time

import torch

a = torch.randn(64)
b = torch.randn(64)


def ops():
    for _ in range(20):
        torch.empty(2048)
        (a + b).view(8, 8).t().contiguous()


for _ in range(200):
    ops()
start = time.perf_counter()
for _ in range(200):
    ops()
hot = (time.perf_counter() - start) / 200 * 1e6
cold = []
for _ in range(30):
    time.sleep(0.1)
    start = time.perf_counter()
    ops()
    cold.append((time.perf_counter() - start) * 1e6)
print(f"torch ops x20: in a loop {hot:.1f} us, after a 0.1 s sleep {statistics.median(cold):.1f} us")
