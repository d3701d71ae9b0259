"""The head as torch ops (``mcore_ppo::head_forward`` / ``head_backward``, :mod:`mcore_ppo.ops`).

- ``torch.library.opcheck`` of both ops (schema, fake tensors, autograd registration, AOT
  dispatch with static and dynamic shapes) over the calls the head makes: one label or ``k``
  ids, entropy on and off, Σπ², a per-token temperature, given statistics (lse, entropy, Σπ²), with and
  without a backward, on the torch backend (fp32, fp64) and the triton backend (interpreter).
- Saved-tensor hooks see every tensor the backward reads, the triton probability buffer
  included: an offloading hook that moves each one away and back leaves the gradients unchanged.
- A second backward (``retain_graph``) after the first consumed the buffer recomputes, equal.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mcore_ppo
from mcore_ppo.backends import TorchBackend, TorchConfig
from mcore_ppo.ops import HeadCall, HeadFunction
from mcore_ppo.options import HiddenGrad, WeightGrad
from mcore_ppo.statistics import Statistics
from mcore_ppo_testing.seeds import generator, next_seed

# The triton backend runs CPU tensors only under Triton's interpreter (tests/conftest.py sets it
# where there is no CUDA; a GPU machine runs the triton cases in tests/gpu/test_gpu_ops.py).
TRITON_ON_CPU = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1",
)
FORWARD = torch.ops.mcore_ppo.head_forward.default
BACKWARD = torch.ops.mcore_ppo.head_backward.default
N, H, V, K = 13, 16, 40, 3


def _triton(**settings):
    from mcore_ppo.backends import TritonBackend, TritonConfig, triton_config

    return TritonBackend(
        TritonConfig(
            forward_config=triton_config.INTERPRETER_FORWARD,
            backward_config=triton_config.INTERPRETER_BACKWARD,
            **settings,
        )
    )


BACKENDS = {
    "torch": lambda: TorchBackend(TorchConfig(token_chunk=8, vocab_chunk=16)),
    "triton-recompute": lambda: _triton(buffer_budget_bytes=0),
    "triton-buffer": lambda: _triton(buffer_budget_bytes=1 << 30),
}


def _inputs(dtype, *, ids: bool, row_temperature: bool, seed: int, ignored: bool = True):
    gen = generator(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N, K) if ids else (N,), generator=gen)
    if ignored:
        labels[:3] = -100
    temperature = None
    if row_temperature:
        rows = 0.5 + torch.rand(N, generator=gen, dtype=torch.float64)
        temperature = rows.to(torch.promote_types(dtype, torch.float32))
    return hidden, weight, labels, temperature


def _call(backend, *, return_entropy=True, return_sum_pi_squared=False) -> HeadCall:
    names = [name for name, on in (("entropy", return_entropy), ("sum_pi_squared", return_sum_pi_squared)) if on]
    return HeadCall(
        backend=backend.op_key, tp_group="", hidden_grad=HiddenGrad.PARTIAL, weight_grad=WeightGrad.GRAD,
        ignore_index=-100, vocab_start=0, vocab_size=V, temperature_value=0.7, statistics=Statistics.named(names),
        labels_in_range=False,
    )  # fmt: skip


def _forward_args(hidden, weight, labels, temperature, given_statistics, call: HeadCall, grad_needed: bool):
    return (
        hidden, weight, labels, temperature, call.temperature_value, given_statistics, call.ignore_index,
        call.vocab_start, call.vocab_size, call.backend, call.tp_group, call.hidden_grad.value, call.statistics.key,
        call.labels_in_range, grad_needed,
    )  # fmt: skip


CASES = {
    # name: (dtype, ids, entropy, Σπ², per-token temperature, given statistics)
    "label": (torch.float32, False, True, False, False, False),
    "label-fp64": (torch.float64, False, True, False, False, False),
    "label-no-entropy-sum-pi": (torch.float32, False, False, True, False, False),
    "label-row-temperature": (torch.float32, False, True, True, True, False),
    "ids": (torch.float32, True, True, False, False, False),
    "ids-given-statistics": (torch.float32, True, False, False, False, True),
    "ids-given-entropy-sum-pi": (torch.float32, True, True, True, False, True),
}


def _backend_params(names):
    return [pytest.param(name, marks=TRITON_ON_CPU) if name.startswith("triton") else name for name in names]


# The triton backend on the cases where its paths differ (fused or generic forward, buffer or not).
OPCHECK = [(backend, case) for backend in ("torch",) for case in CASES] + [
    ("triton-recompute", "label"), ("triton-recompute", "label-no-entropy-sum-pi"),
    ("triton-buffer", "label-row-temperature"), ("triton-buffer", "ids"), ("triton-buffer", "ids-given-entropy-sum-pi"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("backend_name", "case"),
    [pytest.param(b, c, marks=TRITON_ON_CPU) if b.startswith("triton") else (b, c) for b, c in OPCHECK],
)
def test_opcheck_forward_and_backward(backend_name, case):
    """opcheck of ``head_forward`` (with inputs that require grad: its autograd registration is
    checked too) and of ``head_backward`` on the tensors a real forward saved."""
    dtype, ids, entropy, sum_pi, row_temperature, normalized = CASES[case]
    backend = BACKENDS[backend_name]()
    # The buffer's rows past the valid ones (ignored tokens, in compacted order) are never written:
    # opcheck compares every output of two runs, so the buffer's case has no ignored token.
    hidden, weight, labels, temperature = _inputs(
        dtype, ids=ids, row_temperature=row_temperature, seed=next_seed(), ignored=backend_name != "triton-buffer"
    )
    given_statistics = None
    call = _call(backend, return_entropy=entropy, return_sum_pi_squared=sum_pi)
    if normalized:
        t = 0.7 if temperature is None else temperature[:, None]
        z = (hidden @ weight.T).double() / t
        lse = torch.logsumexp(z, dim=1)
        p = torch.softmax(z, dim=1)
        values = {"entropy": lse - (p * z).sum(dim=1), "sum_pi_squared": (p * p).sum(dim=1)}
        rows = call.statistics.finished(lse, values)
        given_statistics = rows.to(torch.promote_types(dtype, torch.float32))
    for grad_needed in (False, True):
        args = _forward_args(
            hidden.requires_grad_(grad_needed), weight.requires_grad_(grad_needed), labels, temperature,
            given_statistics, call, grad_needed,
        )  # fmt: skip
        torch.library.opcheck(FORWARD, args)
    # The backward on what a real forward saved (the residual included), with each upstream gradient.
    with torch.no_grad():
        args = _forward_args(hidden, weight, labels, temperature, given_statistics, call, True)
        log_prob, _, _, saved = FORWARD(*args)
    from mcore_ppo.ops import SavedLayout

    layout = SavedLayout.of(labels, call.statistics, HiddenGrad.PARTIAL, "")
    _, lse, saved_entropy, local_labels, valid, local_ids, slot_ok, residual = layout.unpack(saved)
    g = torch.randn(log_prob.shape, generator=generator(next_seed()), dtype=log_prob.dtype)
    e = torch.randn(N, generator=generator(next_seed()), dtype=log_prob.dtype) if saved_entropy is not None else None
    for need_hidden, need_weight in ((True, True), (True, False), (False, True)):
        args = (
            g, e, hidden.detach(), weight.detach(), lse, saved_entropy, local_labels, valid, local_ids, slot_ok,
            [r.clone() for r in residual], temperature, call.temperature_value, None, call.backend, "",
            HiddenGrad.PARTIAL.value, need_hidden, need_weight,
        )  # fmt: skip
        torch.library.opcheck(BACKWARD, args)


@pytest.mark.parametrize("backend_name", _backend_params(["torch", "triton-buffer"]))
def test_saved_tensor_hooks_see_the_buffer(backend_name):
    """An offloading hook (each saved tensor moved away on pack, back on unpack) sees every tensor
    the backward reads, the probability buffer ``[n, V]`` included, and the gradients are unchanged."""
    backend = BACKENDS[backend_name]()
    hidden, weight, labels, _ = _inputs(torch.float32, ids=False, row_temperature=False, seed=next_seed())
    seed = next_seed()

    def grads(hooks: bool):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.to("meta").shape, t.dtype, t.clone()  # "offloaded": a copy the graph does not hold

        def unpack(stored):
            return stored[2]

        context = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if hooks else torch.enable_grad()
        with context:
            log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(h, w, labels, temperature=0.7, backend=backend)
        gen = generator(seed)
        (log_prob * torch.randn(N, generator=gen)).sum().add((entropy * torch.randn(N, generator=gen)).sum()).backward()
        return h.grad, w.grad, packed

    plain_h, plain_w, _ = grads(False)
    hooked_h, hooked_w, packed = grads(True)
    assert torch.equal(plain_h, hooked_h) and torch.equal(plain_w, hooked_w)
    if backend_name == "triton-buffer":
        assert (N, V) in packed, f"the probability buffer was not saved through the hooks: {packed}"


@TRITON_ON_CPU
def test_second_backward_recomputes_after_the_buffer_is_consumed():
    """retain_graph: the first backward turns the buffer into dz in place; the second recomputes
    and gives the same gradients."""
    backend = BACKENDS["triton-buffer"]()
    hidden, weight, labels, _ = _inputs(torch.float32, ids=False, row_temperature=False, seed=next_seed())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(h, w, labels, temperature=0.7, backend=backend)
    loss = log_prob.sum() + 0.5 * entropy.sum()
    loss.backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss.backward()
    torch.testing.assert_close(h.grad, first[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, first[1], rtol=1e-5, atol=1e-6)


def test_the_function_and_the_registered_autograd_agree():
    """The op called directly (autograd through ``register_autograd``) and the head's
    ``HeadFunction`` give the same outputs and gradients."""
    backend = BACKENDS["torch"]()
    hidden, weight, labels, _ = _inputs(torch.float64, ids=False, row_temperature=False, seed=next_seed())
    call = _call(backend)
    results = []
    for direct in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if direct:
            log_prob, entropy, _, _ = FORWARD(*_forward_args(h, w, labels, None, None, call, True))
        else:
            log_prob, entropy, _ = HeadFunction.apply(h, w, labels, None, None, call)
        (log_prob.sum() + entropy.sum()).backward()
        results.append((log_prob.detach(), entropy.detach(), h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _OpsSeen(TorchDispatchMode):
    """A pass-through dispatch mode that records the ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend_name", _backend_params(["torch", "triton-buffer"]))
def test_an_eager_call_watched_by_a_mode_goes_through_the_ops_with_the_same_results(backend_name):
    """Eager calls without a watcher run the ops' implementation directly; a dispatch mode (what
    fake tensors, ``make_fx``, selective checkpointing and op counters are) sees the two ops
    instead of their insides, and the outputs and gradients are identical either way."""
    backend = BACKENDS[backend_name]()
    hidden, weight, labels, temperature = _inputs(torch.float32, ids=False, row_temperature=True, seed=next_seed())
    gen = generator(next_seed())
    g, e = torch.randn(N, generator=gen), torch.randn(N, generator=gen)

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        call = dict(temperature=temperature, backend=backend)
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(h, w, labels, **call)
        ((log_prob * g).sum() + (entropy * e).sum()).backward()
        with torch.no_grad():
            no_grad = mcore_ppo.fused_log_probs_and_entropy(h, w, labels, **call)
        return log_prob.detach(), entropy.detach(), h.grad, w.grad, *no_grad

    plain = run()
    mode = _OpsSeen()
    with mode:
        watched = run()
    head_ops = [op for op in mode.ops if op.namespace == "mcore_ppo"]
    assert head_ops == [FORWARD, BACKWARD, FORWARD], head_ops
    for a, b in zip(plain, watched, strict=True):
        assert torch.equal(a, b)


def test_the_profiler_names_the_head_ops():
    """Under ``torch.profiler`` a call goes through the ops, whose ranges carry their names."""
    backend = BACKENDS["torch"]()
    hidden, weight, labels, _ = _inputs(torch.float32, ids=False, row_temperature=False, seed=next_seed())
    h = hidden.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        log_prob, _ = mcore_ppo.fused_log_probs_and_entropy(h, weight, labels, backend=backend)
        log_prob.sum().backward()
    names = {event.name for event in profile.events()}
    assert {"mcore_ppo::head_forward", "mcore_ppo::head_backward"} <= names, sorted(names)[:40]


def test_a_temperature_that_requires_grad_gets_no_graph():
    """The temperature gets no gradient (the head's contract): with ``hidden`` and ``weight``
    not requiring grad, a temperature tensor that does leaves the outputs without a graph."""
    backend = BACKENDS["torch"]()
    hidden, weight, labels, temperature = _inputs(torch.float32, ids=False, row_temperature=True, seed=next_seed())
    temperature.requires_grad_(True)
    call = dict(temperature=temperature, backend=backend)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, **call)
    assert log_prob.grad_fn is None and entropy.grad_fn is None
    assert not log_prob.requires_grad and not entropy.requires_grad
