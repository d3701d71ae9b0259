"""``buffer_budget_bytes``: the user option of issue 6's probability buffer, from each entry point to the backend.

Validation: every entry point (API, verl entry, head constructor and forward, ``install_fused_head``)
rejects a wrong type (``TypeError``) or a negative budget (``ValueError``) naming the argument,
before any compute. Plumbing: with ``backend="triton"`` (the kernels run in Triton's CPU
interpreter, ``tests/conftest.py``) the budget given reaches the ``TritonBackend`` and decides
whether the forward keeps the buffer and the backward uses it (spied on the backend); the
outputs and both gradients match the fp64 reference either way. The environment variable is set
to the opposite of the argument to show that the argument wins over it, and None falls back to it.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig

import mcore_ppo
from mcore_ppo import VocabParallelFusedPPOHead
from mcore_ppo.backends import TorchBackend, resolve_backend, torch_backend
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from mcore_ppo.model import install_fused_head
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
if not triton_backend.is_available():  # pragma: no cover - triton installed but neither CUDA nor the interpreter
    pytest.skip("the triton backend cannot run here", allow_module_level=True)

ENV = "MCORE_PPO_BUFFER_BUDGET_BYTES"
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


@pytest.fixture
def spy(monkeypatch):
    """Per forward: ``(buffer_budget_bytes, buffer kept)`` of the TritonBackend; per backward from the buffer: 1."""
    record = {"forward": [], "buffer_backward": []}
    stats = triton_backend.TritonBackend.shard_statistics
    from_buffer = triton_backend.TritonBackend._gradients_from_buffer

    def spied_stats(self, *args, **kwargs):
        out = stats(self, *args, **kwargs)
        record["forward"].append((self.buffer_budget_bytes, out.residual is not None))
        return out

    def spied_from_buffer(self, *args, **kwargs):
        record["buffer_backward"].append(1)
        return from_buffer(self, *args, **kwargs)

    monkeypatch.setattr(triton_backend.TritonBackend, "shard_statistics", spied_stats)
    monkeypatch.setattr(triton_backend.TritonBackend, "_gradients_from_buffer", spied_from_buffer)
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

BAD_TYPES = ["1024", 1024.0, True, torch.tensor(1024)]
BAD_TYPE_IDS = ["str", "float", "bool", "tensor"]


def _small():
    gen = generator(next_seed())
    return (
        torch.randn(6, 8, generator=gen),
        torch.randn(13, 8, generator=gen),
        torch.randint(0, 13, (6,), generator=gen),
    )


@pytest.mark.parametrize("entry", ["api", "verl"])
@pytest.mark.parametrize("value", BAD_TYPES, ids=BAD_TYPE_IDS)
def test_functional_entries_reject_bad_type(entry, value, no_compute):
    hidden, weight, labels = _small()
    fn = mcore_ppo.fused_log_probs_and_entropy if entry == "api" else linear_cross_entropy
    with pytest.raises(TypeError, match=r"buffer_budget_bytes must be an int \(bytes\) or None, got"):
        fn(hidden, weight, labels, backend="triton", buffer_budget_bytes=value)


@pytest.mark.parametrize("entry", ["api", "verl"])
@pytest.mark.parametrize("value", [-1, -(1 << 40)])
def test_functional_entries_reject_negative(entry, value, no_compute):
    hidden, weight, labels = _small()
    fn = mcore_ppo.fused_log_probs_and_entropy if entry == "api" else linear_cross_entropy
    with pytest.raises(ValueError, match=rf"buffer_budget_bytes must be >= 0 \(0 = off\) or None, got {value}"):
        fn(hidden, weight, labels, backend="torch", buffer_budget_bytes=value)


@pytest.mark.parametrize("value", [*BAD_TYPES, -5], ids=[*BAD_TYPE_IDS, "negative"])
def test_head_and_install_reject_bad_values(value, no_compute):
    error = ValueError if value == -5 else TypeError
    with pytest.raises(error, match=r"buffer_budget_bytes must be"):
        make_head(buffer_budget_bytes=value)
    # install_fused_head checks its options before it looks at the model.
    with pytest.raises(error, match=r"buffer_budget_bytes must be"):
        install_fused_head(torch.nn.Linear(2, 2), buffer_budget_bytes=value)
    # The head's attribute may be changed between calls: the forward validates it.
    head = make_head()
    head.buffer_budget_bytes = value
    hidden = torch.randn(5, 16, generator=generator(next_seed()))
    with pytest.raises(error, match=r"buffer_budget_bytes must be"):
        head(hidden, torch.zeros(5, dtype=torch.long))


def test_resolve_backend_passes_the_budget_to_triton_only(monkeypatch):
    monkeypatch.setenv(ENV, "4096")
    assert resolve_backend("triton", DEVICE, buffer_budget_bytes=123).buffer_budget_bytes == 123
    assert resolve_backend("triton", DEVICE, buffer_budget_bytes=0).buffer_budget_bytes == 0
    assert resolve_backend("triton", DEVICE).buffer_budget_bytes == 4096  # None: the environment
    monkeypatch.delenv(ENV)
    default = triton_backend.BUFFER_BUDGET_BYTES
    assert resolve_backend("triton", DEVICE, buffer_budget_bytes=None).buffer_budget_bytes == default
    assert isinstance(resolve_backend("torch", DEVICE, buffer_budget_bytes=123), TorchBackend)


# --- the option reaches the triton backend ---------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "env", "kept"),
    [(BIG, "0", True), (0, str(BIG), False), (None, str(BIG), True), (1, str(BIG), False)],
    ids=["big-over-env-0", "zero-over-env-big", "none-uses-env", "too-small-recomputes"],
)
def test_api_budget_decides_the_buffer(budget, env, kept, monkeypatch, spy):
    monkeypatch.setenv(ENV, env)
    hidden, weight, labels, g, e = make_case(29, 24, 130, next_seed())
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = mcore_ppo.fused_log_probs_and_entropy(
        x, w, labels, temperature=0.7, backend="triton", buffer_budget_bytes=budget
    )
    backward(logp, ent, g, e)
    assert spy["forward"] == [(BIG if budget is None else budget, kept)]
    assert spy["buffer_backward"] == ([1] if kept else [])
    check_outputs(hidden, weight, labels, 0.7, g, e, logp, ent, x.grad, w.grad)


def test_head_budget_used_on_every_forward(monkeypatch, spy):
    """The head's attribute reaches the backend on each call; changing it changes the next call."""
    monkeypatch.delenv(ENV, raising=False)
    head = make_head(backend="triton", temperature=0.9, buffer_budget_bytes=BIG)
    assert head.buffer_budget_bytes == BIG
    gen = generator(next_seed())
    for budget, kept in ((BIG, True), (0, False)):
        head.buffer_budget_bytes = budget
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
    """verl's entry passes the budget on, and (as the API) keeps no buffer when no backward will run."""
    monkeypatch.setenv(ENV, "0")
    hidden, weight, labels, g, e = make_case(21, 16, 75, next_seed())
    with torch.no_grad():
        linear_cross_entropy(
            hidden.clone().requires_grad_(True), weight, labels, backend="triton", buffer_budget_bytes=BIG
        )
    assert spy["forward"] == [(BIG, False)]
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = linear_cross_entropy(x, w, labels, 0.8, backend="triton", buffer_budget_bytes=BIG)
    backward(logp, ent, g, e)
    assert spy["forward"][-1] == (BIG, True) and spy["buffer_backward"] == [1]
    # One rank: verl's partial d_hidden is the whole gradient.
    check_outputs(hidden, weight, labels, 0.8, g, e, logp, ent, x.grad, w.grad)
