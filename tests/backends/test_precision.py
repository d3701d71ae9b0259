"""The head's numerics policy (``precision=``, :class:`mcore_ppo.numerics.Numerics`): which dot
each dtype and precision take, that the choice reaches the triton kernels of the forward and of
the backward's recompute, that every precision stays within fp32 rounding of the fp64
reference on both backends, and that a bad or conflicting precision is refused naming it.

On the CPU the triton backend runs in Triton's interpreter, whose dots are numpy's fp32
products for every ``input_precision``: these tests check the plumbing and the results' fp32
accuracy; the 3×TF32 products themselves are checked on the GPU
(``tests/gpu/test_gpu_precision.py``)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import mcore_ppo
from mcore_ppo import HeadOptions
from mcore_ppo.backends import (
    TorchBackend,
    TorchConfig,
    backend_from_key,
    backend_key,
    backend_precision,
    import_optional,
    resolve_backend,
)
from mcore_ppo.numerics import PRECISIONS, Numerics
from mcore_ppo_testing.reference import assert_close
from mcore_ppo_testing.seeds import generator, next_seed

TRITON_ON_CPU = pytest.mark.skipif(
    import_optional("triton") is None or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the triton backend runs CPU tensors only in the interpreter (TRITON_INTERPRET=1)",
)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_numerics_change_only_fp32_operands(precision):
    """16-bit products are exact in the fp32 accumulator: every precision keeps their native
    dot. fp32 operands take IEEE dots unless ``fp32_faithful`` asks for three TF32 products."""
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert Numerics.of(dtype, precision) == Numerics(dtype, "native")
    expected = "tf32x3" if precision == "fp32_faithful" else "ieee"
    assert Numerics.of(torch.float32, precision) == Numerics(torch.float32, expected)


@pytest.mark.parametrize("bad,error", [("tf32", ValueError), ("IEEE", ValueError), (3, TypeError), (True, TypeError)])
def test_bad_precision_is_refused_naming_it(bad, error):
    x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, -100])
    with pytest.raises(error, match="precision"):
        mcore_ppo.fused_log_probs_and_entropy(x, w, y, precision=bad)
    with pytest.raises(error, match="precision"):
        HeadOptions(precision=bad)
    with pytest.raises(error, match="precision"):
        TorchConfig(precision=bad)


def test_a_precision_that_contradicts_a_backend_object_is_refused():
    """A backend object carries its own precision; a different one beside it is a ValueError,
    the same one (or none) is accepted."""
    backend = TorchBackend(TorchConfig(precision="ieee"))
    with pytest.raises(ValueError, match="precision='fp32_faithful' differs from the backend object's own"):
        HeadOptions(backend=backend, precision="fp32_faithful")
    assert HeadOptions(backend=backend, precision="ieee").precision == "ieee"
    assert backend_precision(HeadOptions(backend=backend).backend) == "ieee"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["auto", "torch", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_named_backend_keys_carry_the_precision(name, precision):
    """The ops name a backend by a string: the precision travels in it and resolves to a
    backend built with it, one object per (name, device type, precision)."""
    key = backend_key(name, torch.device("cpu"), precision)
    backend = backend_from_key(key)
    assert backend_precision(backend) == precision
    assert backend is resolve_backend(name, torch.device("cpu"), precision)
    assert (key == f"{name}:cpu") == (precision == "auto")


def _case(dtype: torch.dtype, gen: torch.Generator, n: int = 24, h: int = 40, vocab: int = 96):
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64) * (2 / math.sqrt(h))
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    e = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), labels, g, e


def _run(hidden, weight, labels, g, e, **kwargs):
    x = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    lp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, **kwargs)
    ((lp.double() * g).sum() + (ent.double() * e).sum()).backward()
    return {"log_prob": lp, "entropy": ent, "d_hidden": x.grad, "d_weight": w.grad}


def _reference(hidden, weight, labels, g, e):
    return _run(hidden.double(), weight.double(), labels, g, e, backend="torch")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", ["buffer", "recompute", pytest.param("torch", id="torch-backend")])
def test_every_precision_matches_fp64(mode, precision):
    """fp32 inputs under each precision, the triton backend's two backward modes (forward
    plan and recompute kernels on the precision's dot) and the torch backend, against the
    fp64 head of the same values: outputs and gradients within fp32 rounding."""
    if mode != "torch":
        if TRITON_ON_CPU.args[0]:
            pytest.skip(TRITON_ON_CPU.kwargs["reason"])
        from mcore_ppo.backends import TritonBackend, TritonConfig

        budget = 1 << 30 if mode == "buffer" else 0
        backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget, precision=precision))
        kwargs = {"backend": backend}
    else:
        kwargs = {"backend": "torch", "precision": precision}
    seed = next_seed()
    case = _case(torch.float32, generator(seed))
    out = _run(*case, **kwargs)
    ref = _reference(*case)
    for name in ("log_prob", "entropy", "d_hidden", "d_weight"):
        assert_close(
            out[name].double(),
            ref[name],
            name=f"{name} (precision={precision}, seed {seed})",
            dtype=torch.float32,
            rtol=1e-5,
        )


@pytest.mark.parametrize("precision,dot", [("auto", "ieee"), ("ieee", "ieee"), ("fp32_faithful", "tf32x3")])
@TRITON_ON_CPU
def test_the_precision_reaches_every_gemm_kernel(precision, dot, monkeypatch):
    """Every GEMM kernel launch of an fp32 call (the forward's statistics pass, the backward's
    recompute) is given the precision's dot; a bf16 call's keep the native one."""
    from mcore_ppo.backends import TritonBackend, TritonConfig
    from mcore_ppo.backends.triton_launch import Launcher

    seen: list[tuple[str, str]] = []
    real = Launcher.launch

    def spy(self, kernel, grid, args, kwargs, site=None, where=None):
        if "DOT" in kwargs:
            seen.append((getattr(kernel, "__name__", str(kernel)), kwargs["DOT"]))
        return real(self, kernel, grid, args, kwargs, site, where)

    monkeypatch.setattr(Launcher, "launch", spy)
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=0, precision=precision))
    for dtype, expected in ((torch.float32, dot), (torch.bfloat16, "native")):
        seen.clear()
        _run(*_case(dtype, generator(next_seed())), backend=backend)
        assert len(seen) >= 2, seen  # the statistics pass and at least one recompute chunk
        assert {d for _, d in seen} == {expected}, seen


@pytest.mark.parametrize("precision", ["fp32_faithful", "ieee"])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_a_16_bit_hidden_with_an_fp32_weight(backend, hidden_dtype, precision):
    """Under a precision other than ``auto`` a 16-bit hidden meets an fp32 weight (an fp32 LM
    head on a bf16 trunk): the outputs are those of the fp64 head of the same values, the weight's
    gradient is fp32 and the hidden's is in its own dtype, rounded once."""
    seed = next_seed()
    hidden, weight, labels, g, e = _case(torch.float32, generator(seed))
    hidden = hidden.to(hidden_dtype)
    out = _run(hidden, weight, labels, g, e, backend=backend, precision=precision)
    ref = _reference(hidden, weight, labels, g, e)
    assert out["d_hidden"].dtype == hidden_dtype and out["d_weight"].dtype == torch.float32
    for name in ("log_prob", "entropy", "d_weight"):
        assert_close(out[name].double(), ref[name], name=f"{name} (seed {seed})", dtype=torch.float32, rtol=1e-5)
    assert_close(
        out["d_hidden"].double(), ref["d_hidden"], name=f"d_hidden (seed {seed})", dtype=hidden_dtype, rtol=1e-5,
        elementwise_rtol=2.0**-7,
    )  # fmt: skip


def test_mixed_dtypes_are_refused_where_no_precision_allows_them():
    """``auto`` keeps one dtype for both operands; an fp32 hidden with a 16-bit weight is refused
    under every precision (the weight's values would be the ones rounded)."""
    x, y = torch.randn(4, 8), torch.tensor([1, 2, 3, -100])
    with pytest.raises(TypeError, match=r"must match hidden dtype torch\.bfloat16.*precision='fp32_faithful'"):
        mcore_ppo.fused_log_probs_and_entropy(x.bfloat16(), torch.randn(10, 8), y)
    for precision in PRECISIONS:
        with pytest.raises(TypeError, match=r"weight dtype torch\.bfloat16 must match hidden dtype torch\.float32"):
            mcore_ppo.fused_log_probs_and_entropy(x, torch.randn(10, 8).bfloat16(), y, precision=precision)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-hidden"])
def test_a_precision_compiles_in_one_graph(hidden_dtype):
    """``torch.compile(fullgraph=True)`` with default options keeps a call with a precision (a
    named backend's key carries it into the op) and the 16-bit hidden's upcast in one graph:
    outputs and gradients equal eager's."""
    seed = next_seed()
    hidden, weight, labels, g, e = _case(torch.float32, generator(seed))
    hidden = hidden.to(hidden_dtype)
    compiled = torch.compile(mcore_ppo.fused_log_probs_and_entropy, fullgraph=True)
    results = []
    for fn in (mcore_ppo.fused_log_probs_and_entropy, compiled):
        x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        lp, ent = fn(x, w, labels, temperature=0.7, precision="fp32_faithful")
        ((lp.double() * g).sum() + (ent.double() * e).sum()).backward()
        results.append((lp.detach(), ent.detach(), x.grad, w.grad))
    for eager, traced in zip(*results, strict=True):
        torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.skipif(import_optional("triton") is None, reason="needs the triton package (the backend's module)")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_ieee_dots_of_cuda_operands_go_to_cublas(precision):
    """fp32 CUDA operands under IEEE dots run on cuBLAS (the torch backend's chunked pass over
    :data:`~mcore_ppo.backends.triton_config.IEEE_BLOCKS`) while cuBLAS's fp32 GEMMs are IEEE;
    with TF32 allowed process-wide, under ``ieee_gemms="kernels"``, for 3×TF32 dots and for
    16-bit operands the kernels run. Decided on fake CUDA tensors (no GPU needed); the GPU test
    (tests/gpu/test_gpu_precision.py) runs both routes."""
    from mcore_ppo.backends import TritonBackend, TritonConfig
    from mcore_ppo.backends.triton_config import IEEE_BLOCKS

    cublas = TritonBackend(TritonConfig(precision=precision))
    kernels = TritonBackend(TritonConfig(precision=precision, ieee_gemms="kernels"))
    assert (cublas._cublas_ieee.config.token_chunk, cublas._cublas_ieee.config.vocab_chunk) == IEEE_BLOCKS
    ieee = Numerics.of(torch.float32, precision).dot == "ieee"
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32  # a property of torch's (monkeypatch cannot restore it)
    matmul.allow_tf32 = False
    try:
        _check_routes(cublas, kernels, ieee)
    finally:
        matmul.allow_tf32 = allowed


def _check_routes(cublas, kernels, ieee: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x32, w32 = torch.empty(8, 16, device="cuda"), torch.empty(40, 16, device="cuda")
        x16, w16 = x32.bfloat16(), w32.bfloat16()
        assert (cublas._delegate(x32, w32) is cublas._cublas_ieee) == ieee
        assert cublas.fused_forward_for(x32, w32) == (not ieee)
        spec = cublas.residual_spec(
            x32, w32, fused=not ieee, grad_needed=True, statistics=mcore_ppo.statistics.DEFAULT, row_temperature=False
        )
        assert (spec == ()) == ieee, "the cuBLAS route keeps no residual: its backward recomputes"
        assert cublas._delegate(x16, w16) is None and cublas.fused_forward_for(x16, w16)
        assert kernels._delegate(x32, w32) is None and kernels.fused_forward_for(x32, w32)
        torch.backends.cuda.matmul.allow_tf32 = True  # restored by the caller
        assert cublas._delegate(x32, w32) is None, "TF32 cuBLAS GEMMs are not IEEE: the kernels' dots run"
    with FakeTensorMode():  # CPU operands (the interpreter) keep the kernels' dots
        assert cublas._delegate(torch.empty(8, 16), torch.empty(40, 16)) is None


@pytest.mark.parametrize("bad,error", [("cuBLAS", ValueError), ("torch", ValueError), (None, TypeError)])
def test_bad_ieee_gemms_is_refused_naming_it(bad, error):
    from mcore_ppo.backends import TritonConfig

    with pytest.raises(error, match="ieee_gemms"):
        TritonConfig(ieee_gemms=bad)
