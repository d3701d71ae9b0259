"""The head's Python (CPU tensors, launches replaced by no-ops) timed in a loop and right after the
thread idled 0.1 s (sleeping, or spinning); run on the 2-core CPU machine."""

import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch

import mcore_ppo.backends.triton_backend as tb
import mcore_ppo.backends.triton_host as th


def noop(kernel, grid, args, kwargs, site=None):
    pass


tb.launch = noop
th.launch = noop
from mcore_ppo import fused_log_probs_and_entropy  # noqa: E402  (after the launch patch)

n, h, v = 2048, 64, 4096
x = torch.randn(n, h, dtype=torch.bfloat16).requires_grad_(True)
w = torch.randn(v, h, dtype=torch.bfloat16).requires_grad_(True)
labels = torch.randint(0, v, (n,))


def call():
    with torch.no_grad():
        fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend="triton", validate=False)


for _ in range(50):
    call()
hot = []
for _ in range(5):
    s = time.perf_counter()
    for _ in range(100):
        call()
    hot.append((time.perf_counter() - s) / 100 * 1e6)
cold = []
for _ in range(40):
    time.sleep(0.1)
    s = time.perf_counter()
    call()
    cold.append((time.perf_counter() - s) * 1e6)
spin_cold = []
for _ in range(40):
    t_end = time.perf_counter() + 0.1
    while time.perf_counter() < t_end:
        pass  # busy-wait like a spinning sync
    s = time.perf_counter()
    call()
    spin_cold.append((time.perf_counter() - s) * 1e6)
hot_us, sleep_us, spin_us = statistics.median(hot), statistics.median(cold), statistics.median(spin_cold)
print(f"hot loop {hot_us:.1f} us/call; after 100 ms sleep {sleep_us:.1f} us; after 100 ms busy-wait {spin_us:.1f} us")
