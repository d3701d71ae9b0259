"""Distillation losses (``mcore_ppo.actor.distill_loss``) against fp64 full-vocab references.

Teacher and student logits ``[b, s, V]`` are drawn; the reference sums over the full
``log_softmax`` in fp64 (the tail bucket as the sum of the tail's own probabilities, never
``1 - Σ``), and the functions get what a run would give them: the teacher's top-k from
:func:`mcore_ppo.fused_topk`-like selection and the student's log-probs gathered at those ids.
Values in fp64 and fp32, gradients with respect to the student's logits, masks (NaN in
masked-out tokens), the aggregation modes of the PPO loss, and bad inputs.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from mcore_ppo.actor.distill_loss import (
    log1mexp,
    sampled_reverse_kl,
    topk_forward_kl,
    topk_tail_log_mass,
)
from mcore_ppo.actor.ppo_loss import LOSS_AGG_MODES, agg_loss
from mcore_ppo_testing.seeds import generator, next_seed

B, S, V = 3, 5, 257


def draw_logits(scale: float = 2.0):
    gen = generator(next_seed())
    teacher = scale * torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    student = scale * torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    return teacher, student


def teacher_topk(teacher_logits: torch.Tensor, k: int):
    """Top-k ids, their log-probs and the tail log-mass (as its own sum), fp64."""
    log_p = teacher_logits.log_softmax(-1)
    values, ids = log_p.sort(stable=True, dim=-1, descending=True)
    return ids[..., :k], values[..., :k], torch.logsumexp(values[..., k:], dim=-1)


def reference_topk_kl(teacher_logits, student_logits, k: int, mode: str) -> torch.Tensor:
    """fp64 per-token reference from the full distributions."""
    log_p, log_q = teacher_logits.log_softmax(-1), student_logits.log_softmax(-1)
    ids = log_p.sort(stable=True, dim=-1, descending=True).indices
    top, rest = ids[..., :k], ids[..., k:]
    p_s, q_s = log_p.gather(-1, top), log_q.gather(-1, top)
    if mode == "renormalized":
        p_hat = p_s - torch.logsumexp(p_s, -1, keepdim=True)
        q_hat = q_s - torch.logsumexp(q_s, -1, keepdim=True)
        return (p_hat.exp() * (p_hat - q_hat)).sum(-1)
    if rest.shape[-1] == 0:  # the top-k hold everything: no tail bucket
        return (p_s.exp() * (p_s - q_s)).sum(-1)
    p_tail = torch.logsumexp(log_p.gather(-1, rest), -1)
    q_tail = torch.logsumexp(log_q.gather(-1, rest), -1)
    tail = torch.where(torch.isneginf(p_tail), torch.zeros_like(p_tail), p_tail.exp() * (p_tail - q_tail))
    return (p_s.exp() * (p_s - q_s)).sum(-1) + tail


def full_forward_kl(teacher_logits, student_logits) -> torch.Tensor:
    log_p, log_q = teacher_logits.log_softmax(-1), student_logits.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize("k", [1, 8, 64, 128, V])
@pytest.mark.parametrize("mode", ["tail_bucket", "renormalized"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_topk_forward_kl_matches_full_vocab_reference(dtype, mode, k):
    """Values against the fp64 reference; gradient w.r.t. the student's logits too (fp64)."""
    teacher, student = draw_logits()
    ids, t_log_p, t_tail = teacher_topk(teacher, k)
    student = student.clone().requires_grad_(True)
    s_log_q = student.log_softmax(-1).gather(-1, ids)
    kl = topk_forward_kl(s_log_q.to(dtype), t_log_p.to(dtype), t_tail.to(dtype), mode=mode)
    assert kl.dtype == dtype and kl.shape == (B, S)
    student_ref = student.detach().clone().requires_grad_(True)
    ref = reference_topk_kl(teacher, student_ref, k, mode)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(kl.double(), ref.detach(), rtol=tol, atol=tol)
    assert (kl >= -tol).all()
    if k == V:  # both forms are the full forward KL when the top-k is the whole vocab
        torch.testing.assert_close(kl.double(), full_forward_kl(teacher, student).detach(), rtol=tol, atol=tol)
    if dtype == torch.float64:
        upstream = torch.randn(B, S, generator=generator(next_seed()), dtype=torch.float64)
        (grad,) = torch.autograd.grad((kl * upstream).sum(), student)
        (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), student_ref)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_tail_bucket_bounds_full_kl():
    """Coarsening cannot increase a KL: tail_bucket <= full KL, and grows with k."""
    teacher, student = draw_logits()
    full = full_forward_kl(teacher, student)
    previous = torch.zeros_like(full)
    for k in (1, 8, 64, 128, V):
        ids, t_log_p, t_tail = teacher_topk(teacher, k)
        kl = topk_forward_kl(student.log_softmax(-1).gather(-1, ids), t_log_p, t_tail)
        assert (kl <= full + 1e-12).all() and (kl >= previous - 1e-12).all()
        previous = kl


def test_given_student_tail_is_used():
    """A student tail passed in (e.g. from a fused head) replaces the one from log1mexp."""
    teacher, student = draw_logits()
    ids, t_log_p, t_tail = teacher_topk(teacher, 8)
    log_q = student.log_softmax(-1)
    s_log_q = log_q.gather(-1, ids)
    mask_top = torch.zeros_like(log_q, dtype=torch.bool).scatter_(-1, ids, True)
    s_tail = torch.logsumexp(log_q.masked_fill(mask_top, -torch.inf), -1)
    torch.testing.assert_close(topk_tail_log_mass(s_log_q), s_tail, rtol=1e-12, atol=1e-12)
    given = topk_forward_kl(s_log_q, t_log_p, t_tail, s_tail)
    torch.testing.assert_close(given, reference_topk_kl(teacher, student, 8, "tail_bucket"))
    shifted = topk_forward_kl(s_log_q, t_log_p, t_tail, s_tail - 1.0)
    assert (shifted > given).all()


def test_log1mexp_accurate_with_finite_gradients():
    a = -torch.logspace(-12, 2.5, 200, dtype=torch.float64)
    # Each value in 50-digit arithmetic: fp64 formulas lose the tail at one end or the other.
    with mpmath.workdps(50):
        exact = torch.tensor([float(mpmath.log1p(-mpmath.exp(x))) for x in a.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(a), exact, rtol=1e-14, atol=0)
    assert log1mexp(torch.zeros((), dtype=torch.float64)) == -torch.inf
    # Both sides of the branch point -log 2, and the ends: the unused branch never leaks a NaN.
    a = torch.tensor([-1e-30, -0.6931, -0.6932, -50.0, -800.0], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(log1mexp(a).sum(), a)
    expected = -torch.exp(a.detach()) / -torch.expm1(a.detach())  # d/da log(1 - e^a)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("estimator", ["k1", "k3", "kl", "low_var_kl"])
def test_sampled_reverse_kl_estimates_the_full_reverse_kl(estimator):
    """Per token: the verl formula; and its expectation over the student's full distribution is
    exactly KL(student ‖ teacher) (fp64)."""
    teacher, student = draw_logits()
    log_p, log_q = teacher.log_softmax(-1), student.log_softmax(-1)
    values = sampled_reverse_kl(log_q, log_p, estimator=estimator)
    r = log_p - log_q
    expected = -r if estimator in ("k1", "kl") else torch.exp(r) - 1 - r
    torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12)
    reverse_kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    torch.testing.assert_close((log_q.exp() * values).sum(-1), reverse_kl, rtol=1e-10, atol=1e-12)
    if estimator in ("k3", "low_var_kl"):
        assert (values >= 0).all()


def test_sampled_reverse_kl_gradient():
    """Gradient of k1/k3 w.r.t. the student's log-prob: -(... ) in closed form, fp64."""
    gen = generator(next_seed())
    log_q = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 5
    log_p = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 5
    log_q.requires_grad_(True)
    (g1,) = torch.autograd.grad(sampled_reverse_kl(log_q, log_p, estimator="k1").sum(), log_q)
    (g3,) = torch.autograd.grad(sampled_reverse_kl(log_q, log_p, estimator="k3").sum(), log_q)
    torch.testing.assert_close(g1, torch.ones_like(g1))
    torch.testing.assert_close(g3, 1 - torch.exp(log_p - log_q.detach()))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masks_and_aggregation(mode):
    """Masked-out tokens are exactly 0 with no gradient, even holding NaN/inf; the PPO loss's
    agg_loss then gives verl's aggregation of the masked-in tokens (fp64 reference by hand)."""
    teacher, student = draw_logits()
    k = 8
    ids, t_log_p, t_tail = teacher_topk(teacher, k)
    mask = torch.rand(B, S, generator=generator(next_seed())) > 0.4
    mask[0, 0], mask[1, 0] = False, True
    student = student.clone().requires_grad_(True)
    s_log_q = student.log_softmax(-1).gather(-1, ids)
    poisoned = torch.where(~mask[..., None], torch.nan, t_log_p)
    tail = torch.where(~mask, torch.inf, t_tail)
    kl = topk_forward_kl(s_log_q, poisoned, tail, mode="tail_bucket", mask=mask)
    assert (kl[~mask] == 0).all() and torch.isfinite(kl).all()
    ref = reference_topk_kl(teacher, student.detach(), k, "tail_bucket")
    torch.testing.assert_close(kl[mask], ref[mask])
    loss = agg_loss(kl, mask.double(), mode)
    counts = mask.sum(-1).double()
    per_seq = (ref * mask).sum(-1)
    expected = {
        "token-mean": per_seq.sum() / counts.sum(),
        "seq-mean-token-sum": per_seq[counts > 0].sum() / (counts > 0).sum(),
        "seq-mean-token-mean": (per_seq[counts > 0] / counts[counts > 0]).sum() / (counts > 0).sum(),
    }[mode]
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    # The reverse estimator under the same mask.
    rev = sampled_reverse_kl(s_log_q[..., 0], torch.where(mask, t_log_p[..., 0], torch.nan), mask=mask.float())
    assert (rev[~mask] == 0).all() and torch.isfinite(rev).all()


def test_teacher_with_zero_probabilities():
    """Teacher log-probs of -inf (a zero probability) and a -inf tail (the top-k hold everything)
    contribute 0, not NaN; a student with zero mass where the teacher has some gives +inf (an id
    at log q = -inf, or a given -inf tail); a tail computed from log-probs that sum to 1 is
    floored at the dtype's eps, so it stays finite."""
    log_p = torch.log(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))
    log_q = torch.log(torch.tensor([[0.25, 0.25, 0.25]], dtype=torch.float64))
    tail = torch.tensor([-torch.inf], dtype=torch.float64)
    kl = topk_forward_kl(log_q, log_p, tail)
    torch.testing.assert_close(kl, torch.tensor([2 * 0.5 * torch.log(torch.tensor(2.0)).item()], dtype=torch.float64))
    all_mass = torch.log(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))
    quarter = torch.log(torch.tensor([0.25], dtype=torch.float64))
    inf_kl = topk_forward_kl(all_mass, log_q, quarter)  # the teacher's third id: q = 0 there
    assert inf_kl.item() == torch.inf
    given = topk_forward_kl(log_q, log_q, quarter, torch.tensor([-torch.inf], dtype=torch.float64))
    assert given.item() == torch.inf
    floored = topk_forward_kl(torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)), log_q[:, :2], quarter)
    eps = torch.finfo(torch.float64).eps
    expected = 2 * 0.25 * math.log(0.25 / 0.5) + 0.25 * (math.log(0.25) - math.log(eps))
    torch.testing.assert_close(floored, torch.tensor([expected], dtype=torch.float64), rtol=1e-6, atol=0)


def test_confident_student_in_fp32_stays_finite():
    """A student whose fp32 log-probs at the teacher's ids sum to 1 after rounding (its true tail
    1e-12): the loss and its gradient are finite, the tail floored at fp32's eps; against fp64
    the error is the teacher's tail mass times the log of the floor over the true tail."""
    gen = generator(next_seed())
    student = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    student[:, :8] += 40.0  # the teacher's ids (0..7) hold all but ~1e-12 of the mass
    ids = torch.arange(8).expand(4, 8)
    t_log_p = torch.full((4, 8), math.log(0.99 / 8), dtype=torch.float64)
    t_tail = torch.full((4,), math.log(0.01), dtype=torch.float64)
    logits = student.float().requires_grad_(True)
    kl = topk_forward_kl(logits.log_softmax(-1).gather(-1, ids), t_log_p.float(), t_tail.float())
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logits.grad).all()
    log_q = student.log_softmax(-1)
    true_tail = torch.logsumexp(log_q[:, 8:], -1)
    assert (true_tail < -25).all()  # ~1e-12: below fp32's resolution of 1 - Σ q
    exact = (t_log_p.exp() * (t_log_p - log_q[:, :8])).sum(-1) + t_tail.exp() * (t_tail - true_tail)
    eps = torch.finfo(torch.float32).eps
    bound = 0.01 * (math.log(eps) - true_tail).abs() + 1e-5
    assert ((kl.double() - exact).abs() <= bound).all()


def test_bad_inputs():
    lp = torch.randn(2, 3, 4).log_softmax(-1)
    tail = torch.full((2, 3), -1.0)
    cases = [
        (ValueError, "mode must be one of", lambda: topk_forward_kl(lp, lp, tail, mode="reverse")),
        (TypeError, "mode must be a str", lambda: topk_forward_kl(lp, lp, tail, mode=1)),
        (ValueError, "needs teacher_tail_log_mass", lambda: topk_forward_kl(lp, lp)),
        (TypeError, "student_log_probs must be a floating-point", lambda: topk_forward_kl(lp.long(), lp, tail)),
        (TypeError, "teacher_log_probs must be a torch.Tensor", lambda: topk_forward_kl(lp, [1.0], tail)),
        (ValueError, "must both be", lambda: topk_forward_kl(lp, lp[..., :3], tail)),
        (ValueError, "teacher_tail_log_mass must be shaped", lambda: topk_forward_kl(lp, lp, tail[:1])),
        (ValueError, "student_tail_log_mass must be shaped", lambda: topk_forward_kl(lp, lp, tail, tail.t())),
        (TypeError, "student_tail_log_mass must be a floating", lambda: topk_forward_kl(lp, lp, tail, tail.int())),
        (ValueError, "mask must be shaped", lambda: topk_forward_kl(lp, lp, tail, mask=torch.ones(2, 3, 4))),
        (TypeError, "mask must be a bool", lambda: topk_forward_kl(lp, lp, tail, mask=torch.ones(2, 3).cfloat())),
        (ValueError, "estimator must be one of", lambda: sampled_reverse_kl(tail, tail, estimator="k2")),
        (TypeError, "estimator must be a str", lambda: sampled_reverse_kl(tail, tail, estimator=None)),
        (ValueError, "same shape", lambda: sampled_reverse_kl(tail, tail[:1])),
        (TypeError, "teacher_log_prob must be a floating", lambda: sampled_reverse_kl(tail, tail.long())),
        (ValueError, "mask must be shaped", lambda: sampled_reverse_kl(tail, tail, mask=tail[0])),
        (TypeError, "mask must be a torch.Tensor", lambda: sampled_reverse_kl(tail, tail, mask=[1, 0])),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
