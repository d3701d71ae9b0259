"""The head's numerics policy (``precision=``, :class:`mcore_ppo.numerics.Numerics`): which dot
each dtype and precision take, that the choice reaches the triton kernels of the forward and of
the backward's recompute, that every precision stays within fp32 rounding of the fp64
reference on both backends, and that a bad or conflicting precision is refused naming it.

On the CPU the triton backend runs in Triton's interpreter, whose dots are numpy's fp32
products: these tests check the plumbing, the fp16 parts of ``fp32_faithful``
(:mod:`mcore_ppo.kernels.split`: exact up to fp32 rounding, inf and NaN carried) and the
results' fp32 accuracy; the tensor cores' products are checked on the GPU
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
    dot. fp32 operands take IEEE dots unless ``fp32_faithful`` asks for their fp16 parts."""
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert Numerics.of(dtype, precision) == Numerics(dtype, "native")
        assert not Numerics.of(dtype, precision).parts
    expected = Numerics(torch.float16, "fp16x3") if precision == "fp32_faithful" else Numerics(torch.float32, "ieee")
    assert Numerics.of(torch.float32, precision) == expected
    assert expected.parts == (precision == "fp32_faithful")


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


@pytest.mark.parametrize(
    "precision,dot", [("auto", ("ieee", False)), ("ieee", ("ieee", False)), ("fp32_faithful", ("native", True))]
)
@TRITON_ON_CPU
def test_the_precision_reaches_every_gemm_kernel(precision, dot, monkeypatch):
    """Every GEMM kernel launch of an fp32 call (the forward's statistics pass, the backward's
    recompute) is given the precision's dot (``fp32_faithful``: the native dot on the inputs'
    fp16 parts, ``PARTS``, after their split); a bf16 call's keep the native one."""
    from mcore_ppo.backends import TritonBackend, TritonConfig
    from mcore_ppo.backends.triton_launch import Launcher

    seen: list[tuple[str, str]] = []
    real = Launcher.launch

    def spy(self, kernel, grid, args, kwargs, site=None, where=None):
        name = getattr(kernel, "__name__", str(kernel))
        if "DOT" in kwargs:
            seen.append((name, (kwargs["DOT"], kwargs.get("PARTS", False))))
        elif name == "split_kernel":
            seen.append((name, None))
        return real(self, kernel, grid, args, kwargs, site, where)

    monkeypatch.setattr(Launcher, "launch", spy)
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=0, precision=precision))
    for dtype, expected in ((torch.float32, dot), (torch.bfloat16, ("native", False))):
        seen.clear()
        _run(*_case(dtype, generator(next_seed())), backend=backend)
        gemms = [d for name, d in seen if name != "split_kernel"]
        assert len(gemms) >= 2, seen  # the statistics pass and at least one recompute chunk
        assert set(gemms) == {expected}, seen
        # The parts are split for the forward's GEMMs and again for the backward's recompute.
        splits = [name for name, _ in seen if name == "split_kernel"]
        assert len(splits) == (4 if expected[1] else 0), seen


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
    with TF32 allowed process-wide, under ``ieee_gemms="kernels"``, for ``fp32_faithful``'s fp16
    parts and for 16-bit operands the kernels run. Decided on fake CUDA tensors (no GPU needed); the GPU test
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


@TRITON_ON_CPU
def test_fp16_parts_hold_each_fp32_value():
    """``split_kernel`` (:mod:`mcore_ppo.kernels.split`): per row a power-of-two scale-back, and
    parts that add back to each value within ``2^-22`` of it, over rows from fp32's smallest
    scales to its largest, rows spanning 40 binades, zero rows, subnormal rows, in both orders;
    a row holding inf keeps scale 1 and carries it, a NaN is carried by its own parts (never a
    finite stand-in)."""
    from mcore_ppo.backends.triton_host import fp16_parts
    from mcore_ppo.backends.triton_launch import Launcher

    seed = next_seed()
    gen = generator(seed)
    h = 72  # not a power of two: the last block is masked
    rows = [torch.randn(h, generator=gen, dtype=torch.float64) * 10.0**scale for scale in range(-36, 37, 6)]
    spread = torch.randn(h, generator=gen, dtype=torch.float64) * 2.0 ** torch.linspace(-40, 0, h, dtype=torch.float64)
    rows += [spread, torch.zeros(h), torch.full((h,), 1e-40), torch.full((h,), 3.0e38)]
    values = torch.stack(rows).float()
    special = values[:2].clone()
    special[0, 5], special[1, 7] = math.inf, math.nan
    launch = Launcher(kept=False).bound()
    for columns in (False, True):
        parts, unscale = fp16_parts(values, launch, columns=columns)
        assert parts.dtype == torch.float16 and parts.shape == (values.shape[0], 3 * h)
        mantissa, _ = torch.frexp(unscale)
        assert torch.all(mantissa == 0.5), f"scale-backs are powers of two (seed {seed}): {unscale}"
        big, small = (parts[:, :h], parts[:, 2 * h :]) if not columns else (parts[:, :h], parts[:, h : 2 * h])
        assert torch.equal(parts[:, 2 * h :] if columns else parts[:, h : 2 * h], big), "the big part twice"
        back = (big.double() + small.double()) * unscale.double()[:, None]
        exact = values.double()
        # 2^-22 of each value; below fp16's normal range (values 2^-28 of their row's largest
        # and smaller) the parts keep 2^-25 of the scaled row, 2^-39 of its largest value.
        bound = 2.0**-22 * exact.abs() + 2.0**-39 * exact.abs().amax(1, keepdim=True)
        assert torch.all((back - exact).abs() <= bound), f"columns={columns}, seed {seed}"
        parts, unscale = fp16_parts(special, launch, columns=columns)
        assert unscale[0] == 1.0 and not torch.isfinite(parts[0, [5, 2 * h + 5]]).all()
        assert torch.isnan(parts[1, [7, h + 7, 2 * h + 7]]).all()


@TRITON_ON_CPU
@pytest.mark.parametrize("mode", ["forward", "recompute"])
def test_fp32_faithful_over_rows_of_every_scale(mode):
    """``fp32_faithful`` on the triton backend, hidden rows of scales 1e-4 to 1e4 (a zero row
    among them) with a per-token temperature of the same scale (logits of order one at every
    scale), weight rows of scales 1e-3 to 10, each row's values spanning 2^20: within fp32
    rounding of the fp64 head of the same values, outputs and gradients; a token whose hidden
    row holds an inf or a NaN gets NaN outputs, its neighbours their own values."""
    from mcore_ppo.backends import TritonBackend, TritonConfig

    seed = next_seed()
    gen = generator(seed)
    hidden, weight, labels, g, e = _case(torch.float64, gen)
    n, h = hidden.shape
    scales = 10.0 ** torch.linspace(-4, 4, n, dtype=torch.float64)
    hidden = hidden * scales[:, None] * 2.0 ** -torch.randint(0, 20, (n, h), generator=gen).double()
    hidden[3] = 0.0
    temperature = (scales * 1.5).float()
    weight = weight * 10.0 ** torch.linspace(-3, 1, weight.shape[0], dtype=torch.float64)[:, None] / 3
    budget = 1 << 30 if mode == "forward" else 0  # the forward's own backward, or a recompute
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget, precision="fp32_faithful"))
    outputs = []
    for x, w, kwargs in (
        (hidden.float(), weight.float(), {"backend": backend}),
        (hidden.float().double(), weight.float().double(), {"backend": "torch"}),
    ):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        lp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=temperature, **kwargs)
        ((lp.double() * g).sum() + (ent.double() * e).sum()).backward()
        outputs.append({"log_prob": lp, "entropy": ent, "d_hidden": x.grad, "d_weight": w.grad})
    out, ref = outputs
    for name in ("log_prob", "entropy", "d_weight"):
        assert_close(
            out[name].double(), ref[name], name=f"{name} ({mode}, seed {seed})", dtype=torch.float32, rtol=1e-5
        )
    # d_hidden's rows follow 1/T: each row against its own largest value.
    row_error = (out["d_hidden"].double() - ref["d_hidden"]).abs().amax(1)
    assert torch.all(row_error <= 1e-5 * ref["d_hidden"].abs().amax(1)), f"d_hidden ({mode}, seed {seed})"
    special = hidden.float()
    special[1, 4], special[2, 9] = math.inf, math.nan
    lp, ent = mcore_ppo.fused_log_probs_and_entropy(
        special, weight.float(), labels, temperature=temperature, backend=backend
    )
    for token in (1, 2):
        if labels[token] != -100:
            assert torch.isnan(lp[token]), f"token {token}: {lp[token]} (seed {seed})"
        assert not torch.isfinite(ent[token]), f"token {token}: {ent[token]} (seed {seed})"
    kept = [i for i in range(n) if i not in (1, 2)]
    torch.testing.assert_close(lp[kept].double(), ref["log_prob"][kept].detach(), rtol=1e-5, atol=1e-5)
