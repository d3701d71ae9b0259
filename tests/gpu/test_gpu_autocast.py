"""The head inside CUDA autocast gives what it gives outside (marked ``gpu``).

The CPU suite checks CPU autocast (``tests/test_autocast_and_double_backward.py``); this is the
same check for ``torch.autocast("cuda")`` on both per-shard backends, at a small shape.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import mcore_ppo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(x, w, labels, g, e, backend, autocast):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend=backend)
        ((logp * g).sum() + (ent * e).sum()).backward()
    return logp, ent, x.grad, w.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_autocast_changes_nothing(backend):
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 512, 256, 3000
    x = torch.randn(n, h, device="cuda", generator=gen)
    w = torch.randn(v, h, device="cuda", generator=gen) / h**0.5
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[::5] = -100
    g = torch.randn(n, device="cuda", generator=gen)
    e = torch.randn(n, device="cuda", generator=gen)
    outside = _run(x, w, labels, g, e, backend, autocast=False)
    inside = _run(x, w, labels, g, e, backend, autocast=True)
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), inside, outside, strict=True):
        assert a.dtype == b.dtype == torch.float32, name
        # Same kernels on the same inputs; cuBLAS may pick another algorithm per call, so not bitwise.
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: {(a - b).abs().max().item():.3g}"
