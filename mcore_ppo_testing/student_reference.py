"""fp64 full-logits reference of the student's log-probs at ``k`` ids per token
(:func:`mcore_ppo.fused_log_probs_at`), with gradients, for the single- and multi-rank tests.

``log_softmax(hidden @ W.T / T)`` over the whole vocab in fp64, gathered at the ids (0 in an
ignored slot), the entropy ``-Σ p log p`` per token (0 when every slot is ignored), and the
gradients of ``Σ g·log_q + Σ e·H`` by autograd through that graph. Layouts as for the head:
hidden ``[s, b, h]`` with ids ``[b, s, k]``, ``[n, h]`` with ``[n, k]``.
"""

from __future__ import annotations

import torch

from mcore_ppo_testing.reference import IGNORE_INDEX


def student_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    grad_log_q: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """fp64 ``log_q`` ``[..., k]`` and ``entropy`` ``[...]``; given an upstream gradient also
    ``d_hidden``, ``d_weight`` and their term magnitudes ``d_hidden_terms`` / ``d_weight_terms``
    (per element the sum of the absolute values of the terms the gradient sums, with
    ``S_i = Σ_j |g_j| 1[i = id_j] + p_i (Σ_j |g_j| + |e| (|log p_i + H| + 1))``: rounding is
    bounded relative to them, not to a result that may cancel). ``temperature``: a float or a
    tensor broadcastable to ``ids[..., 0]``."""
    x = hidden.detach().double()
    if x.dim() == 3:
        x = x.transpose(0, 1)  # [b, s, h], token for token with ids [b, s, k]
    x = x.clone().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    ids = ids.long()
    slot_ok = ids != ignore_index
    valid = slot_ok.any(-1)
    scale = temperature
    if isinstance(temperature, torch.Tensor):
        scale = temperature.detach().double().expand(ids.shape[:-1])[..., None]
    with torch.enable_grad():
        log_p = torch.log_softmax(x @ w.t() / scale, dim=-1)
        picked = log_p.gather(-1, torch.where(slot_ok, ids, 0))
        log_q = torch.where(slot_ok, picked, 0.0)
        entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
        out = {"log_q": log_q.detach(), "entropy": entropy.detach()}
        if grad_log_q is None and grad_entropy is None:
            return out
        objective = torch.zeros((), dtype=torch.float64)
        if grad_log_q is not None:
            objective = objective + (log_q * grad_log_q.double()).sum()
        if grad_entropy is not None:
            objective = objective + (entropy * grad_entropy.double()).sum()
        d_x, d_w = torch.autograd.grad(objective, (x, w))
    with torch.no_grad():
        p = log_p.exp()
        g = torch.zeros_like(log_q) if grad_log_q is None else torch.where(slot_ok, grad_log_q.double().abs(), 0.0)
        e = torch.zeros_like(entropy) if grad_entropy is None else torch.where(valid, grad_entropy.double().abs(), 0.0)
        h_col = out["entropy"][..., None]
        terms = p * (g.sum(-1, keepdim=True) + e[..., None] * ((log_p + h_col).abs() + 1))
        terms = terms.scatter_add(-1, torch.where(slot_ok, ids, 0), g) / scale
        hidden_terms = terms @ w.detach().abs()
        weight_terms = terms.reshape(-1, terms.shape[-1]).t() @ x.detach().abs().reshape(-1, x.shape[-1])
    if hidden.dim() == 3:
        d_x, hidden_terms = d_x.transpose(0, 1), hidden_terms.transpose(0, 1)
    out.update(d_hidden=d_x, d_weight=d_w, d_hidden_terms=hidden_terms, d_weight_terms=weight_terms)
    return out
