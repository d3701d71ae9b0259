"""verl's vocab-parallel entropy (the benchmark's logits path) on one rank, against fp64 autograd.

Multi-rank (TP, CP) parity of the whole logits path with the fused head through the PPO actor
is in ``tests/distributed/test_logits_path_parity.py``.
"""

from __future__ import annotations

import pytest
import torch

from mcore_ppo_testing.logits_path import vocab_parallel_entropy
from mcore_ppo_testing.seeds import next_seed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_and_gradient_match_fp64_autograd(dtype):
    gen = torch.Generator().manual_seed(next_seed())
    logits64 = 3.0 * torch.randn(5, 7, 50, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(5, 7, generator=gen, dtype=torch.float64)

    ref_in = logits64.clone().requires_grad_(True)
    log_p = torch.log_softmax(ref_in, dim=-1)
    ref = -(log_p.exp() * log_p).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, grad_out)

    x = logits64.to(dtype).requires_grad_(True)
    entropy = vocab_parallel_entropy(x)
    (grad,) = torch.autograd.grad(entropy, x, grad_out.to(dtype))

    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert entropy.dtype == dtype and entropy.shape == (5, 7)
    torch.testing.assert_close(entropy.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    # The backward works in place in its saved buffers (as verl's): the input comes back, to rounding.
    torch.testing.assert_close(x.detach(), logits64.to(dtype), rtol=0, atol=100 * torch.finfo(dtype).eps)
