"""The head's gradients against the float64 reference in the cases that broke before: strided
inputs, one output unused, gradcheck in fp64, what autograd saves, 3-D hidden and a backbone
behind it, one input frozen, accumulation over micro-batches, broadcast upstream gradients,
empty batches, inf padding. Cases and tolerances: ``head_checks.py``."""

from __future__ import annotations

import math

import pytest
import torch
from head_checks import (
    BF16_CAST_RTOL,
    DTYPES,
    LAYOUTS,
    OUT_RTOL,
    chunked_torch,
    compare,
    label_shape,
    make_case,
    run_head,
)

import mcore_ppo
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_non_contiguous_inputs(layout, dtype, monkeypatch):
    """Transposed and strided views of hidden, weight, labels and upstream gradients."""
    backend = chunked_torch(5, 7)
    gen = generator(next_seed())
    vocab, h = 45, 12
    weight = (torch.randn(h, vocab, generator=gen) / math.sqrt(h)).to(dtype).t()  # [V, h], transposed
    if layout == "2d":
        n = 19
        hidden = (torch.randn(2 * n, 2 * h, generator=gen) * 3).to(dtype)[::2, 1::2]  # strided
        labels = torch.randint(0, vocab, (3 * n,), generator=gen)[::3]
        g, e = torch.randn(2 * n, generator=gen)[::2], torch.randn(n, 2, generator=gen)[:, 1]
    else:
        s, b = 7, 3
        hidden = (torch.randn(b, s, h, generator=gen) * 3).to(dtype).transpose(0, 1)  # [s, b, h] view
        labels = torch.randint(0, vocab, (s, b), generator=gen).t()  # [b, s] view
        g, e = torch.randn(s, b, generator=gen).t(), torch.randn(s, b, generator=gen).t()
    labels[..., 1] = IGNORE_INDEX
    assert not (hidden.is_contiguous() or weight.is_contiguous() or labels.is_contiguous() or g.is_contiguous())
    case = {"hidden": hidden, "weight": weight, "labels": labels, "g": g, "e": e}
    out = run_head(case, 1.3, backend=backend)
    ref = reference(hidden, weight, labels, 1.3, g, e)
    compare(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("use", ["log_prob", "entropy"])
def test_only_one_output_used(use, dtype, monkeypatch):
    """The other output's gradient is None (never materialised): works and equals the reference."""
    backend = chunked_torch(5, 7)
    case = make_case("3d", dtype, 57, 16, 24, generator(next_seed()))
    out = run_head(case, 0.7, use=use, backend=backend)
    g = case["g"] if use == "log_prob" else None
    e = case["e"] if use == "entropy" else None
    ref = reference(case["hidden"], case["weight"], case["labels"], 0.7, g, e)
    compare(out, ref, dtype)


@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_gradcheck_float64(layout, monkeypatch):
    """torch.autograd.gradcheck in float64 on small shapes, with chunking and ignored tokens."""
    backend = chunked_torch(2, 3)
    gen = generator(next_seed())
    vocab, h = 8, 4
    lead, lshape = label_shape(layout, 6, batch=2)
    hidden = torch.randn(*lead, h, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, vocab, lshape, generator=gen)
    labels.view(-1)[:3] = torch.tensor([0, vocab - 1, IGNORE_INDEX])

    def head(x, w):
        return mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend=backend)

    assert torch.autograd.gradcheck(head, (hidden, weight), eps=1e-6, atol=1e-7, rtol=1e-5)


class _SavedCounter:
    """saved_tensors_hooks that record every tensor autograd saves (dtype and shape)."""

    def __init__(self):
        self.saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def hooks(self):
        def pack(t):
            self.saved.append((t.dtype, tuple(t.shape)))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_tensors(dtype):
    """Grad-enabled forward saves fp32 per-token values; a no-grad forward saves nothing."""
    case = make_case("3d", dtype, 33, 16, 24, generator(next_seed()))
    hidden = case["hidden"].requires_grad_(True)
    weight = case["weight"].requires_grad_(True)
    n_tokens = case["labels"].numel()

    with_grad = _SavedCounter()
    with with_grad.hooks():
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], backend="torch")
    assert with_grad.saved, "a grad-enabled forward must save what the backward recomputes from"
    per_token_floats = [d for d, shape in with_grad.saved if shape == (n_tokens,) and d.is_floating_point]
    assert len(per_token_floats) >= 2, f"expected saved per-token lse and entropy, saw {with_grad.saved}"
    assert all(d == torch.float32 for d in per_token_floats), f"saved per-token values must be fp32: {with_grad.saved}"
    # Nothing [tokens, V]-sized is kept.
    assert all(math.prod(shape) <= max(hidden.numel(), weight.numel()) for _, shape in with_grad.saved)

    no_grad = _SavedCounter()
    with no_grad.hooks(), torch.no_grad():
        lp_ng, ent_ng = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], backend="torch")
    assert no_grad.saved == [], f"no-grad forward saved {no_grad.saved}"
    assert torch.equal(lp_ng, log_prob.detach()) and torch.equal(ent_ng, entropy.detach())


# --- seed bug: gradients must reach hidden for 3-D input -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["3d", "packed"])
def test_gradient_reaches_3d_hidden(layout, dtype, monkeypatch):
    """Regression: hidden [s,b,h] / [t,1,h] as a leaf gets .grad, equal to the reference."""
    backend = chunked_torch(5, 7)
    case = make_case(layout, dtype, 39, 16, 24, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(True)
    weight = case["weight"].clone()  # frozen: only hidden asks for a gradient
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=1.3, backend=backend
    )
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    assert hidden.grad is not None, "gradient did not reach 3-D hidden"
    assert weight.grad is None
    ref = reference(case["hidden"], case["weight"], case["labels"], 1.3, case["g"], case["e"])
    cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    assert_close(
        hidden.grad,
        ref["d_hidden"],
        name="d_hidden",
        dtype=dtype,
        rtol=OUT_RTOL,
        elementwise_rtol=cast,
        terms=ref["d_hidden_terms"],
    )


def test_gradient_reaches_backbone(monkeypatch):
    """Regression: through a backbone layer producing 3-D hidden, the layer's parameter gets its gradient."""
    backend = chunked_torch(5, 7)
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, 39, 16, 24, gen)
    x = case["hidden"]
    proj = (torch.randn(16, 16, generator=gen) / 4).requires_grad_(True)
    weight = case["weight"].clone().requires_grad_(True)
    hidden = torch.tanh(x @ proj)  # a non-leaf [s, b, h]
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=0.7, backend=backend
    )
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    assert proj.grad is not None
    ref = reference(hidden.detach(), case["weight"], case["labels"], 0.7, case["g"], case["e"])
    x64, p64 = x.double(), proj.detach().double().requires_grad_(True)
    (torch.tanh(x64 @ p64) * ref["d_hidden"]).sum().backward()
    assert_close(proj.grad, p64.grad, name="d_backbone", dtype=torch.float32, rtol=OUT_RTOL)
    assert_close(weight.grad, ref["d_weight"], name="d_weight", dtype=torch.float32, rtol=OUT_RTOL)


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_gradient_to_one_input_only(which, monkeypatch):
    """Only one input requires grad: it gets the reference gradient, the other stays None."""
    backend = chunked_torch(5, 7)
    case = make_case("2d", torch.float32, 39, 16, 24, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(which == "hidden")
    weight = case["weight"].clone().requires_grad_(which == "weight")
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=1.0, backend=backend
    )
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    ref = reference(case["hidden"], case["weight"], case["labels"], 1.0, case["g"], case["e"])
    got, other = (hidden, weight) if which == "hidden" else (weight, hidden)
    assert other.grad is None
    name = "d_" + which
    assert_close(got.grad, ref[name], name=name, dtype=torch.float32, rtol=OUT_RTOL, terms=ref[name + "_terms"])


def test_repeated_backward_accumulates(monkeypatch):
    """Two micro-batches through the same weight: weight.grad is the sum (no state left behind)."""
    backend = chunked_torch(5, 7)
    gen = generator(next_seed())
    weight = (torch.randn(29, 16, generator=gen) / 4).requires_grad_(True)
    expected = torch.zeros(29, 16, dtype=torch.float64)
    terms = torch.zeros(29, 16, dtype=torch.float64)
    for _ in range(2):
        case = make_case("3d", torch.float32, 29, 16, 18, gen)
        lp, ent = mcore_ppo.fused_log_probs_and_entropy(case["hidden"], weight, case["labels"], backend=backend)
        check_invariants(lp, ent, case["labels"], 29)
        ((lp * case["g"]).sum() + (ent * case["e"]).sum()).backward()
        ref = reference(case["hidden"], weight, case["labels"], 1.0, case["g"], case["e"])
        expected += ref["d_weight"]
        terms += ref["d_weight_terms"]
    assert_close(weight.grad, expected, name="d_weight", dtype=torch.float32, rtol=OUT_RTOL, terms=terms)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mean_loss_broadcast_upstream(layout, monkeypatch):
    """A mean loss hands the head an expanded (stride-0) upstream gradient: same as a dense one."""
    backend = chunked_torch(5, 7)
    case = make_case(layout, torch.float32, 43, 16, 21, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(True)
    weight = case["weight"].clone().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=0.7, backend=backend
    )
    check_invariants(log_prob, entropy, case["labels"], 43)
    (log_prob.mean() - 0.01 * entropy.sum()).backward()
    n = case["labels"].numel()
    g = torch.full(case["labels"].shape, 1.0 / n)
    e = torch.full(case["labels"].shape, -0.01)
    ref = reference(case["hidden"], case["weight"], case["labels"], 0.7, g, e)
    out = {"log_prob": log_prob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}
    compare(out, ref, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_tokens(layout):
    """An empty micro-batch (no tokens on this rank) returns empty outputs and zero gradients."""
    lead, lshape = {"2d": ((0,), (0,)), "3d": ((0, 2), (2, 0)), "packed": ((0, 1), (1, 0))}[layout]
    hidden = torch.randn(*lead, 8, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator(next_seed()), requires_grad=True)
    labels = torch.zeros(lshape, dtype=torch.long)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
    check_invariants(log_prob, entropy, labels, 11)
    (log_prob.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape
    assert weight.grad is not None and (weight.grad == 0).all()


def test_ignored_rows_with_inf_hidden_give_finite_gradients():
    """Padding rows (ignored labels) may hold inf: outputs there are 0, every gradient finite,
    and the valid rows' results equal those of a batch without the padding rows."""
    gen = generator(next_seed())
    hidden = torch.randn(9, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (9,), generator=gen)
    padded = (1, 5)
    hidden[list(padded)] = float("inf")
    labels[list(padded)] = -100
    keep = [i for i in range(9) if i not in padded]
    outs = []
    for h, y in ((hidden, labels), (hidden[keep], labels[keep])):
        x = h.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(x, w, y, temperature=0.7, backend="torch")
        (log_prob.sum() - 0.3 * entropy.sum()).backward()
        outs.append((log_prob, entropy, x.grad, w.grad))
    (lp, ent, gx, gw), (lp_ref, ent_ref, gx_ref, gw_ref) = outs
    assert torch.isfinite(gw).all() and torch.isfinite(gx).all()
    assert (lp[list(padded)] == 0).all() and (ent[list(padded)] == 0).all() and (gx[list(padded)] == 0).all()
    torch.testing.assert_close(lp[keep], lp_ref)
    torch.testing.assert_close(ent[keep], ent_ref)
    torch.testing.assert_close(gx[keep], gx_ref)
    torch.testing.assert_close(gw, gw_ref)


def test_backend_that_adds_into_a_weight_dtype_buffer_gets_zeros(monkeypatch):
    """A backend written for the protocol's ``weight_grad_in_weight_dtype`` alone adds into the
    ``d_W`` buffer it is handed: it gets zeros, not an unfilled buffer (that one is only for a
    backend that also declares ``writes_weight_grad``). Unfilled buffers start as NaN here."""
    from mcore_ppo.backends import TorchBackend
    from mcore_ppo_testing.unset_buffers import nan_filled_unset_buffers

    class AddsInWeightDtype(TorchBackend):
        weight_grad_in_weight_dtype = True

    made = nan_filled_unset_buffers(monkeypatch)
    gen = generator(next_seed())
    hidden = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 30, (9,), generator=gen)
    w = weight.clone().requires_grad_(True)
    log_p, ent = mcore_ppo.fused_log_probs_and_entropy(hidden, w, labels, backend=AddsInWeightDtype())
    g, e = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    torch.autograd.backward([log_p, ent], [g.double(), e.double()])
    ref = reference(hidden, weight, labels, 1.0, g, e)
    assert made == [False]
    assert_close(w.grad, ref["d_weight"], name="d_weight", dtype=torch.float64, rtol=1e-10, terms=ref["d_weight_terms"])
