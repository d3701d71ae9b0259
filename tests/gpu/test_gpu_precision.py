"""fp32 inputs under each ``precision`` on CUDA, against the fp64 head of the same values.

Run on a GPU (``pytest tests/gpu/test_gpu_precision.py``); skipped without CUDA.

- ``auto`` and ``ieee``: IEEE fp32 dots; outputs and gradients within the head's fp32 bound,
  1e-5 of the fp64 result (relative to the tensor's largest value), in both backward modes
  (buffer and recompute), through cuBLAS (the default ``ieee_gemms="cublas"``: the torch
  backend's chunked pass, bit for bit) and through the kernels' own dots (``"kernels"``, and
  the default when TF32 is allowed process-wide).
- ``fp32_faithful`` (the operands' fp16 parts, three fp16 products per product, promoted
  accumulation, in the triton kernels): as accurate as the IEEE path on the same data, 2e-6 or
  less; also at a hidden size where the tensor cores' own accumulation would shrink the logits
  past that, and over rows of every scale. The entropy's fp32 rounding alone (a difference
  of sums of terms up to |z|) reaches a few 1e-6 relative at logits of scale 3, the same for
  cuBLAS's IEEE logits and the head's: the bound is ``max(2e-6, 1.5 × IEEE's error)``, per
  output. Its bits differ from the IEEE path's: the parts' kernels ran, not the IEEE ones.
- The torch backend under ``fp32_faithful``: torch's own fp32 matmul, the fp32 bound.
"""

from __future__ import annotations

import math

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import TritonBackend, TritonConfig
from mcore_ppo_testing.seeds import next_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 1024, 1024, 16384
FP32_RTOL = 1e-5  # the head's bound for fp32 outputs and gradients
FAITHFUL_RTOL = 2e-6


def _inputs(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, device="cuda", generator=gen, dtype=torch.float64) * (3 / math.sqrt(H))
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)
    labels[::7] = -100
    g = torch.randn(N, device="cuda", generator=gen, dtype=torch.float64)
    e = torch.randn(N, device="cuda", generator=gen, dtype=torch.float64)
    return x, w, labels, g, e


def _run(x, w, labels, g, e, **kwargs) -> dict:
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    lp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.9, **kwargs)
    ((lp.double() * g).sum() + (ent.double() * e).sum()).backward()
    return {"log_prob": lp.detach(), "entropy": ent.detach(), "d_hidden": x.grad, "d_weight": w.grad}


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("mode", ["buffer", "recompute"])
def test_fp32_precisions_match_fp64(mode):
    seed = next_seed()
    x, w, labels, g, e = _inputs(seed)
    ref = _run(x, w, labels, g, e, backend="torch")  # fp64 inputs: the fp64 head
    budget = 1 << 34 if mode == "buffer" else 0
    errors = {}
    for precision, gemms in (("ieee", "cublas"), ("ieee", "kernels"), ("auto", "cublas"), ("fp32_faithful", "cublas")):
        backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget, precision=precision, ieee_gemms=gemms))
        out = _run(x.float(), w.float(), labels, g, e, backend=backend)
        errors[precision if gemms == "cublas" else f"{precision} {gemms}"] = {
            name: _relative(out[name], ref[name]) for name in ref
        }
    where = f"({mode}, seed {seed}): {errors}"
    for precision in ("ieee", "ieee kernels", "auto"):
        assert all(err <= FP32_RTOL for err in errors[precision].values()), f"{precision} {where}"
    for name in ("log_prob", "entropy"):
        bound = max(FAITHFUL_RTOL, 1.5 * errors["ieee"][name])
        assert errors["fp32_faithful"][name] <= bound, f"fp32_faithful {name} > {bound:.2e} {where}"
    for name in ("d_hidden", "d_weight"):
        assert errors["fp32_faithful"][name] <= FP32_RTOL, f"fp32_faithful {name} {where}"


def test_ieee_dots_run_on_cublas_unless_tf32_is_allowed():
    """The default IEEE route is the torch backend's pass over the cuBLAS blocks, bit for bit
    (outputs and gradients); with TF32 allowed process-wide, cuBLAS's fp32 GEMMs are not IEEE
    and the kernels' own dots run, bit for bit those of ``ieee_gemms="kernels"``."""
    from mcore_ppo.backends import TorchBackend, TorchConfig
    from mcore_ppo.backends.triton_config import IEEE_BLOCKS

    seed = next_seed()
    x, w, labels, g, e = (t.float() if t.is_floating_point() else t for t in _inputs(seed))
    default = TritonBackend(TritonConfig(precision="ieee"))
    blocks = TorchBackend(TorchConfig(token_chunk=IEEE_BLOCKS[0], vocab_chunk=IEEE_BLOCKS[1]))
    kernels = TritonBackend(TritonConfig(precision="ieee", ieee_gemms="kernels"))
    by_default, by_torch = _run(x, w, labels, g, e, backend=default), _run(x, w, labels, g, e, backend=blocks)
    for name in by_default:
        assert torch.equal(by_default[name], by_torch[name]), (name, seed)
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        with_tf32, by_kernels = _run(x, w, labels, g, e, backend=default), _run(x, w, labels, g, e, backend=kernels)
    finally:
        matmul.allow_tf32 = allowed
    for name in ("log_prob", "entropy"):  # the backward's GEMMs are cuBLAS's: TF32 there
        assert torch.equal(with_tf32[name], by_kernels[name]), (name, seed)
        assert not torch.equal(with_tf32[name], by_default[name]), (name, seed)


def test_faithful_runs_its_own_kernels():
    """The fp16 parts' forward is not the IEEE one: same inputs, different fp32 roundings."""
    x, w, labels, _, _ = _inputs(next_seed())
    x, w = x.float(), w.float()
    faithful = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, precision="fp32_faithful")[0]
    ieee = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, precision="ieee")[0]
    assert not torch.equal(faithful, ieee)


def test_torch_backend_accepts_faithful():
    seed = next_seed()
    x, w, labels, g, e = _inputs(seed)
    ref = _run(x, w, labels, g, e, backend="torch")
    out = _run(x.float(), w.float(), labels, g, e, backend="torch", precision="fp32_faithful")
    for name in ref:
        assert _relative(out[name], ref[name]) <= FP32_RTOL, (name, seed)


def _faithful_errors(x, w, labels, temperature) -> dict:
    """The largest error over the largest fp64 value of ``fp32_faithful``'s and IEEE's log-probs
    and entropy (forward only), against the fp64 head of the same fp32 values."""
    ref = mcore_ppo.fused_log_probs_and_entropy(x.double(), w.double(), labels, temperature=temperature.double())
    errors = {}
    for precision in ("fp32_faithful", "ieee"):
        out = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=temperature, precision=precision)
        errors[precision] = [_relative(o, r) for o, r in zip(out, ref, strict=True)]
    return errors


def test_faithful_logits_carry_no_accumulation_shrink():
    """At hidden size 4,096 (K = 12,288 over the parts) the tensor cores' truncating fp32
    accumulation, left to sum a whole row, shrinks every logit by ~2e-5 of its size (one
    H100: log-probs 2e-5 from fp64); the promoted slices keep ``fp32_faithful`` within
    ``max(2e-6, 1.5 × IEEE's error)``."""
    seed = next_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, h, v = 512, 4096, 16384
    x = torch.randn(n, h, device="cuda", generator=gen)
    w = torch.randn(v, h, device="cuda", generator=gen) * (3 / math.sqrt(h))
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    errors = _faithful_errors(x, w, labels, torch.full((n,), 0.8, device="cuda"))
    for out, ieee in zip(errors["fp32_faithful"], errors["ieee"], strict=True):
        assert out <= max(FAITHFUL_RTOL, 1.5 * ieee), f"seed {seed}: {errors}"


def test_faithful_over_rows_of_every_scale():
    """Hidden rows of scales 1e-4 to 1e4 with a per-token temperature of the same scale (logits
    of order one), weight rows of scales 1e-3 to 10, values spanning 2^20 within each row, a
    zero row: ``fp32_faithful`` within ``max(2e-6, 1.5 × IEEE's error)`` of fp64."""
    seed = next_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, h, v = 512, 1024, 16384
    scales = 10.0 ** torch.linspace(-4, 4, n, device="cuda")
    spread = 2.0 ** -torch.randint(0, 20, (n, h), device="cuda", generator=gen).float()
    x = torch.randn(n, h, device="cuda", generator=gen) * scales[:, None] * spread
    x[7] = 0.0
    w = torch.randn(v, h, device="cuda", generator=gen) * (3 / math.sqrt(h))
    w = w * 10.0 ** torch.linspace(-3, 1, v, device="cuda")[:, None] / 3
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    errors = _faithful_errors(x, w, labels, scales * 1.5)
    for out, ieee in zip(errors["fp32_faithful"], errors["ieee"], strict=True):
        assert out <= max(FAITHFUL_RTOL, 1.5 * ieee), f"seed {seed}: {errors}"
