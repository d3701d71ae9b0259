"""The ``triton`` backend on CUDA with a per-token temperature tensor and with the entropy off,
at a realistic shape (bf16, n = 4096, h = 1024, V = 32768), against float64 (marked ``gpu``).

Run on the lent H200 (``pytest tests/gpu/test_gpu_options.py -m gpu``); skipped without CUDA.
Errors are norm-wise relative against an fp64 reference on the GPU from the same bf16 inputs
and the same per-token temperatures. Bounds as in ``test_gpu_kernels.py``: outputs 1e-5 (fp32
statistics), gradients 5e-3 (``dz`` rounded to bf16 before the cuBLAS GEMMs). A tensor of one
value is bit for bit the float; the entropy-off call's log-probs and gradients are bit for bit
the entropy-on call's with its entropy unused.
"""

from __future__ import annotations

import math

import pytest
import torch

import mcore_ppo
from mcore_ppo_testing.reference import normwise_relative_error, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 4096, 1024, 32768
rel = normwise_relative_error


def make(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=gen) * (2 / math.sqrt(H))).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)
    labels[torch.rand(N, device="cuda", generator=gen) < 0.3] = -100
    g = torch.randn(N, device="cuda", generator=gen)
    e = torch.randn(N, device="cuda", generator=gen)
    temperature = 0.3 + 1.7 * torch.rand(N, device="cuda", generator=gen)
    return x, w, labels, g, e, temperature


def run(x, w, labels, g, e, temperature, *, budget: int, return_entropy: bool = True, use_entropy: bool = True):
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig

    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    logp, ent = mcore_ppo.fused_log_probs_and_entropy(
        xg,
        wg,
        labels,
        temperature=temperature,
        backend=TritonBackend(TritonConfig(buffer_budget_bytes=budget)),
        return_entropy=return_entropy,
    )
    outs, grads = [logp], [g]
    if ent is not None and use_entropy:
        outs.append(ent)
        grads.append(e)
    torch.autograd.backward(outs, grads)
    torch.cuda.synchronize()
    return logp.detach(), None if ent is None else ent.detach(), xg.grad, wg.grad


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "no-entropy"])
def test_per_token_temperature_against_fp64(budget, return_entropy):
    x, w, labels, g, e, temperature = make()
    logp, ent, dh, dw = run(x, w, labels, g, e, temperature, budget=budget, return_entropy=return_entropy)
    ref = reference(x, w, labels, temperature, g, e if return_entropy else None, rows_per_chunk=512, with_terms=False)
    valid = labels != -100
    errs = {"log_prob": rel(logp[valid], ref["log_prob"][valid]), "d_hidden": rel(dh, ref["d_hidden"])}
    errs["d_weight"] = rel(dw, ref["d_weight"])
    if return_entropy:
        errs["entropy"] = rel(ent[valid], ref["entropy"][valid])
    else:
        assert ent is None
    print(errs)
    assert errs["log_prob"] <= 1e-5 and errs.get("entropy", 0.0) <= 1e-5
    assert errs["d_hidden"] <= 5e-3 and errs["d_weight"] <= 5e-3


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
def test_constant_tensor_is_the_float_and_entropy_off_is_entropy_unused(budget):
    x, w, labels, g, e, _ = make(1)
    by_float = run(x, w, labels, g, e, 0.7, budget=budget)
    by_tensor = run(x, w, labels, g, e, torch.full((N,), 0.7, device="cuda"), budget=budget)
    for a, b in zip(by_float, by_tensor, strict=True):
        assert torch.equal(a, b)
    off = run(x, w, labels, g, e, 0.7, budget=budget, return_entropy=False)
    unused = run(x, w, labels, g, e, 0.7, budget=budget, use_entropy=False)
    assert off[1] is None
    for i in (0, 2, 3):
        assert torch.equal(off[i], unused[i])


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("ids", [False, True], ids=["label", "k-ids"])
def test_sum_pi_squared_against_fp64_and_the_other_outputs_unchanged(budget, return_entropy, ids):
    """Σπ² from the triton kernels (its Q_PLANE) against the fp64 full softmax, within fp32 rounding;
    with it on, the log-probs, entropy and gradients are bit for bit those of the call without it."""
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig
    from mcore_ppo_testing.reference import sum_pi_squared_reference

    x, w, labels, g, _, temperature = make(2)
    if ids:  # four ids per token, one of them ignored in some tokens
        gen = torch.Generator(device="cuda").manual_seed(3)
        labels = torch.randint(0, V, (N, 4), device="cuda", generator=gen)
        labels[:, 3][torch.rand(N, device="cuda", generator=gen) < 0.5] = -100
        g = torch.randn(N, 4, device="cuda", generator=gen)
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget))
    results = []
    for with_q in (False, True):
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        out = mcore_ppo.fused_log_probs_and_entropy(
            xg, wg, labels, temperature=temperature, backend=backend, return_entropy=return_entropy,
            return_sum_pi_squared=with_q,
        )  # fmt: skip
        out[0].backward(g)
        torch.cuda.synchronize()
        results.append((*(None if t is None else t.detach() for t in out), xg.grad, wg.grad))
    plain, with_sum = results
    sum_pi = with_sum[2]
    assert sum_pi.dtype == torch.float32 and not sum_pi.requires_grad
    ref = sum_pi_squared_reference(x, w, labels, temperature)
    valid = (labels != -100).any(dim=-1) if ids else labels != -100
    err = rel(sum_pi[valid], ref[valid])
    print({"sum_pi_squared": err})
    assert err <= 1e-5
    assert torch.all(sum_pi[~valid] == 0)
    assert torch.all((sum_pi[valid] >= 1 / V) & (sum_pi[valid] <= 1))
    for i, j in ((0, 0), (1, 1), (3, 2), (4, 3)):  # log-probs, entropy, d_hidden, d_weight
        a, b = with_sum[i], plain[j]
        assert (a is None and b is None) or torch.equal(a, b)
