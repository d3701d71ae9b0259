"""What fuzzing the head's API beyond the documented bad inputs turned up, and what it confirmed (both backends).

- NaN/inf in a valid row of ``hidden``: that token's outputs and ``d_hidden`` row are NaN, every
  other token is exactly what it is without it. Before: the triton buffer mode masked the NaN
  probabilities out with the underflows (``b > 0``), giving that row a finite, wrong ``d_hidden``.
- A NaN in the weight poisons every valid token (never a plausible number).
- Expanded (stride-0) hidden or weight, ``torch.inference_mode``, activation checkpointing
  (reentrant and not), ``torch.use_deterministic_algorithms(True)``, a second backward with
  ``retain_graph`` (the triton buffer is consumed by the first: the second recomputes): the
  fp64-correct result, found fine and kept as tests.
"""

from __future__ import annotations

import pytest
import torch
from head_checks import TRITON_ON_CPU, plain_case, with_budget
from torch.utils.checkpoint import checkpoint

import mcore_ppo
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

# (backend, buffer_budget_bytes): the triton backend's recompute and probability-buffer backwards.
PATHS = [
    pytest.param("torch", None, id="torch"),
    pytest.param("triton", 0, id="triton-recompute", marks=TRITON_ON_CPU),
    pytest.param("triton", 1 << 30, id="triton-buffer", marks=TRITON_ON_CPU),
]


def forward_backward(hidden, weight, labels, g, e, backend, budget, wrap=None):
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def head(x, w):
        return mcore_ppo.fused_log_probs_and_entropy(
            x, w, labels, temperature=0.8, backend=with_budget(backend, budget)
        )

    log_prob, entropy = (wrap or (lambda f, *a: f(*a)))(head, x, w)
    ((log_prob * g).sum() + (entropy * e).sum()).backward()
    return log_prob.detach(), entropy.detach(), x.grad, w.grad


def check_reference(result, hidden, weight, labels, g, e):
    ref = reference(hidden, weight, labels, 0.8, g, e)
    for name, value in zip(("log_prob", "entropy", "d_hidden", "d_weight"), result, strict=True):
        terms = ref.get(name + "_terms")
        assert_close(value, ref[name], name=name, dtype=torch.float32, rtol=1e-5, atol=1e-30, terms=terms, track=False)


@pytest.mark.parametrize(("backend", "budget"), PATHS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_valid_row_is_nan_and_stays_in_its_row(backend, budget, bad):
    hidden, weight, labels, g, e = plain_case()
    clean = forward_backward(hidden, weight, labels, g, e, backend, budget)
    poisoned = hidden.clone()
    poisoned[1, 3] = bad  # row 1 is a valid token (every 4th is ignored)
    log_prob, entropy, d_hidden, _ = forward_backward(poisoned, weight, labels, g, e, backend, budget)
    assert log_prob[1].isnan() and entropy[1].isnan()
    assert d_hidden[1].isnan().all(), f"d_hidden of the NaN row: {d_hidden[1]}"
    others = torch.arange(len(labels)) != 1
    assert torch.equal(log_prob[others], clean[0][others]) and torch.equal(entropy[others], clean[1][others])
    assert torch.equal(d_hidden[others], clean[2][others])


@pytest.mark.parametrize(("backend", "budget"), PATHS)
def test_nan_weight_poisons_every_valid_token(backend, budget):
    hidden, weight, labels, _, _ = plain_case()
    weight = weight.clone()
    weight[5, 0] = float("nan")
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend=backend)
    valid = labels != IGNORE_INDEX
    assert log_prob[valid].isnan().all() and entropy[valid].isnan().all()
    assert (log_prob[~valid] == 0).all() and (entropy[~valid] == 0).all()


@pytest.mark.parametrize(("backend", "budget"), PATHS)
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_expanded_zero_stride_inputs(backend, budget, which):
    hidden, weight, labels, g, e = plain_case()
    if which == "hidden":
        hidden = hidden[:1].expand_as(hidden)
    else:
        weight = weight[:, :1].expand_as(weight)
    result = forward_backward(hidden, weight, labels, g, e, backend, budget)
    check_reference(result, hidden, weight, labels, g, e)


@pytest.mark.parametrize(("backend", "budget"), PATHS)
def test_inference_mode_equals_no_grad(backend, budget):
    hidden, weight, labels, _, _ = plain_case()
    kwargs = {"backend": with_budget(backend, budget)}
    with torch.no_grad():
        expected = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, **kwargs)
    with torch.inference_mode():
        got = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, **kwargs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize(("backend", "budget"), PATHS)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_around_the_head(backend, budget, reentrant):
    hidden, weight, labels, g, e = plain_case()
    plain = forward_backward(hidden, weight, labels, g, e, backend, budget)

    def wrap(fn, *args):
        return checkpoint(fn, *args, use_reentrant=reentrant)

    checkpointed = forward_backward(hidden, weight, labels, g, e, backend, budget, wrap=wrap)
    for a, b in zip(checkpointed, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("backend", "budget"), PATHS)
def test_deterministic_algorithms(backend, budget):
    hidden, weight, labels, g, e = plain_case()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        result = forward_backward(hidden, weight, labels, g, e, backend, budget)
    finally:
        torch.use_deterministic_algorithms(previous)
    check_reference(result, hidden, weight, labels, g, e)


@pytest.mark.parametrize(("backend", "budget"), PATHS)
def test_second_backward_with_retain_graph(backend, budget):
    hidden, weight, labels, g, e = plain_case()
    x = hidden.clone().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(x, weight, labels, backend=with_budget(backend, budget))
    loss = (log_prob * g).sum() + (entropy * e).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=1e-6, atol=1e-7)
