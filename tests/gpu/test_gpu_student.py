"""The student's log-probs at k ids per token (``mcore_ppo.fused_log_probs_at``) on a GPU,
against the fp64 full-vocab reference (``mcore_ppo_testing.student_reference``).

Run on the lent H200 (``pytest tests/gpu/test_gpu_student.py``); skipped without CUDA. The
``triton`` (what ``auto`` picks on CUDA) and ``torch`` backends, fp32 and bf16 inputs, a 32k
vocab over several vocab chunks, k ∈ {8, 64}, with a per-token temperature, ignored slots and
entropy. Tolerances as for the head (``tests/core/test_head_options.py``): outputs 1e-5 of the
tensor's max; gradients 1e-5 of their terms' magnitudes (bf16 + triton: 1e-2, plus the cast).
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo import fused_log_probs_at
from mcore_ppo_testing.reference import assert_close
from mcore_ppo_testing.seeds import next_seed
from mcore_ppo_testing.student_reference import student_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("k", [8, 64])
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_on_cuda(dtype, backend, k):
    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, vocab = 96, 256, 32768
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    ids = torch.randint(0, vocab, (n, k), device="cuda", generator=gen)
    ids[::5, 1:] = -100
    ids[7] = -100
    temperature = 0.5 + torch.rand(n, device="cuda", generator=gen)
    g = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float64)
    e = torch.randn(n, device="cuda", generator=gen, dtype=torch.float64)
    x = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    log_q, entropy = fused_log_probs_at(x, w, ids, temperature=temperature, backend=backend)
    ((log_q * g.float()).sum() + (entropy * e.float()).sum()).backward()
    ref = student_reference(hidden.cpu(), weight.cpu(), ids.cpu(), temperature.cpu(), g.cpu(), e.cpu())
    for name, out in (("log_q", log_q), ("entropy", entropy)):
        assert_close(out.cpu(), ref[name], name=f"student {name}", dtype=dtype, rtol=1e-5)
    triton_bf16 = backend == "auto" and dtype == torch.bfloat16
    rtol, cast = (1e-2, 8e-3) if triton_bf16 else (1e-5, 2.0**-8 if dtype == torch.bfloat16 else 0.0)
    for name, grad in (("d_hidden", x.grad), ("d_weight", w.grad)):
        assert grad.dtype == dtype
        assert_close(
            grad.cpu(),
            ref[name],
            name=f"student {name}",
            dtype=dtype,
            rtol=rtol,
            atol=1e-30,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
        )


@pytest.mark.parametrize("shard", ["whole", "one_of_8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gather_kernels_on_cuda(dtype, shard):
    """The sparse part's Triton kernels (``mcore_ppo.kernels.gather``) at n 2048, h 1024, a 32k
    shard, k 64, against fp64 on the GPU: ids drawn from a teacher-like skew (many tokens share
    ids; duplicates in rows), a tenth of the slots ignored, and for ``one_of_8`` only the slots in
    an eighth of the vocab in the shard. d_W twice: the same bits (no atomics)."""
    from mcore_ppo.distill import student as student_module

    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, v, k = 2048, 1024, 32768, 64
    x = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    skew = torch.rand(n, k, device="cuda", generator=gen) ** 3  # small ids far more often
    local = (skew * v).long().clamp(max=v - 1)
    local[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    if shard == "one_of_8":
        local = torch.where((local >= v // 8) & (local < v // 4), local - v // 8, -1)
    in_shard = local >= 0
    g = torch.where(in_shard, torch.randn(n, k, device="cuda", generator=gen), 0.0)
    rows = w.double()[local.clamp(min=0)]
    z_ref = torch.where(in_shard, torch.einsum("nkh,nh->nk", rows, x.double()), 0.0)
    dh_ref = torch.einsum("nk,nkh->nh", g.double(), rows)
    del rows
    outer = (g.double()[:, :, None] * x.double()[:, None, :]).reshape(-1, h)
    dw_ref = torch.zeros(v, h, dtype=torch.float64, device="cuda").index_add_(0, local.clamp(min=0).reshape(-1), outer)
    del outer

    z = student_module._gather_dot(x, w, local)
    d_hidden = torch.zeros(n, h, device="cuda")
    student_module._add_gathered_rows(d_hidden, w, local, g)
    d_w = torch.zeros(v, h, device="cuda")
    student_module._add_outer_by_id(d_w, x, local.clamp(min=0), in_shard, g)
    again = torch.zeros(v, h, device="cuda")
    student_module._add_outer_by_id(again, x, local.clamp(min=0), in_shard, g)
    assert torch.equal(d_w, again)
    for name, out, ref in (("z", z, z_ref), ("d_hidden", d_hidden, dh_ref), ("d_W", d_w, dw_ref)):
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gather_kernels_match_the_torch_path(dtype, monkeypatch):
    """``fused_log_probs_at`` (triton backend for the dense part) with the sparse part on the
    kernels vs on the torch path, n 2048, h 1024, V 32768, k 64: the same log q to fp32 rounding,
    the same gradients to the final cast's rounding."""
    from mcore_ppo.distill import student as student_module

    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, vocab, k = 2048, 1024, 32768, 64
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    ids = torch.topk(hidden.float() @ weight.float().t(), k, dim=-1).indices
    ids[::7, k // 2 :] = -100
    ids[3] = -100
    g = torch.randn(n, k, device="cuda", generator=gen)
    outs = {}
    for mode in ("triton", "torch"):
        monkeypatch.setattr(student_module, "GATHER_KERNELS", mode)
        x = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        log_q, entropy = fused_log_probs_at(x, w, ids, temperature=0.8, backend="auto")
        ((log_q * g).sum() + entropy.sum()).backward()
        outs[mode] = (log_q.detach(), x.grad, w.grad)
    for name, a, b in zip(("log_q", "d_hidden", "d_weight"), outs["triton"], outs["torch"], strict=True):
        tol = 1e-6 if name == "log_q" else (2.0**-7 if dtype == torch.bfloat16 else 1e-5)
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err < tol, f"{name}: kernels vs torch path, relative error {err:.2e}"
