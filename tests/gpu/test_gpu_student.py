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
