"""The ``liger`` backend's dispatch, on CPU, with a fake Liger module in ``sys.modules``.

The fake records how it was called and computes ``(nll, entropy)`` with the fp64 reference
(differentiable), so the test checks what the head does around Liger: argument order, the
sign of nll, layouts, ignored tokens, gradients, and the cases it must refuse. A last test
runs the real Liger (its PyTorch fallback on CPU) when it is installed.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy, linear_cross_entropy
from mcore_ppo.backends import liger_backend, resolve_backend
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
        # Liger's CuTe path returns entropy in the input dtype: the head must hand back fp32.
        return (-logp).to(x.dtype), ent.to(torch.bfloat16)


@pytest.fixture
def fake_liger(monkeypatch):
    module = types.ModuleType(liger_backend.LIGER_MODULE)
    module.LigerFusedLinearScaledCrossEntropyFunction = FakeLiger()
    module.LigerFusedLinearScaledCrossEntropyTPFunction = FakeLiger()
    for name in ("liger_kernel", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, liger_backend.LIGER_MODULE, module)
    return module


def case(seed, n=12, h=8, v=30, dtype=torch.float64):
    gen = generator(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = IGNORE_INDEX
    return hidden, weight, labels


def test_available_with_fake(fake_liger):
    assert liger_backend.is_available()
    assert isinstance(resolve_backend("liger", torch.device("cpu")), liger_backend.LigerBackend)


def test_dispatch_2d(fake_liger):
    hidden, weight, labels = case(next_seed())
    x = hidden.clone().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(
        x, weight, labels, temperature=0.7, ignore_index=IGNORE_INDEX, backend="liger"
    )
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert call[2].dtype == torch.int64
    assert call[3] == (0.7, IGNORE_INDEX, 1, True)  # temperature, ignore_index, m_tiles_per_cluster, return_entropy
    assert not fake_liger.LigerFusedLinearScaledCrossEntropyTPFunction.calls
    assert logp.dtype == ent.dtype == torch.float32
    ref = reference(hidden, weight, labels, 0.7, torch.ones(12, dtype=torch.float64))
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)
    assert_close(ent, ref["entropy"], name="entropy", dtype=torch.float64, rtol=1e-2, track=False)  # bf16 entropy
    logp.sum().backward()
    assert_close(x.grad, ref["d_hidden"], name="d_hidden", dtype=torch.float64, rtol=1e-6, track=False)


def test_dispatch_megatron_layout(fake_liger):
    """[s, b, h] hidden with [b, s] labels: tokens passed sequence-major, outputs back as [b, s]."""
    s, b, h, v = 5, 3, 8, 20
    gen = generator(next_seed())
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s), generator=gen)
    logp, ent = fused_log_probs_and_entropy(hidden, weight, labels, temperature=1.0, backend="liger")
    assert logp.shape == ent.shape == (b, s)
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert torch.equal(call[2], labels.t().reshape(-1))
    ref = reference(hidden, weight, labels, 1.0)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)


def test_verl_entry_dispatches_to_liger(fake_liger):
    """verl's entry runs Liger through the same pipeline: its own token order (no transpose),
    verl's reduction, values and d_hidden as the reference."""
    s, b, h, v = 5, 3, 8, 20
    gen = generator(next_seed())
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (s, b), generator=gen)  # verl pairs hidden[i, j] with labels[i, j]
    labels[0, 1] = IGNORE_INDEX
    x = hidden.clone().requires_grad_(True)
    logp, ent = linear_cross_entropy(x, weight, labels, 0.8, backend="liger")
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyFunction.calls
    assert torch.equal(call[2], labels.reshape(-1)) and call[3] == (0.8, IGNORE_INDEX, 1, True)
    assert logp.shape == ent.shape == (s * b,) and logp.dtype == ent.dtype == torch.float32
    flat_hidden, flat_labels = hidden.reshape(-1, h), labels.reshape(-1)
    g = torch.randn(s * b, generator=gen, dtype=torch.float64)
    ref = reference(flat_hidden, weight, flat_labels, 0.8, g)
    assert_close(logp, ref["log_prob"], name="log_prob", dtype=torch.float64, rtol=1e-6, track=False)
    assert_close(ent, ref["entropy"], name="entropy", dtype=torch.float64, rtol=1e-2, track=False)  # bf16 entropy
    (logp * g).sum().backward()
    assert x.grad.shape == hidden.shape
    assert_close(x.grad.reshape(-1, h), ref["d_hidden"], name="d_hidden", dtype=torch.float64, rtol=1e-6, track=False)
    total, _ = linear_cross_entropy(hidden, weight, labels, 0.8, "sum", backend="liger")
    torch.testing.assert_close(total, logp.detach().sum())


def test_verl_entry_refuses_liger_tp(fake_liger):
    """Liger's TP function reduces d_hidden itself; verl's contract returns the partial one."""
    reason = liger_backend.LigerBackend().unsupported(2, False, torch.zeros(2, 4), reduce_hidden_grad=False)
    assert reason is not None and "partial" in reason


def test_refuses_sequence_parallel_and_cpu_tp():
    backend = liger_backend.LigerBackend()
    hidden = torch.zeros(2, 4)
    assert "sequence parallelism" in backend.unsupported(2, True, hidden)
    assert backend.unsupported(1, False, hidden) is None


def test_tp_needs_cuda(fake_liger):
    reason = liger_backend.LigerBackend().unsupported(2, False, torch.zeros(2, 4))
    assert reason is not None and "CUDA" in reason


def test_tp_variant_called_with_group(fake_liger, monkeypatch):
    """TP > 1 without SP goes to Liger's TP function with the group (its backward reduces d_hidden)."""
    monkeypatch.setattr(liger_backend, "group_size", lambda group: 2)
    hidden, weight, labels = case(next_seed())
    group = object()
    liger_backend.LigerBackend().log_probs_and_entropy(
        hidden, weight, labels, temperature=1.5, ignore_index=IGNORE_INDEX, tp_group=group
    )
    (call,) = fake_liger.LigerFusedLinearScaledCrossEntropyTPFunction.calls
    assert call[3] == (group, 1.5, IGNORE_INDEX, 1, True)


def test_absent_liger_is_unavailable(monkeypatch):
    for name in ("liger_kernel", "liger_kernel.ops", liger_backend.LIGER_MODULE):
        monkeypatch.setitem(sys.modules, name, None)
    assert not liger_backend.is_available()
    with pytest.raises(RuntimeError, match="backend='liger' is not available"):
        resolve_backend("liger", torch.device("cpu"))


def test_real_liger_cpu_fallback():
    """The installed Liger (its chunked PyTorch fallback on CPU) through the head, vs fp64."""
    pytest.importorskip(liger_backend.LIGER_MODULE)
    hidden, weight, labels = case(next_seed(), n=10, h=16, v=40, dtype=torch.float32)
    g = torch.randn(10, generator=generator(3))
    x = hidden.clone().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(x, weight, labels, temperature=0.9, backend="liger")
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
    """Liger's sm90 kernels import ``cutlass`` on first use; the backend names the missing
    package (and the pipeline refuses with it) instead of Liger failing mid-forward."""
    module = types.ModuleType(liger_backend.LIGER_MODULE)

    def resolve(device):
        if device.type == "cuda":
            raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
        return object

    module._resolve_implementation = resolve
    monkeypatch.setattr(liger_backend, "_liger", lambda: module)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    liger_backend._device_path_missing.cache_clear()
    try:
        reason = liger_backend._device_path_missing(torch.device("cuda", 0))
        assert "nvidia-cutlass-dsl" in reason and "NVIDIA H200" in reason and "cutlass" in reason
        assert liger_backend._device_path_missing(torch.device("cpu")) is None
        del module._resolve_implementation  # a Liger without the dispatcher: nothing to ask
        liger_backend._device_path_missing.cache_clear()
        assert liger_backend._device_path_missing(torch.device("cuda", 0)) is None
    finally:
        liger_backend._device_path_missing.cache_clear()
