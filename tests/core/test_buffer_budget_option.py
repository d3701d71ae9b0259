"""``buffer_budget_bytes``: the triton backend's probability-buffer budget, a setting of the backend.

Validation: ``TritonConfig(buffer_budget_bytes=...)`` rejects a wrong type (``TypeError``) or a
negative budget (``ValueError``) naming the argument; no entry point takes the knob. Plumbing:
a ``TritonBackend`` passed as ``backend`` to each entry point (the kernels run in Triton's CPU
interpreter, ``tests/conftest.py``) decides with its budget whether the forward keeps the
buffer and the backward uses it (spied on the backend); the outputs and both gradients match
the fp64 reference either way. The environment variable is set to the opposite of the
backend's budget to show that it does not reach a backend the caller built; it is the default
of the backend that ``backend="triton"`` resolves to, read once when that is built.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig

import mcore_ppo
from mcore_ppo import VocabParallelFusedPPOHead
from mcore_ppo.backends import TorchBackend, clear_backend_cache, resolve_backend, torch_backend
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from mcore_ppo.model import install_fused_head
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
if not triton_backend.is_available():  # pragma: no cover - triton installed but neither CUDA nor the interpreter
    pytest.skip("the triton backend cannot run here", allow_module_level=True)
TritonBackend = triton_backend.TritonBackend
TritonConfig = triton_backend.TritonConfig

ENV = "MCORE_PPO_BUFFER_BUDGET_BYTES"
DEFAULT_BUDGET = TritonConfig().buffer_budget_bytes
BIG = 1 << 30
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def no_compute(monkeypatch):
    """Fail loudly if a backend is reached: validation must raise before any compute."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the backend ran before validation rejected the input")

    for cls in (torch_backend.TorchBackend, triton_backend.TritonBackend):
        monkeypatch.setattr(cls, "shard_statistics", forbidden)
        monkeypatch.setattr(cls, "shard_gradients", forbidden)
    monkeypatch.setattr(triton_backend.TritonBackend, "head_forward", forbidden)


@pytest.fixture
def spy(monkeypatch):
    """Per forward: ``(buffer_budget_bytes, buffer kept)`` of the TritonBackend; per backward from the buffer: 1."""
    record = {"forward": [], "buffer_backward": []}
    # The forward kernel's launch, shared by head_forward and shard_statistics; the budget is the
    # one of the backend whose plan was taken last (each forward takes its plan just before).
    from mcore_ppo.backends import triton_forward

    # The buffer is the kernels': fp32 CUDA operands run on their own IEEE dots here (by default
    # they take cuBLAS's route, the torch backend's pass, which keeps no buffer).
    monkeypatch.setattr(triton_backend.TritonBackend, "_ieee_by_cublas", lambda self, hidden: False)
    stats = triton_forward.statistics_launch
    forward_plan = triton_backend.TritonBackend._forward_plan
    from_buffer = triton_backend.gradients_from_buffer
    budget = []

    def spied_plan(self, *args, **kwargs):
        budget[:] = [self.config.buffer_budget_bytes]
        return forward_plan(self, *args, **kwargs)

    def spied_stats(*args, **kwargs):
        out = stats(*args, **kwargs)
        record["forward"].append((budget[0], bool(out[1])))
        return out

    def spied_from_buffer(backend, *args, **kwargs):
        record["buffer_backward"].append(1)
        return from_buffer(backend, *args, **kwargs)

    monkeypatch.setattr(triton_backend.TritonBackend, "_forward_plan", spied_plan)
    monkeypatch.setattr(triton_forward, "statistics_launch", spied_stats)
    monkeypatch.setattr(triton_backend, "statistics_launch", spied_stats)
    monkeypatch.setattr(triton_backend, "gradients_from_buffer", spied_from_buffer)
    return record


def make_case(n: int, h: int, v: int, seed: int):
    """fp32 inputs (the interpreter's bf16 arithmetic is not the GPU's), ~30 % ignored tokens."""
    gen = generator(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = IGNORE_INDEX
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    e = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden.float().to(DEVICE), weight.float().to(DEVICE), labels.to(DEVICE), g.float(), e.float()


def check_outputs(hidden, weight, labels, temperature, g, e, logp, ent, dh, dw):
    """Outputs and gradients vs fp64 (tolerances of tests/test_triton_backend.py for fp32)."""
    ref = reference(hidden.cpu(), weight.cpu(), labels.cpu(), temperature, g, e)
    assert_close(logp.detach().cpu(), ref["log_prob"], name="log_prob", dtype=torch.float32, rtol=2e-6, atol=1e-6)
    assert_close(ent.detach().cpu(), ref["entropy"], name="entropy", dtype=torch.float32, rtol=2e-6, atol=1e-6)
    for name, got in (("d_hidden", dh), ("d_weight", dw)):
        assert_close(
            got.cpu(), ref[name], name=name, dtype=torch.float32, rtol=2e-5, atol=1e-30, terms=ref[f"{name}_terms"]
        )


def backward(logp, ent, g, e):
    torch.autograd.backward([logp, ent], [g.to(DEVICE), e.to(DEVICE)])


def make_head(**kwargs) -> VocabParallelFusedPPOHead:
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    head = VocabParallelFusedPPOHead(16, 37, config=config, init_method=torch.nn.init.normal_, **kwargs)
    return head.to(DEVICE)  # initialised on the CPU (no process group needed), used where the inputs are


# --- validation ----------------------------------------------------------------------------------

BAD_TYPES = [1024.0, True, torch.tensor(1024)]
BAD_TYPE_IDS = ["float", "bool", "tensor"]


def _small():
    gen = generator(next_seed())
    return (
        torch.randn(6, 8, generator=gen),
        torch.randn(13, 8, generator=gen),
        torch.randint(0, 13, (6,), generator=gen),
    )


@pytest.mark.parametrize("value", [*BAD_TYPES, -5, "-5", "1 parsec"], ids=[*BAD_TYPE_IDS, "negative", "text-", "unit"])
def test_backend_rejects_bad_budgets(value):
    error = TypeError if not isinstance(value, (int, str)) or isinstance(value, bool) else ValueError
    with pytest.raises(error, match=r"^buffer_budget_bytes must be"):
        TritonConfig(buffer_budget_bytes=value)


@pytest.mark.parametrize("entry", ["api", "verl", "head", "install"])
def test_the_knob_is_the_backends_not_the_entry_points(entry, no_compute):
    """``buffer_budget_bytes`` is a setting of the triton backend: no entry point takes it."""
    hidden, weight, labels = _small()
    call = {
        "api": lambda: mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, buffer_budget_bytes=0),
        "verl": lambda: linear_cross_entropy(hidden, weight, labels, buffer_budget_bytes=0),
        "head": lambda: make_head(buffer_budget_bytes=0),
        "install": lambda: install_fused_head(torch.nn.Linear(2, 2), buffer_budget_bytes=0),
    }[entry]
    with pytest.raises(TypeError, match="buffer_budget_bytes"):
        call()


def test_resolved_triton_backend_reads_the_environment_once(monkeypatch):
    """By name: one backend per (name, device type), its budget from the environment when it was
    built; a TritonBackend built by the caller ignores the environment."""
    monkeypatch.setenv(ENV, "4096")
    clear_backend_cache()
    first = resolve_backend("triton", DEVICE)
    assert first.config.buffer_budget_bytes == 4096
    monkeypatch.setenv(ENV, "1KiB")
    assert resolve_backend("triton", DEVICE) is first and first.config.buffer_budget_bytes == 4096
    assert TritonBackend().config.buffer_budget_bytes == DEFAULT_BUDGET
    clear_backend_cache()
    assert resolve_backend("triton", DEVICE).config.buffer_budget_bytes == 1024
    monkeypatch.delenv(ENV)
    clear_backend_cache()
    assert resolve_backend("triton", DEVICE).config.buffer_budget_bytes == DEFAULT_BUDGET
    assert isinstance(resolve_backend("torch", DEVICE), TorchBackend)
    assert resolve_backend("torch", DEVICE) is resolve_backend("torch", DEVICE)
    own = TritonBackend(TritonConfig(buffer_budget_bytes=7))
    assert resolve_backend(own, DEVICE) is own


# --- the option reaches the triton backend ---------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "env", "kept"),
    [(BIG, "0", True), (0, str(BIG), False), (None, "0", True), ("env", str(BIG), True), (1, str(BIG), False)],
    ids=["big-over-env-0", "zero-over-env-big", "none-module-default", "by-name-uses-env", "too-small-recomputes"],
)
def test_api_budget_decides_the_buffer(budget, env, kept, monkeypatch, spy):
    monkeypatch.setenv(ENV, env)
    hidden, weight, labels, g, e = make_case(29, 24, 130, next_seed())
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    backend = {"env": "triton", None: TritonBackend()}.get(budget) or TritonBackend(
        TritonConfig(buffer_budget_bytes=budget)
    )
    logp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend=backend)
    backward(logp, ent, g, e)
    expected = {None: DEFAULT_BUDGET, "env": int(env)}.get(budget, budget)
    assert spy["forward"] == [(expected, kept)]
    assert spy["buffer_backward"] == ([1] if kept else [])
    check_outputs(hidden, weight, labels, 0.7, g, e, logp, ent, x.grad, w.grad)


def test_head_backend_used_on_every_forward(monkeypatch, spy):
    """The head's backend object reaches every call; setting another changes the next call."""
    monkeypatch.delenv(ENV, raising=False)
    head = make_head(backend=TritonBackend(TritonConfig(buffer_budget_bytes=BIG)), temperature=0.9)
    assert head.backend.config.buffer_budget_bytes == BIG
    gen = generator(next_seed())
    for budget, kept in ((BIG, True), (0, False)):
        head.backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget))
        hidden = torch.randn(7, 3, 16, generator=gen).to(DEVICE)
        labels = torch.randint(0, 37, (3, 7), generator=gen).to(DEVICE)
        labels[0, :2] = IGNORE_INDEX
        g, e = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
        head.weight.grad = None
        x = hidden.clone().requires_grad_(True)
        logp, ent = head(x, labels)
        backward(logp, ent, g, e)
        assert spy["forward"][-1] == (budget, kept)
        assert len(spy["buffer_backward"]) == 1  # the first call only
        check_outputs(hidden, head.weight.detach(), labels, 0.9, g, e, logp, ent, x.grad, head.weight.grad)


def test_verl_entry_budget_and_no_grad(monkeypatch, spy):
    """verl's entry takes the backend object, and (as the API) keeps no buffer when no backward will run."""
    monkeypatch.setenv(ENV, "0")
    hidden, weight, labels, g, e = make_case(21, 16, 75, next_seed())
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=BIG))
    with torch.no_grad():
        linear_cross_entropy(hidden.clone().requires_grad_(True), weight, labels, backend=backend)
    assert spy["forward"] == [(BIG, False)]
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = linear_cross_entropy(x, w, labels, 0.8, backend=backend)
    backward(logp, ent, g, e)
    assert spy["forward"][-1] == (BIG, True) and spy["buffer_backward"] == [1]
    # One rank: verl's partial d_hidden is the whole gradient.
    check_outputs(hidden, weight, labels, 0.8, g, e, logp, ent, x.grad, w.grad)
