"""Σπ² (``return_sum_pi_squared=True``): per token ``Σ_v softmax(z/T)_v²`` against the fp64
full-softmax reference, on every backend (torch, one chunk and several; triton fused, buffer,
recompute, its generic forward, and tiles that cut V = 37 into two vocab splits), with the
entropy on and off, per-token temperatures, ignored tokens, ``k`` ids.

Also: the default return is unchanged (two outputs), the option changes no other output or
gradient (bit for bit), Σπ² carries no gradient, bad types are a ``TypeError`` naming the
option, a bad temperature with ``validate=False`` gives NaN for its token only, Liger's entry
refuses the option, and a hypothesis property test (torch backend) against the reference.
Data: fresh from :func:`mcore_ppo_testing.seeds.next_seed` (printed; ``MCORE_PPO_TEST_SEED``).
Tolerance: Σπ² is a ratio of fp32 sums (``Q / S²``), a few fp32 roundings: ``1e-5`` relative
to its largest value, as the other outputs (``head_checks.OUT_RTOL``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from head_checks import OUT_RTOL, TRITON_ON_CPU, make_case

import mcore_ppo
from mcore_ppo.backends import TorchBackend, TorchConfig
from mcore_ppo.head_call import run_head
from mcore_ppo.options import DEFAULT_LAYOUT, HeadOptions, HiddenGrad, Layout, TokenOrder
from mcore_ppo_testing.reference import assert_close, sum_pi_squared_reference
from mcore_ppo_testing.seeds import base_seed, generator, next_seed

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB, HIDDEN, TOKENS = 37, 16, 12


def _triton(**config):
    from mcore_ppo.backends import TritonBackend, TritonConfig

    return TritonBackend(TritonConfig(**config))


def _triton_splits():
    """One vocab tile per program: V = 37 in two splits, merged per token (the squared factor)."""
    from mcore_ppo.backends.triton_config import INTERPRETER_FORWARD

    return _triton(forward_config=replace(INTERPRETER_FORWARD, tiles_per_split=1))


BACKENDS = [
    pytest.param(lambda: "torch", id="torch"),
    # Several vocab and token chunks with ragged tails: the merge inside a rank rescales q too.
    pytest.param(lambda: TorchBackend(TorchConfig(token_chunk=5, vocab_chunk=8)), id="torch-chunked"),
    pytest.param(lambda: _triton(buffer_budget_bytes=0), id="triton-recompute", marks=TRITON_ON_CPU),
    pytest.param(lambda: _triton(buffer_budget_bytes=1 << 30), id="triton-buffer", marks=TRITON_ON_CPU),
    pytest.param(lambda: _triton(fused_forward=False), id="triton-generic-forward", marks=TRITON_ON_CPU),
    pytest.param(_triton_splits, id="triton-splits", marks=TRITON_ON_CPU),
]


def _temperature(labels: torch.Tensor, kind: str, gen: torch.Generator) -> float | torch.Tensor:
    if kind == "float":
        return 0.7
    return 0.3 + 2.2 * torch.rand(labels.shape, generator=gen)


def _both(case, temperature, backend, *, return_entropy=True, **kwargs):
    """The call with Σπ² and without, each forward + backward of ``Σ g·log_prob (+ Σ e·H)``."""
    results = []
    for with_sp in (False, True):
        hidden = case["hidden"].detach().requires_grad_(True)
        weight = case["weight"].detach().requires_grad_(True)
        out = mcore_ppo.fused_log_probs_and_entropy(
            hidden, weight, case["labels"], temperature=temperature, backend=backend,
            return_entropy=return_entropy, return_sum_pi_squared=with_sp, **kwargs,
        )  # fmt: skip
        assert len(out) == (3 if with_sp else 2)
        loss = (out[0] * case["g"]).sum()
        if out[1] is not None:
            loss = loss + (out[1] * case["e"]).sum()
        loss.backward()
        results.append((out, hidden.grad, weight.grad))
    return results


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("layout", ["2d", "3d", "packed"])
def test_matches_fp64_and_changes_nothing_else(make_backend, layout):
    """Entropy on with per-token temperatures, entropy off with a float: Σπ² against fp64, and
    every other output and both gradients bit for bit those of the call without it."""
    backend = make_backend()
    gen = generator(next_seed())
    for dtype, kind, return_entropy in ((torch.float32, "token", True), (torch.float32, "float", False)):
        case = make_case(layout, dtype, VOCAB, HIDDEN, TOKENS, gen)
        temperature = _temperature(case["labels"], kind, gen)
        (plain, dh0, dw0), (with_sp, dh1, dw1) = _both(case, temperature, backend, return_entropy=return_entropy)
        sp = with_sp[2]
        assert sp.dtype == torch.float32 and sp.shape == case["labels"].shape and not sp.requires_grad
        ref = sum_pi_squared_reference(case["hidden"], case["weight"], case["labels"], temperature)
        assert_close(sp, ref, name=f"sum_pi_squared[{kind}]", dtype=dtype, rtol=OUT_RTOL)
        ignored = case["labels"] == -100
        assert ignored.any() and torch.all(sp[ignored] == 0)
        assert torch.all(sp[~ignored] >= 1.0 / VOCAB) and torch.all(sp[~ignored] <= 1.0)
        assert torch.equal(plain[0], with_sp[0])
        assert (with_sp[1] is None) == (not return_entropy)
        if return_entropy:
            assert torch.equal(plain[1], with_sp[1])
        assert torch.equal(dh0, dh1) and torch.equal(dw0, dw1)


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
def test_dtypes(make_backend, dtype):
    """16-bit inputs against the fp64 reference of the same values; fp64 inputs to fp64 rounding."""
    gen = generator(next_seed())
    case = make_case("3d", dtype, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], "token", gen)
    out = mcore_ppo.fused_log_probs_and_entropy(
        case["hidden"], case["weight"], case["labels"], temperature=temperature, backend=make_backend(),
        return_sum_pi_squared=True,
    )  # fmt: skip
    ref = sum_pi_squared_reference(case["hidden"], case["weight"], case["labels"], temperature)
    rtol = 1e-12 if dtype == torch.float64 else OUT_RTOL
    assert_close(out[2], ref, name=f"sum_pi_squared[{dtype}]", dtype=dtype, rtol=rtol)


@pytest.mark.parametrize("make_backend", BACKENDS)
def test_k_ids_and_edges(make_backend):
    """``[..., k]`` labels: Σπ² per token, equal to the one-label call's (k = 1 and k = 3);
    every token ignored: zeros, no NaN; uniform logits: exactly ``1/V``; one dominant logit: 1."""
    backend = make_backend()
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    hidden, weight, labels = case["hidden"], case["weight"], case["labels"]
    one = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend=backend, return_sum_pi_squared=True)
    ids = torch.randint(0, VOCAB, (*labels.shape, 3), generator=gen)
    ids[..., 0] = labels
    ids[labels == -100] = -100
    for k in (1, 3):
        log_q, _, sp = mcore_ppo.fused_log_probs_at(
            hidden, weight, ids[..., :k], backend=backend, return_sum_pi_squared=True
        )
        assert log_q.shape == ids[..., :k].shape and sp.shape == labels.shape
        assert_close(sp, one[2], name=f"sum_pi_squared[k={k}]", dtype=torch.float32, rtol=OUT_RTOL)
        ref = sum_pi_squared_reference(hidden, weight, ids[..., :k], 1.0)
        assert_close(sp, ref, name=f"sum_pi_squared[k={k}] vs fp64", dtype=torch.float32, rtol=OUT_RTOL)
    all_ignored = torch.full_like(labels, -100)
    out = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, all_ignored, backend=backend, return_sum_pi_squared=True
    )
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    flat = torch.zeros(5, HIDDEN)
    uniform = mcore_ppo.fused_log_probs_and_entropy(
        flat, weight, torch.arange(5), backend=backend, return_sum_pi_squared=True
    )[2]
    assert torch.all((uniform - 1.0 / VOCAB).abs() <= 1e-7 / VOCAB) and torch.all(uniform >= 1.0 / VOCAB)
    peaked = torch.zeros(2, HIDDEN)
    peaked[:, 0] = 1e4
    w = torch.zeros(VOCAB, HIDDEN)
    w[3, 0] = 1.0
    assert torch.equal(
        mcore_ppo.fused_log_probs_and_entropy(peaked, w, torch.tensor([3, 5]), backend=backend,
                                              return_sum_pi_squared=True)[2],
        torch.ones(2),
    )  # fmt: skip


@pytest.mark.parametrize("make_backend", BACKENDS)
def test_bad_temperature_unchecked_is_nan_for_its_token(make_backend):
    gen = generator(next_seed())
    case = make_case("2d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    labels = case["labels"].clone()
    labels[3] = 5
    temperature = torch.full(labels.shape, 0.7)
    temperature[3] = 0.0
    out = mcore_ppo.fused_log_probs_and_entropy(
        case["hidden"], case["weight"], labels, temperature=temperature, backend=make_backend(),
        return_sum_pi_squared=True, validate=False,
    )  # fmt: skip
    assert math.isnan(out[2][3]) and math.isnan(out[1][3])
    others = torch.arange(labels.numel()) != 3
    ref = sum_pi_squared_reference(case["hidden"], case["weight"], labels, temperature.clamp(min=0.7))
    assert_close(out[2][others], ref[others], name="sum_pi_squared", dtype=torch.float32, rtol=OUT_RTOL)


def test_the_returns_and_the_options_object():
    """Default: two outputs. ``HeadOptions(return_sum_pi_squared=True)`` as ``options`` (and
    ``run_head`` with it): three; a keyword False overrides it back to two."""
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    labels = torch.tensor([1, 2, -100, 4, 10, 0])
    assert len(mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend="torch")) == 2
    options = HeadOptions(backend="torch", return_sum_pi_squared=True)
    out = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, options=options)
    assert len(out) == 3
    assert len(mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, options=options,
                                                     return_sum_pi_squared=False)) == 2  # fmt: skip
    direct = run_head(hidden, weight, labels, 1.0, options, tp_group=None, layout=DEFAULT_LAYOUT)
    assert len(direct) == 3 and torch.equal(direct[2], out[2])
    two = run_head(hidden, weight, labels, 1.0, HeadOptions(backend="torch"), tp_group=None, layout=DEFAULT_LAYOUT)
    assert len(two) == 2
    _, entropy, sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, backend="torch", return_entropy=False, return_sum_pi_squared=True
    )
    assert entropy is None and torch.equal(sp, out[2])


def test_flat_token_order_with_a_partial_d_hidden():
    """The layout verl's route runs (``TokenOrder.FLAT``, ``HiddenGrad.PARTIAL``): ``run_head``
    with ``HeadOptions(return_sum_pi_squared=True)`` gives ``[N]`` Σπ² in memory order."""
    gen = generator(next_seed())
    hidden = torch.randn(5, 2, 8, generator=gen)
    weight = torch.randn(13, 8, generator=gen)
    labels = torch.randint(0, 13, (5, 2), generator=gen)
    labels[0, 1] = -100
    temperature = 0.3 + torch.rand(5, 2, generator=gen)
    layout = Layout(TokenOrder.FLAT, HiddenGrad.PARTIAL)
    options = HeadOptions(backend="torch", return_sum_pi_squared=True, return_entropy=False)
    x = hidden.clone().requires_grad_(True)
    log_probs, entropy, sp = run_head(x, weight, labels, temperature, options, tp_group=None, layout=layout)
    assert entropy is None and log_probs.shape == sp.shape == (10,)
    ref = sum_pi_squared_reference(hidden.reshape(10, 8), weight, labels.reshape(10), temperature.reshape(10))
    assert_close(sp, ref, name="sum_pi_squared[flat]", dtype=torch.float32, rtol=OUT_RTOL)
    log_probs.sum().backward()
    assert x.grad is not None


def test_no_gradient_flows():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 10, 0])
    log_prob, entropy, sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, backend="torch", return_sum_pi_squared=True
    )
    assert log_prob.requires_grad and entropy.requires_grad
    assert not sp.requires_grad and sp.grad_fn is None
    with pytest.raises(RuntimeError):
        sp.sum().backward()
    (log_prob.sum() + (entropy * sp).sum()).backward()  # Σπ² as a weight: a constant
    expected_h, expected_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend="torch")
    (lp2.sum() + (ent2 * sp).sum()).backward()
    assert torch.equal(hidden.grad, expected_h) and torch.equal(weight.grad, expected_w)


@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0])
def test_wrong_type_is_a_type_error_naming_it(bad):
    hidden, weight, labels = torch.randn(4, 8), torch.randn(11, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        HeadOptions(return_sum_pi_squared=bad)
    for entry in (mcore_ppo.fused_log_probs_and_entropy, mcore_ppo.fused_log_probs_at):
        call_labels = labels if entry is mcore_ppo.fused_log_probs_and_entropy else labels[:, None]
        with pytest.raises(TypeError, match="return_sum_pi_squared"):
            entry(hidden, weight, call_labels, backend="torch", return_sum_pi_squared=bad)


def test_liger_entry_refuses_it():
    hidden, weight, labels = torch.randn(4, 8), torch.randn(11, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="return_sum_pi_squared"):
        mcore_ppo.liger_log_probs_and_entropy(hidden, weight, labels, return_sum_pi_squared=True)
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        mcore_ppo.liger_log_probs_and_entropy(hidden, weight, labels, return_sum_pi_squared="yes")


@seed(base_seed())
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 10),
    h=st.integers(1, 12),
    vocab=st.integers(1, 40),
    logit_std=st.sampled_from([0.01, 1.0, 10.0, 100.0]),
    temperature=st.sampled_from([1e-4, 0.3, 1.0, 1e4]),
    data_seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_property_torch_backend_matches_fp64(n, h, vocab, logit_std, temperature, data_seed, dtype):
    """Any size (V = 1 included), logit scale and temperature: in ``[1/V, 1]`` and within a few
    roundings of the logits' own error (``eps·scale``, as the property test of the head)."""
    gen = generator(data_seed)
    hidden = (torch.randn(n, h, generator=gen, dtype=torch.float64) * logit_std).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen, dtype=torch.float64) / math.sqrt(h)).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, temperature=temperature, backend="torch", return_sum_pi_squared=True
    )[2]
    ref = sum_pi_squared_reference(hidden, weight, labels, temperature)
    valid = labels != -100
    assert torch.all(sp[~valid] == 0)
    assert torch.all(sp[valid] >= (1.0 / vocab) * (1 - 1e-7)) and torch.all(sp[valid] <= 1.0)
    eps = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    scale = max(1.0, (hidden.double() @ weight.double().t()).abs().max().item() / temperature)
    # Σπ² moves by ~2·Σπ²·δz under a logit error δz: relative error a few eps·scale.
    assert torch.all((sp.double() - ref).abs() <= 32 * eps * scale * ref + 1e-300)
