"""The ``mcore_ppo`` logger: one INFO line per distinct decision, nothing per call."""

from __future__ import annotations

import logging

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends import TritonBackend, TritonConfig, resolve_backend
from mcore_ppo.logs import forget_logged, log_once


@pytest.fixture
def caplog_info(caplog):
    forget_logged()
    caplog.set_level(logging.DEBUG, logger="mcore_ppo")
    yield caplog
    forget_logged()


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mcore_ppo"]


def test_log_once_logs_a_key_once(caplog_info):
    assert log_once(logging.INFO, ("k", 1), "first %s", "a")
    assert not log_once(logging.INFO, ("k", 1), "again %s", "b")
    assert log_once(logging.INFO, ("k", 2), "other")
    assert _messages(caplog_info) == ["first a", "other"]


def test_backend_choice_logged_once_per_configuration(caplog_info):
    for _ in range(3):
        resolve_backend("auto", torch.device("cpu"))
        resolve_backend("torch", torch.device("cpu"))
    lines = _messages(caplog_info)
    assert lines == [
        "mcore_ppo: backend='auto' on cpu -> 'torch' (the chunked reference): not a CUDA device",
        "mcore_ppo: backend='torch' on cpu -> 'torch'",
    ]
    assert all(r.levelno == logging.INFO for r in caplog_info.records)


def test_calls_log_nothing_after_the_first(caplog_info):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=gen, requires_grad=True)
    weight = torch.randn(32, 8, generator=gen)
    labels = torch.randint(0, 32, (5,), generator=gen)
    fused_log_probs_and_entropy(hidden, weight, labels, tp_group=None)[0].sum().backward()
    first = len(_messages(caplog_info))
    assert first >= 1
    for _ in range(5):
        fused_log_probs_and_entropy(hidden, weight, labels, tp_group=None)[0].sum().backward()
    assert len(_messages(caplog_info)) == first


def test_triton_buffer_decision_logged_once_per_kind(caplog_info, monkeypatch):
    from mcore_ppo.backends import triton_backend

    if not triton_backend.is_available():
        pytest.skip("triton cannot run here")
    # The buffer is the kernels': fp32 CUDA operands run on their own IEEE dots here (by default
    # they take cuBLAS's route, the torch backend's pass, which decides no buffer).
    monkeypatch.setattr(triton_backend.TritonBackend, "_ieee_by_cublas", lambda self, hidden: False)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only under the interpreter
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 16, generator=gen).to(device)
    labels = torch.randint(0, 40, (6,), generator=gen).to(device)
    for budget, grad in ((1 << 20, True), (1 << 20, True), (0, True), (1 << 20, False), (1, True)):
        hidden = torch.randn(6, 16, generator=gen).to(device).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            fused_log_probs_and_entropy(
                hidden, weight, labels, tp_group=None, backend=TritonBackend(TritonConfig(buffer_budget_bytes=budget))
            )
    buffer_lines = [m for m in _messages(caplog_info) if "probability buffer" in m]
    assert [line.split(":")[1].strip() for line in buffer_lines] == [
        "triton probability buffer on",
        "triton probability buffer off",
        "triton probability buffer off",
        "triton probability buffer off",
    ]
    assert "the budget is 0" in buffer_lines[1]
    assert "no gradient will be needed" in buffer_lines[2]
    assert "exceed the budget of 1 " in buffer_lines[3]
