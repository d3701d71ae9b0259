"""Liger-Kernel's entry point (:func:`mcore_ppo.liger_log_probs_and_entropy`) on a GPU: Liger's
own CUDA path (on Hopper its CuTe DSL kernels) behind the head's checks and token order, against
float64 (marked ``gpu``).

The CPU tests (tests/backends/test_liger_entry.py) check the dispatch with a fake Liger and the
real Liger's PyTorch fallback; this is the path a user on an H100/H200 with
``liger-kernel[cutedsl]`` gets. Skipped, with the reason,
without CUDA, without liger-kernel, or on Hopper without ``nvidia-cutlass-dsl``. Tolerances are
Liger's, not the head's (docs/benchmarks: its log-prob error ~5e-5 and its entropy computed in
bf16, ~2e-3); a wrong temperature, sign, token order or ignored-token handling is far outside.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy, liger
from mcore_ppo.liger import liger_log_probs_and_entropy
from mcore_ppo_testing.reference import IGNORE_INDEX, normwise_relative_error, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TEMPERATURE = 0.7


@pytest.fixture
def liger_on_gpu():
    if not liger.is_available():
        pytest.skip("liger-kernel (with its fused linear scaled CE) is not installed")
    missing = liger._device_path_missing(torch.device("cuda", torch.cuda.current_device()))
    if missing is not None:
        pytest.skip(missing)


def make(s, b, h, v, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(s, b, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, s), device="cuda", generator=gen)
    labels[torch.rand(b, s, device="cuda", generator=gen) < 0.15] = IGNORE_INDEX
    labels[:, :7] = IGNORE_INDEX  # a prompt run in every sequence
    return hidden, weight, labels


@pytest.mark.parametrize("layout", ["tokens", "megatron"])
def test_liger_entry_matches_fp64(liger_on_gpu, layout):
    """bf16 on the GPU, ragged sizes (no dimension a multiple of a tile), ignored tokens:
    log-probs, entropy and both gradients against fp64, in the flat ``[n, h]`` layout and in
    Megatron's ``[s, b, h]`` with ``[b, s]`` labels."""
    s, b, h, v = 413, 3, 1000, 30011
    hidden, weight, labels = make(s, b, h, v, seed=1234)
    if layout == "tokens":
        hidden, labels = hidden.transpose(0, 1).reshape(b * s, h), labels.reshape(-1)
    x = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logp, ent = liger_log_probs_and_entropy(x, w, labels, temperature=TEMPERATURE)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == labels.shape
    gen = torch.Generator(device="cuda").manual_seed(99)
    g = torch.randn(labels.shape, device="cuda", generator=gen)
    e = torch.randn(labels.shape, device="cuda", generator=gen)
    torch.autograd.backward([logp, ent], [g, e])

    flat_x = hidden.float() if layout == "tokens" else hidden.transpose(0, 1).reshape(b * s, h).float()
    flat_labels = labels.reshape(-1)
    ref = reference(
        flat_x.double(), weight.double(), flat_labels, TEMPERATURE, g.reshape(-1).double(), e.reshape(-1).double(),
        with_terms=False,
    )  # fmt: skip
    ignored = flat_labels == IGNORE_INDEX
    got_logp, got_ent = logp.reshape(-1), ent.reshape(-1)
    assert (got_logp[ignored] == 0).all()
    valid = ~ignored
    assert normwise_relative_error(got_logp[valid], ref["log_prob"][valid]) < 2e-4
    assert normwise_relative_error(got_ent, ref["entropy"]) < 5e-3
    d_hidden = x.grad if layout == "tokens" else x.grad.transpose(0, 1).reshape(b * s, h)
    assert normwise_relative_error(d_hidden, ref["d_hidden"]) < 1e-2
    assert normwise_relative_error(w.grad, ref["d_weight"]) < 1e-2
    assert (d_hidden[ignored] == 0).all()


def test_liger_is_not_a_head_backend():
    """On CUDA tensors too, ``backend="liger"`` is refused by the head, naming the entry point."""
    hidden, weight, labels = make(5, 2, 64, 100, seed=7)
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        fused_log_probs_and_entropy(hidden, weight, labels, backend="liger")
