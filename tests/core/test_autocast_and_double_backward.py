"""The head inside ``torch.autocast`` and under ``create_graph=True``.

Autocast: with fp32 inputs the head must give inside an autocast region exactly what it gives
outside (autocast would run the torch backend's logit GEMMs in bf16: log-probs off by ~0.1,
gradients by ~10 %). Checked bit for bit against the same call outside autocast, for the
forward and the backward inside the region (on CPU the backward runs on the calling thread and
sees its autocast state) and for a forward inside with the backward outside, on every backend
that runs here (``triton`` in the interpreter), and Liger's entry point through its PyTorch
fallback.

Double backward: the head's backward is not differentiable, so ``create_graph=True`` through it
raises ``NotImplementedError`` naming the head instead of returning wrong second derivatives
(a first-order backward differentiated again would give Hessian-vector products off by 8×).
"""

from __future__ import annotations

import pytest
import torch
from head_checks import TRITON_ON_CPU, entry_point, plain_case

import mcore_ppo
from mcore_ppo.liger import is_available as liger_available
from mcore_ppo.shard import NO_DOUBLE_BACKWARD

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=TRITON_ON_CPU,
    ),
    pytest.param("liger", marks=pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")),
]
DOUBLE_BACKWARD = r"fused PPO head is differentiable once: backward\(create_graph=True\)"


def make_inputs(dtype=torch.float32, n=10, h=24, v=37):
    return plain_case(n, h, v, dtype=dtype, ignore_every=3)


def forward_backward(hidden, weight, labels, g, e, *, backend, autocast_forward, autocast_backward, dtype):
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast_forward):
        logp, ent = entry_point(backend)(x, w, labels, temperature=0.7)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast_backward):
        ((logp * g).sum() + (ent * e).sum()).backward()
    return logp, ent, x.grad, w.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("region", ["forward+backward", "forward"])
def test_same_result_inside_autocast(backend, dtype, region):
    inputs = make_inputs()
    outside = forward_backward(*inputs, backend=backend, autocast_forward=False, autocast_backward=False, dtype=dtype)
    inside = forward_backward(
        *inputs, backend=backend, autocast_forward=True, autocast_backward=region == "forward+backward", dtype=dtype
    )
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), inside, outside, strict=True):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} inside autocast, {b.dtype} outside"
        assert torch.equal(a, b), f"{name} differs inside autocast by {(a - b).abs().max().item():.3g}"


def test_autocast_state_restored_after_the_head():
    """The head turns autocast off for its own work only: the caller's region is unchanged after it."""
    hidden, weight, labels, _, _ = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
        assert torch.is_autocast_enabled("cpu")
        assert (hidden @ weight.t()).dtype == torch.bfloat16


def test_mixed_dtypes_inside_autocast_are_still_refused():
    """Outside autocast bf16 hidden with an fp32 weight is a TypeError; inside it is the same
    error (the head does not cast for autocast), with a hint that autocast does not apply."""
    hidden, weight, labels, _, _ = make_inputs()
    with pytest.raises(TypeError, match=r"weight dtype torch.float32 must match hidden dtype torch.bfloat16$"):
        mcore_ppo.fused_log_probs_and_entropy(hidden.bfloat16(), weight, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"must match hidden dtype torch.bfloat16 \(the head does not follow"):
            mcore_ppo.fused_log_probs_and_entropy(hidden.bfloat16(), weight, labels)


# --- double backward ------------------------------------------------------------------------------


def test_gradgradcheck_raises_instead_of_passing_wrong_values():
    hidden, weight, labels, _, _ = make_inputs(torch.float64, n=4, h=3, v=5)
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)

    def head(x, w):
        return mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.9, backend="torch")

    assert torch.autograd.gradcheck(head, (x, w))  # first order stays exact
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.gradgradcheck(head, (x, w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output", ["log_prob", "entropy"])
def test_create_graph_is_refused(backend, output):
    hidden, weight, labels, g, e = make_inputs()
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    logp, ent = entry_point(backend)(x, w, labels)
    loss = (logp * g).sum() if output == "log_prob" else (ent * e).sum()
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD) as info:
        torch.autograd.grad(loss, (x, w), create_graph=True)
    assert str(info.value) == NO_DOUBLE_BACKWARD
    # The graph is intact: a plain first-order backward still works afterwards.
    torch.autograd.grad(loss, (x, w))


def test_hessian_vector_product_is_refused():
    hidden, weight, labels, _, _ = make_inputs(torch.float64)

    def objective(x):
        return mcore_ppo.fused_log_probs_and_entropy(x, weight, labels, backend="torch")[0].sum()

    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.functional.hvp(objective, hidden, torch.ones_like(hidden))


def test_create_graph_elsewhere_in_the_graph_is_fine():
    """create_graph over a part of the graph the head is not on never reaches its backward."""
    hidden, weight, labels, _, _ = make_inputs()
    scale = torch.tensor(1.5, requires_grad=True)
    logp, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
    penalty = (scale**3) * logp.detach().sum()
    (grad,) = torch.autograd.grad(penalty, scale, create_graph=True)
    (second,) = torch.autograd.grad(grad, scale)
    assert torch.allclose(second, 6 * scale.detach() * logp.sum())
