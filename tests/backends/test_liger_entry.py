"""Liger-Kernel's entry point (:func:`mcore_ppo.liger.liger_log_probs_and_entropy`), on CPU, with a
fake Liger module in ``sys.modules``.

The fake records how it was called and computes ``(nll, entropy)`` with the fp64 reference
(differentiable), so the test checks what the entry point does around Liger: argument order, the
sign of nll, layouts, ignored tokens, a per-token temperature, gradients, and the cases it must
refuse. Liger is no backend of the head: ``backend="liger"`` is refused, naming this entry point.
A last test runs the real Liger (its PyTorch fallback on CPU) when it is installed.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.distributed as dist

from mcore_ppo import fused_log_probs_and_entropy, liger, linear_cross_entropy
from mcore_ppo.backends import resolve_backend
from mcore_ppo.liger import liger_log_probs_and_entropy
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference, reference_outputs
from mcore_ppo_testing.seeds import generator, next_seed


class FakeLiger:
    """Stands in for ``LigerFusedLinearScaledCrossEntropyFunction`` (and its TP variant)."""

    def __init__(self):
        self.calls = []

    def apply(self, x, w, target, *args):
        self.calls.append((x, w, target, args))
        # TP variant: (group, T, ignore_index, tiles_per_reduce, return_entropy); else (T, ignore_index, tiles, ret).
        temperature, ignore_index = (args[1], args[2]) if len(args) == 5 else (args[0], args[1])
        logp, ent = reference_outputs(x.double(), w.double(), target, temperature, ignore_index)
        # Liger's CuTe path returns entropy in the input dtype: the entry point must hand back fp32.
        return (-logp).to(x.dtype), ent.to(torch.bfloat16)


@pytest.fixture
def fake_liger(monkeypatch):
    module = types.ModuleType(liger.LIGER_MODULE)
    module.LigerFusedLinearScaledCrossEntropyFunction = FakeLiger()
    module.LigerFusedLinearScaledCrossEntropyTPFunction = FakeLiger()
    for name in ("liger_kernel", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, liger.LIGER_MODULE, module)
    return module


def case(seed, n=12, h=8, v=30, dtype=torch.float64):
    gen = generator(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = IGNORE_INDEX
    return hidden, weight, labels


def test_available_with_fake_and_not_a_head_backend(fake_liger):
    """Liger installed or not, ``backend="liger"`` is refused by the head (and by verl's entry),
    with a ValueError that names the Liger entry point."""
    assert liger.is_available()
    hidden, weight, labels = case(next_seed())
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        resolve_backend("liger", torch.device("cpu"))
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        fused_log_probs_and_entropy(hidden, weight, labels, backend="liger")
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        linear_cross_entropy(hidden, weight, labels, 0.8, backend="liger")
    assert not fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls


def test_dispatch_2d(fake_liger):
    hidden, weight, labels = case(next_seed())
    x = hidden.clone().requires_grad_(True)
    logp, ent = liger_log_probs_and_entropy(x, weight, labels, temperature=0.7, ignore_index=IGNORE_INDEX)
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert call[2].dtype == torch.int64
    assert call[3] == (0.7, IGNORE_INDEX, 1, True)  # temperature, ignore_index, m_tiles_per_cluster, return_entropy
    assert not fake_liger.LigerFusedLinearScaledCrossEntropyTPFunction.calls
    assert logp.dtype == ent.dtype == torch.float32
    ignored = labels == IGNORE_INDEX
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    ref = reference(hidden, weight, labels, 0.7, torch.ones(12, dtype=torch.float64))
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)
    assert_close(ent, ref["entropy"], name="entropy", dtype=torch.float64, rtol=1e-2, track=False)  # bf16 entropy
    logp.sum().backward()
    assert_close(x.grad, ref["d_hidden"], name="d_hidden", dtype=torch.float64, rtol=1e-6, track=False)
    assert (x.grad[ignored] == 0).all()


def test_entropy_off_and_labels_of_any_int_dtype(fake_liger):
    """``return_entropy=False``: Liger is asked for no entropy and the second output is None;
    int32 labels reach Liger as int64."""
    hidden, weight, labels = case(next_seed())
    logp, ent = liger_log_probs_and_entropy(
        hidden, weight, labels.int(), temperature=1.3, ignore_index=IGNORE_INDEX, return_entropy=False
    )
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert call[3] == (1.3, IGNORE_INDEX, 1, False) and call[2].dtype == torch.int64
    assert ent is None and logp.dtype == torch.float32
    ref = reference(hidden, weight, labels, 1.3)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)


def test_dispatch_megatron_layout(fake_liger):
    """[s, b, h] hidden with [b, s] labels: tokens passed sequence-major, outputs back as [b, s]."""
    s, b, h, v = 5, 3, 8, 20
    gen = generator(next_seed())
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s), generator=gen)
    logp, ent = liger_log_probs_and_entropy(hidden, weight, labels, temperature=1.0)
    assert logp.shape == ent.shape == (b, s)
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert torch.equal(call[2], labels.t().reshape(-1))
    assert torch.equal(call[0], hidden.reshape(s * b, h))
    ref = reference(hidden, weight, labels, 1.0)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)


def test_per_token_temperature_scales_the_rows(fake_liger):
    """A ``[b, s]`` temperature tensor with fp32 inputs: Liger gets the rows ``x / T_i`` (in
    sequence-major order) at ``T = 1``; outputs and ``d_hidden`` are the reference's at the
    per-token temperature."""
    s, b, h, v = 4, 3, 8, 25
    gen = generator(next_seed())
    hidden = torch.randn(s, b, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels[1, 2] = IGNORE_INDEX
    temperature = 0.5 + torch.rand(b, s, generator=gen)
    x = hidden.clone().requires_grad_(True)
    g = torch.randn(b, s, generator=gen, dtype=torch.float64)
    logp, ent = liger_log_probs_and_entropy(x, weight, labels, temperature=temperature)
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert call[3][0] == 1.0
    rows_t = temperature.t().reshape(-1)
    torch.testing.assert_close(call[0].detach(), hidden.reshape(s * b, h) / rows_t[:, None])
    ref = reference(hidden.double(), weight.double(), labels, temperature, g)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float32, rtol=1e-5, atol=1e-6, track=False)
    assert_close(ent, ref["entropy"], name="entropy", dtype=torch.float32, rtol=1e-2, track=False)  # bf16 entropy
    (logp.double() * g).sum().backward()
    assert_close(x.grad, ref["d_hidden"], name="d_hidden", dtype=torch.float32, rtol=1e-5, atol=1e-6, track=False)


def test_bad_temperature_values(fake_liger):
    """A temperature tensor with a bad value: ValueError with ``validate=True``; NaN outputs for
    that token only with ``validate=False`` (as the head)."""
    hidden, weight, labels = case(next_seed())
    temperature = torch.full((12,), 0.9, dtype=torch.float64)
    temperature[5] = 0.0
    with pytest.raises(ValueError, match="temperature"):
        liger_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, validate=True)
    logp, ent = liger_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, validate=False)
    assert logp[5].isnan() and ent[5].isnan()
    others = torch.arange(12) != 5
    assert not logp[others].isnan().any() and not ent[others].isnan().any()


def test_double_backward_refused(fake_liger):
    """Liger's backward node refuses ``create_graph=True``, as the head's Function does."""
    hidden, weight, labels = case(next_seed())
    x = hidden.clone().requires_grad_(True)
    logp, _ = liger_log_probs_and_entropy(x, weight, labels)
    with pytest.raises(NotImplementedError, match="differentiable once"):
        torch.autograd.grad(logp.sum(), x, create_graph=True)


def test_refusals(fake_liger, monkeypatch):
    """No sequence-parallel parameter; TP > 1 needs CUDA tensors; a temperature tensor with
    16-bit inputs (its rows would be rounded to 16 bits once more); k ids per token."""
    assert "sequence_parallel" not in inspect.signature(liger_log_probs_and_entropy).parameters
    hidden, weight, labels = case(next_seed(), dtype=torch.float32)
    with pytest.raises(TypeError, match="sequence_parallel"):
        liger_log_probs_and_entropy(hidden, weight, labels, sequence_parallel=True)
    half = hidden.bfloat16(), weight.bfloat16()
    with pytest.raises(ValueError, match=r"per-token temperature tensor with torch\.bfloat16"):
        liger_log_probs_and_entropy(*half, labels, temperature=torch.ones(12))
    liger_log_probs_and_entropy(*half, labels, temperature=0.9)  # a float temperature is fine
    with pytest.raises(ValueError, match=r"labels must have shape \[n\]"):
        liger_log_probs_and_entropy(hidden, weight, labels[:, None].expand(12, 2).contiguous())
    monkeypatch.setattr(liger, "group_size", lambda group: 2)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        liger_log_probs_and_entropy(hidden, weight, labels)
    assert not fake_liger.LigerFusedLinearScaledCrossEntropyTPFunction.calls
    assert len(fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls) == 1  # the bf16 float-T call


def test_tp_variant_called_with_group(fake_liger, monkeypatch, gloo_world):
    """TP > 1 goes to Liger's TP function with the group (its backward reduces d_hidden). The
    group is one rank here, reported as two to Liger's dispatch, and the CUDA refusal is lifted:
    the call's arguments are what is checked."""
    group = dist.new_group([0])
    monkeypatch.setattr(liger, "group_size", lambda g: 2 if g is group else 1)
    monkeypatch.setattr(liger, "_unsupported", lambda hidden, **kwargs: None)
    hidden, weight, labels = case(next_seed())
    logp, _ = liger_log_probs_and_entropy(
        hidden, weight, labels, temperature=1.5, ignore_index=IGNORE_INDEX, tp_group=group
    )
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyTPFunction.calls
    assert call[3] == (group, 1.5, IGNORE_INDEX, 1, True)
    assert not fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    ref = reference(hidden, weight, labels, 1.5)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)


def test_absent_liger_is_a_value_error(monkeypatch):
    for name in ("liger_kernel", "liger_kernel.ops", liger.LIGER_MODULE):
        monkeypatch.setitem(sys.modules, name, None)
    assert not liger.is_available()
    hidden, weight, labels = case(next_seed())
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        liger_log_probs_and_entropy(hidden, weight, labels)


def test_real_liger_cpu_fallback():
    """The installed Liger (its chunked PyTorch fallback on CPU) through the entry point, vs fp64."""
    pytest.importorskip(liger.LIGER_MODULE)
    hidden, weight, labels = case(next_seed(), n=10, h=16, v=40, dtype=torch.float32)
    g = torch.randn(10, generator=generator(3))
    x = hidden.clone().requires_grad_(True)
    logp, ent = liger_log_probs_and_entropy(x, weight, labels, temperature=0.9)
    (logp * g).sum().backward()
    ref = reference(hidden, weight, labels, 0.9, g)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float32, rtol=1e-5, atol=1e-6, track=False)
    assert_close(ent, ref["entropy"], name="entropy", dtype=torch.float32, rtol=1e-5, atol=1e-6, track=False)
    assert_close(
        x.grad,
        ref["d_hidden"],
        name="d_hidden",
        dtype=torch.float32,
        rtol=1e-4,
        terms=ref["d_hidden_terms"],
        track=False,
    )


def test_hopper_path_without_cutlass_dsl_is_named(monkeypatch):
    """Liger's sm90 kernels import ``cutlass`` on first use; the entry point names the missing
    package (and refuses the call with it) instead of Liger failing mid-forward."""
    module = types.ModuleType(liger.LIGER_MODULE)

    def resolve(device):
        if device.type == "cuda":
            raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
        return object

    module._resolve_implementation = resolve
    monkeypatch.setattr(liger, "_liger", lambda: module)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    liger._device_path_missing.cache_clear()
    try:
        reason = liger._device_path_missing(torch.device("cuda", 0))
        assert "nvidia-cutlass-dsl" in reason and "NVIDIA H200" in reason and "cutlass" in reason
        assert liger._device_path_missing(torch.device("cpu")) is None
        del module._resolve_implementation  # a Liger without the dispatcher: nothing to ask
        liger._device_path_missing.cache_clear()
        assert liger._device_path_missing(torch.device("cuda", 0)) is None
    finally:
        liger._device_path_missing.cache_clear()
