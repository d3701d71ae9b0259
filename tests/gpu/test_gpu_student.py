"""The student's log-probs at k ids per token (``mcore_ppo.fused_log_probs_at``) on a GPU,
against the fp64 full-vocab reference (``mcore_ppo_testing.student_reference``).

Run on the lent H200 (``pytest tests/gpu/test_gpu_student.py``); skipped without CUDA. The
``triton`` (what ``auto`` picks on CUDA) and ``torch`` backends, fp32 and bf16 inputs, a 32k
vocab over several vocab chunks, k ∈ {8, 64}, with a per-token temperature, ignored slots and
entropy; the one-hot gradients folded into the triton backend's dz in its recompute and buffer
modes, against fp64 and against a torch sparse path around the same backend
(:class:`mcore_ppo_testing.bench_student.SparseOnTorch`). Tolerances as for the head
(``tests/core/test_head_options.py``): outputs 1e-5 of the tensor's max; gradients 1e-5 of
their terms' magnitudes (bf16 + triton: 1e-2, plus the cast).
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo import fused_log_probs_at
from mcore_ppo_testing.reference import assert_close
from mcore_ppo_testing.seeds import next_seed
from mcore_ppo_testing.student_fold import record_folds
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


def _backend(mode: str, n: int, itemsize: int):
    """The triton backend in ``mode``, fp32 operands through its kernels' own IEEE dots (the
    default sends them to cuBLAS, the torch backend's pass: no fold to test there)."""
    from mcore_ppo.backends import TritonBackend, TritonConfig

    if mode == "recompute":  # no buffer; a workspace of 4096 columns: 8 vocab chunks of 32k
        return TritonBackend(
            TritonConfig(buffer_budget_bytes=0, workspace_bytes=n * itemsize * 4096, ieee_gemms="kernels")
        )
    return TritonBackend(TritonConfig(buffer_budget_bytes=1 << 34, ieee_gemms="kernels"))


@pytest.mark.parametrize("share", ["whole", "one_of_8"])
@pytest.mark.parametrize("mode", ["recompute", "buffer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fold_matches_fp64_on_cuda(dtype, mode, share, monkeypatch):
    """The one-hot gradients folded into the triton backend's dz (both backward modes) against
    fp64: n 512, h 512, V 32768, k 64 teacher-like ids (top-k of a nearby distribution) with a
    duplicate in every row, a ninth of the rows half ignored, one row fully ignored, a
    per-token temperature; ``one_of_8``: only the ids in an eighth of the vocab kept (the others
    ignored, as a rank's share at TP 8). The fold must run (the torch backend's gradients, the
    triton backend's fallback, are refused), and a second run gives the same bits (no atomics)."""
    from mcore_ppo.backends import TorchBackend

    calls = record_folds(monkeypatch)

    def refused(*args, **kwargs):
        raise AssertionError("the torch backend's gradients ran instead of the triton backend's fold")

    monkeypatch.setattr(TorchBackend, "shard_gradients", refused)
    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, vocab, k = 512, 512, 32768, 64
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    teacher = hidden.float() + 0.3 * torch.randn(n, h, device="cuda", generator=gen)
    ids = torch.topk(teacher @ weight.float().t(), k, dim=-1).indices
    ids[:, 1] = ids[:, 0]
    if share == "one_of_8":
        ids = torch.where((ids >= vocab // 8) & (ids < vocab // 4), ids, -100)
    ids[::9, k // 2 :] = -100
    ids[7] = -100
    temperature = 0.5 + torch.rand(n, device="cuda", generator=gen)
    g = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float64)
    e = torch.randn(n, device="cuda", generator=gen, dtype=torch.float64)
    backend = _backend(mode, n, hidden.element_size())
    grads = []
    for _ in range(2):
        x = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        log_q, entropy = fused_log_probs_at(x, w, ids, temperature=temperature, backend=backend)
        ((log_q * g.float()).sum() + (entropy * e.float()).sum()).backward()
        grads.append((x.grad, w.grad))
    assert calls and (len(calls) == 2 if mode == "buffer" else len(calls) == 16), calls
    for first, second in zip(grads[0], grads[1], strict=True):
        assert torch.equal(first, second)
    ref = student_reference(hidden.cpu(), weight.cpu(), ids.cpu(), temperature.cpu(), g.cpu(), e.cpu())
    for name, out in (("log_q", log_q), ("entropy", entropy)):
        assert_close(out.detach().cpu(), ref[name], name=f"student {name}", dtype=dtype, rtol=1e-5)
    rtol, cast = (1e-2, 8e-3) if dtype == torch.bfloat16 else (1e-5, 0.0)
    for name, grad in zip(("d_hidden", "d_weight"), grads[0], strict=True):
        assert grad.dtype == dtype
        # fp32 d_W here sums up to 512 tokens' terms per element with ids concentrated as a
        # teacher's are: every path (the fold, the torch sparse path, the torch backend) lands at
        # 0.9-1.2e-5 of the terms on the H200 (docs/benchmarks/gpu_runs/h200_2026-12-01f/5_fold_diag.log).
        grad_rtol = 2e-5 if (name == "d_weight" and dtype == torch.float32) else rtol
        assert_close(
            grad.cpu(),
            ref[name],
            name=f"student {name}",
            dtype=dtype,
            rtol=grad_rtol,
            atol=1e-30,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
        )


@pytest.mark.parametrize("mode", ["recompute", "buffer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fold_matches_the_torch_path(dtype, mode, monkeypatch):
    """``fused_log_probs_at`` (triton backend for the dense part) with the sparse part folded into
    dz vs on a torch path around the same backend (:class:`SparseOnTorch`: gathered-row logits,
    bmm and ``index_add_`` for their gradients), n 2048, h 1024, V 32768, k 64: the same log q to
    fp32 rounding, the same gradients to the rounding of dz (bf16) / fp32."""
    from mcore_ppo_testing.bench_student import SparseOnTorch

    calls = record_folds(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, vocab, k = 2048, 1024, 32768, 64
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    ids = torch.topk(hidden.float() @ weight.float().t(), k, dim=-1).indices
    ids[::7, k // 2 :] = -100
    ids[3] = -100
    g = torch.randn(n, k, device="cuda", generator=gen)
    backend = _backend(mode, n, hidden.element_size())
    outs = {}
    for gather, head_backend in (("auto", backend), ("torch", SparseOnTorch(backend))):
        folds = len(calls)
        x = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        log_q, entropy = fused_log_probs_at(x, w, ids, temperature=0.8, backend=head_backend)
        ((log_q * g).sum() + entropy.sum()).backward()
        outs[gather] = (log_q.detach(), x.grad, w.grad)
        assert (len(calls) > folds) == (gather == "auto")  # the fold runs only without SparseOnTorch
    for name, a, b in zip(("log_q", "d_hidden", "d_weight"), outs["auto"], outs["torch"], strict=True):
        tol = 1e-6 if name == "log_q" else (2.0**-7 if dtype == torch.bfloat16 else 1e-5)
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err < tol, f"{name}: folded vs torch path, relative error {err:.2e}"
