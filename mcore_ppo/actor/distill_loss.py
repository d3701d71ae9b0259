"""Distillation losses as pure tensor functions (no model, no process groups).

Per token, from a teacher ``p`` and a student ``q`` over the same vocabulary:

- :func:`topk_forward_kl` — ``KL(p ‖ q)`` restricted to the teacher's top-k ids ``S``
  (:func:`mcore_ppo.fused_topk` gives ``S``, ``log p_S`` and the tail ``log(1 - Σ_S p)``):

  ``"tail_bucket"``: the two distributions coarsened to ``S`` plus one bucket for the rest,
  ``Σ_{i∈S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)``. It is a true KL
  (≥ 0), a lower bound of the full ``KL(p ‖ q)``, and equal to it when ``S`` is the whole vocab.

  ``"renormalized"``: both restricted to ``S`` and renormalised there,
  ``Σ_{i∈S} p̂_i (log p̂_i - log q̂_i)`` with ``p̂ = p / Σ_S p`` and ``q̂ = q / Σ_S q``. It ignores
  the mass outside ``S`` (≥ 0; the full KL when ``S`` is the whole vocab).

- :func:`sampled_reverse_kl` — a per-token estimate of ``KL(q ‖ p)`` from tokens sampled from
  the student, verl's ``kl_penalty`` estimators ``"k1"`` (``log q - log p``) and ``"k3"``
  (``p/q - 1 - log(p/q)``); both have expectation ``KL(q ‖ p)`` over ``q``.

Every function returns per-token values and takes an optional per-token ``mask``: masked-out
tokens are exactly 0 (values there may be anything, NaN or inf, and get no gradient). Aggregate
them like the PPO loss: :func:`mcore_ppo.actor.ppo_loss.agg_loss` for a padded ``[b, s]`` batch
in one place, or ``aggregate(values, loss_weights(...))`` with global counts across
micro-batches and ranks (:mod:`mcore_ppo.actor.ppo_loss`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from mcore_ppo.actor.config import TOPK_KL_MODES
from mcore_ppo.actor.ppo_loss import kl_k3
from mcore_ppo.validation import check_tensor

TopKKLMode = Literal["tail_bucket", "renormalized"]
#: verl's ``kl_penalty`` names of the two estimators (``"kl"`` is ``"k1"``, ``"low_var_kl"`` is ``"k3"``).
REVERSE_KL_ESTIMATORS: dict[str, str] = {"k1": "k1", "kl": "k1", "k3": "k3", "low_var_kl": "k3"}

_LOG_HALF = -math.log(2.0)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, accurate at both ends (``-inf`` at ``a = 0``).

    ``log(-expm1(a))`` near 0, ``log1p(-exp(a))`` below ``-log 2`` (Mächler's rule). Each branch
    sees only inputs it is finite on, so the unused one cannot turn a zero gradient into NaN.
    """
    near_zero = a > _LOG_HALF
    a_near = torch.where(near_zero, a, torch.full_like(a, _LOG_HALF))
    a_far = torch.where(near_zero, torch.full_like(a, 2 * _LOG_HALF), a)
    return torch.where(near_zero, torch.log(-torch.expm1(a_near)), torch.log1p(-torch.exp(a_far)))


def topk_tail_log_mass(log_probs: torch.Tensor) -> torch.Tensor:
    """``log(1 - Σ_i exp(log_probs[..., i]))``: the log-mass outside a set of ids, from the
    full-vocab log-probs of the ids in it, at least ``log(eps)`` of their dtype.

    ``1 - Σ q`` is a difference of two numbers near 1: below the dtype's ``eps`` (fp32: 1.2e-7)
    it is rounding noise, and where the rounded sum reaches 1 the exact ``log`` would be ``-inf``
    though no softmax puts zero mass anywhere. So the tail is floored at ``eps`` (its gradient
    is zero there). A tail computed as its own sum (``fused_topk``'s) has no such floor.
    """
    check_tensor("log_probs", log_probs, "float")
    return log1mexp(_in_set_log_mass(log_probs))


def _in_set_log_mass(log_probs: torch.Tensor) -> torch.Tensor:
    """``log Σ_i exp(log_probs[..., i])``, at most ``log(1 - eps)``: see :func:`topk_tail_log_mass`."""
    ceiling = math.log1p(-torch.finfo(log_probs.dtype).eps)
    return torch.logsumexp(log_probs, dim=-1).clamp(max=ceiling)


def _xlogy_log(log_x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """``x · (log x - log y)`` from logs, 0 where ``x = 0`` (``log x = -inf``), whatever ``y``."""
    present = log_x > -torch.inf
    safe_x = torch.where(present, log_x, torch.zeros_like(log_x))
    safe_y = torch.where(present, log_y, torch.zeros_like(log_y))
    return torch.where(present, torch.exp(safe_x) * (safe_x - safe_y), torch.zeros_like(log_x))


def _masked(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``values`` with masked-out tokens exactly 0 (``mask`` already checked by the caller)."""
    if mask is None:
        return values
    return torch.where(mask != 0, values, torch.zeros_like(values))


def _masked_input(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Masked-out tokens' inputs replaced by 0 before any math, so their gradient is exactly 0
    and no NaN from them can reach the gradient of other tokens."""
    if mask is None:
        return tensor
    keep = (mask != 0).reshape(mask.shape + (1,) * (tensor.dim() - mask.dim()))
    return torch.where(keep, tensor, torch.zeros_like(tensor))


def topk_forward_kl(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    teacher_tail_log_mass: torch.Tensor | None = None,
    student_tail_log_mass: torch.Tensor | None = None,
    *,
    mode: str = "tail_bucket",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token forward ``KL(teacher ‖ student)`` over the teacher's top-k ids (module doc).

    Args:
        student_log_probs: ``[..., k]`` the student's full-vocab ``log q`` at the teacher's
            ids (differentiable), e.g. ``log_softmax(student_logits).gather(-1, ids)``.
        teacher_log_probs: ``[..., k]`` the teacher's ``log p`` at those ids (``fused_topk``).
        teacher_tail_log_mass: ``[...]`` ``log(1 - Σ_S p)``; required for ``"tail_bucket"``,
            unused by ``"renormalized"``.
        student_tail_log_mass: ``[...]`` ``log(1 - Σ_S q)``; None: computed from
            ``student_log_probs`` (:func:`topk_tail_log_mass`: floored at the dtype's ``eps``,
            the resolution of ``1 - Σ_S q``).
        mode: ``"tail_bucket"`` or ``"renormalized"``.
        mask: optional per-token ``[...]`` (bool or 0/1): tokens where it is 0 get exactly 0.

    Returns:
        Per-token ``[...]`` KL in the promoted dtype of the inputs; +inf where the student
        puts no mass on an id the teacher does (``log q = -inf``), or a given student tail is
        ``-inf`` where the teacher's is not.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {TOPK_KL_MODES}, got {type(mode).__name__}")
    if mode not in TOPK_KL_MODES:
        raise ValueError(f"mode must be one of {TOPK_KL_MODES}, got {mode!r}")
    check_tensor("student_log_probs", student_log_probs, "float")
    check_tensor("teacher_log_probs", teacher_log_probs, "float")
    if student_log_probs.dim() < 1 or student_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            "student_log_probs and teacher_log_probs must both be [..., k] of one shape, got "
            f"{tuple(student_log_probs.shape)} and {tuple(teacher_log_probs.shape)}"
        )
    token_shape = student_log_probs.shape[:-1]
    tails = {"teacher_tail_log_mass": teacher_tail_log_mass, "student_tail_log_mass": student_tail_log_mass}
    for name, tail in tails.items():
        if tail is not None:
            check_tensor(name, tail, "float")
            if tail.shape != token_shape:
                raise ValueError(f"{name} must be shaped {tuple(token_shape)} (one per token), got {tuple(tail.shape)}")
    if mode == "tail_bucket" and teacher_tail_log_mass is None:
        raise ValueError('mode="tail_bucket" needs teacher_tail_log_mass (fused_topk returns it)')
    if mask is not None:
        check_tensor("mask", mask, "mask")
        if mask.shape != token_shape:
            raise ValueError(f"mask must be shaped {tuple(token_shape)} (one per token), got {tuple(mask.shape)}")

    log_q, log_p = _masked_input(student_log_probs, mask), _masked_input(teacher_log_probs, mask)
    if mode == "renormalized":
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
        return _masked(_xlogy_log(log_p, log_q).sum(dim=-1), mask)
    kl = _xlogy_log(log_p, log_q).sum(dim=-1)
    tail_p = _masked_input(teacher_tail_log_mass, mask)
    if student_tail_log_mass is None:
        # Only where the teacher's tail has mass: elsewhere the student's may be log(0), whose
        # infinite derivative would turn the zero gradient of an unused term into NaN.
        in_top = _in_set_log_mass(log_q)
        tail_q = log1mexp(torch.where(tail_p > -torch.inf, in_top, torch.full_like(in_top, -1.0)))
    else:
        tail_q = _masked_input(student_tail_log_mass, mask)
    return _masked(kl + _xlogy_log(tail_p, tail_q), mask)


def sampled_reverse_kl(
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    *,
    estimator: str = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of the reverse ``KL(student ‖ teacher)`` on tokens the student sampled.

    ``r = log p_teacher - log q_student``; ``"k1"`` (verl's ``"kl"``): ``-r``; ``"k3"`` (verl's
    ``"low_var_kl"``): ``exp(r) - 1 - r`` (≥ 0). Both average to ``KL(q ‖ p)`` over samples of
    the student ``q``. Unlike verl's ``kl_penalty``, nothing is clamped.

    Args:
        student_log_prob: ``log q`` of the sampled tokens (differentiable), any shape.
        teacher_log_prob: ``log p`` of the same tokens, the same shape.
        estimator: ``"k1"``, ``"k3"`` (or verl's aliases ``"kl"``, ``"low_var_kl"``).
        mask: optional per-token, the same shape: tokens where it is 0 get exactly 0.
    """
    if not isinstance(estimator, str):
        names = tuple(REVERSE_KL_ESTIMATORS)
        raise TypeError(f"estimator must be a str, one of {names}, got {type(estimator).__name__}")
    if estimator not in REVERSE_KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {tuple(REVERSE_KL_ESTIMATORS)}, got {estimator!r}")
    check_tensor("student_log_prob", student_log_prob, "float")
    check_tensor("teacher_log_prob", teacher_log_prob, "float")
    if student_log_prob.shape != teacher_log_prob.shape:
        raise ValueError(
            "student_log_prob and teacher_log_prob must have the same shape, got "
            f"{tuple(student_log_prob.shape)} and {tuple(teacher_log_prob.shape)}"
        )
    if mask is not None and check_tensor("mask", mask, "mask").shape != student_log_prob.shape:
        raise ValueError(
            f"mask must be shaped like the log-probs {tuple(student_log_prob.shape)}, got {tuple(mask.shape)}"
        )
    log_q, log_p = _masked_input(student_log_prob, mask), _masked_input(teacher_log_prob, mask)
    if REVERSE_KL_ESTIMATORS[estimator] == "k1":
        values = log_q - log_p
    else:
        values = kl_k3(log_q, log_p)
    return _masked(values, mask)
