"""The float64 reference of the head, and the error metrics every test and benchmark uses.

Deliberately naive: ``log_softmax(hidden @ W.T / T)`` over the whole vocabulary in fp64, the
label's log-probability picked with ``gather``, the entropy ``-Σ p log p``, ignored tokens set
to 0, and the gradients taken by ``torch.autograd.grad`` through that graph. Inputs are upcast
from whatever dtype the head saw (bf16 values upcast exactly), so the reference answers "what
would exact arithmetic give on these very inputs". Tokens are processed in row chunks when
asked (``rows_per_chunk``), so the benchmark's full shapes fit a GPU.

Layouts follow the head's (Megatron's): hidden ``[s, b, h]`` pairs with labels ``[b, s]``,
``[n, h]`` with ``[n]``. Upstream gradients are shaped like the labels. The temperature is a
float or a tensor shaped like the labels or broadcastable to them (per token: row ``i`` of the
logits divided by ``T_i``, in fp64).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

IGNORE_INDEX = -100


def _tokens_first(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden ``[..., h]`` and labels arranged so that their leading dims match token for token.

    ``[s, b, h]`` + ``[b, s]`` → hidden viewed as ``[b, s, h]``; ``[n, h]`` + ``[n]`` as they are.
    """
    if hidden.dim() == 3:
        return hidden.transpose(0, 1), labels
    return hidden, labels


def _per_row(temperature: float | torch.Tensor, lead: torch.Size | tuple[int, ...], device) -> float | torch.Tensor:
    """A float as it is; a tensor broadcast to ``lead`` (the labels' shape), fp64, as a ``[..., 1]`` column."""
    if not isinstance(temperature, torch.Tensor):
        return temperature
    return temperature.detach().to(device, torch.float64).expand(lead).unsqueeze(-1)


def outputs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob, entropy)`` in fp64 of full logits ``[..., V]`` for labels ``[...]``; 0 where ignored.

    ``temperature``: a float, or per token, a tensor broadcastable to ``labels``' shape."""
    scale = _per_row(temperature, labels.shape, logits.device)
    log_p = torch.log_softmax(logits.to(torch.float64) / scale, dim=-1)
    # p·log p with p = 0 is 0 (xlogy would also do); log_p is finite for finite logits.
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    labels = labels.long()  # compared in int64, as the head does (a narrow dtype would wrap ignore_index)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    picked = log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


def reference_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``(log_prob, entropy)`` shaped like ``labels``, differentiable w.r.t. fp64 leaves.

    ``hidden`` and ``weight`` must already be fp64 (see :func:`reference`); the logits of every
    token over the whole vocabulary are materialised.
    """
    assert hidden.dtype == weight.dtype == torch.float64
    x, labels = _tokens_first(hidden, labels)
    return outputs_from_logits(torch.matmul(x, weight.t()), labels, temperature, ignore_index)


def sum_pi_squared_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """fp64 ``Σ_v softmax(hidden @ W.T / T)_v²`` per token from the full logits, shaped like
    ``labels`` (per token: ``[..., k]`` labels give ``[...]``, a token counting when any slot is
    not ignored), 0 for ignored tokens."""
    x, token_labels = _tokens_first(hidden.detach().to(torch.float64), labels)
    if token_labels.dim() == x.dim():  # k ids per token
        valid = (token_labels.long() != ignore_index).any(dim=-1)
    else:
        valid = token_labels.long() != ignore_index
    scale = _per_row(temperature, valid.shape, x.device)
    p = torch.softmax(torch.matmul(x, weight.detach().to(torch.float64).t()) / scale, dim=-1)
    return torch.where(valid, (p * p).sum(dim=-1), torch.zeros((), dtype=torch.float64))


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    grad_log_prob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    *,
    rows_per_chunk: int | None = None,
    with_terms: bool = True,
) -> dict[str, torch.Tensor]:
    """Reference outputs and, given per-token upstream gradients, the gradients of both inputs.

    Returns a dict with ``log_prob``, ``entropy`` (fp64, shaped like labels) and, when an
    upstream gradient is given, ``d_hidden`` and ``d_weight`` (fp64, shaped like the inputs) of
    ``Σ g·log_prob + Σ e·entropy`` (a missing ``g`` or ``e`` counts as zero), with
    ``with_terms`` also ``d_hidden_terms`` and ``d_weight_terms`` (see
    :func:`_gradient_term_magnitudes`). ``rows_per_chunk``: tokens per fp64 ``[rows, V]`` block
    (None: all at once). Computed on ``hidden``'s device. ``temperature``: a float, or a
    tensor shaped like ``labels`` or broadcastable to them (per token). To check the head with
    the entropy off, pass ``grad_entropy=None`` (its gradients are then those of log_prob alone).
    """
    if isinstance(temperature, torch.Tensor):
        # Per token, in the labels' layout, then in the tokens-first order of x below.
        temperature = temperature.detach().to(hidden.device, torch.float64).expand(labels.shape).reshape(-1)
    x, token_labels = _tokens_first(hidden.detach(), labels)
    lead, h = token_labels.shape, hidden.shape[-1]
    x = x.reshape(-1, h)
    token_labels = token_labels.reshape(-1)
    n = token_labels.numel()
    with_grads = grad_log_prob is not None or grad_entropy is not None
    g = None if grad_log_prob is None else grad_log_prob.reshape(-1).to(x.device, torch.float64)
    e = None if grad_entropy is None else grad_entropy.reshape(-1).to(x.device, torch.float64)
    w64 = weight.detach().to(torch.float64).requires_grad_(with_grads)
    out = {name: torch.zeros(n, dtype=torch.float64, device=x.device) for name in ("log_prob", "entropy")}
    if with_grads:
        out["d_hidden"] = torch.zeros(n, h, dtype=torch.float64, device=x.device)
        out["d_weight"] = torch.zeros_like(w64)
        if with_terms:
            out["d_hidden_terms"] = torch.zeros_like(out["d_hidden"])
            out["d_weight_terms"] = torch.zeros_like(out["d_weight"])
    step = rows_per_chunk or max(n, 1)
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        rows_t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        x64 = x[rows].to(torch.float64).requires_grad_(with_grads)
        with torch.set_grad_enabled(with_grads):  # the reference's own graph, whatever the caller's mode
            log_prob, entropy = reference_outputs(x64, w64, token_labels[rows], rows_t, ignore_index)
            out["log_prob"][rows], out["entropy"][rows] = log_prob.detach(), entropy.detach()
            if not with_grads:
                continue
            objective = torch.zeros((), dtype=torch.float64, device=x.device)
            if g is not None:
                objective = objective + (log_prob * g[rows]).sum()
            if e is not None:
                objective = objective + (entropy * e[rows]).sum()
            d_hidden, d_weight = torch.autograd.grad(objective, (x64, w64), allow_unused=True)
        if d_hidden is not None:
            out["d_hidden"][rows] = d_hidden
        if d_weight is not None:
            out["d_weight"] += d_weight
        if with_terms:
            upstream = (_rows(g, rows), _rows(e, rows))
            hidden_terms, weight_terms = _gradient_term_magnitudes(
                x64.detach(), w64.detach(), token_labels[rows], rows_t, *upstream, ignore_index
            )
            out["d_hidden_terms"][rows] = hidden_terms
            out["d_weight_terms"] += weight_terms
    for name in ("log_prob", "entropy"):
        out[name] = out[name].view(lead)
    for name in ("d_hidden", "d_hidden_terms"):
        if name in out:  # back from tokens-first to hidden's own layout
            value = out[name].view(*lead, h)
            out[name] = value.transpose(0, 1) if hidden.dim() == 3 else value
    return out


def _rows(values: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if values is None else values[rows]


def _gradient_term_magnitudes(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    grad_log_prob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element, the sum of the absolute values of the terms each gradient is a sum of
    (fp64 ``hidden [n, h]``, ``labels [n]``).

    ``d_hidden_k = Σ_j dz_j w_jk / T`` and ``d_weight_jk = Σ_t dz_tj x_tk / T`` with
    ``dz_j = g·1[j=label] - p_j·(g + e·(log p_j + H))``. Rounding of a sum is bounded relative to
    the sum of its terms' magnitudes, not to its result (which can cancel to ~0, e.g. when all
    logits are equal), and so is the effect of an absolute error δz in the logits, which moves
    ``p_j`` by ~δz·p_j. So a gradient's tolerance is taken relative to
    ``Σ_j S_j |w_jk| / T`` (resp. ``Σ_t S_tj |x_tk| / T``) with
    ``S_j = |g|·1[j=label] + p_j·(|g| + |e|·(|log p_j + H| + 1))``.
    """
    scale = _per_row(temperature, labels.shape, hidden.device)
    log_p = torch.log_softmax(torch.matmul(hidden, weight.t()) / scale, dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(dim=-1, keepdim=True)
    zero = torch.zeros(labels.shape, dtype=torch.float64, device=hidden.device)
    g = zero if grad_log_prob is None else grad_log_prob.abs()
    e = zero if grad_entropy is None else grad_entropy.abs()
    labels = labels.long()
    valid = labels != ignore_index
    g, e = torch.where(valid, g, zero)[:, None], torch.where(valid, e, zero)[:, None]
    terms = p * (g + e * ((log_p + entropy).abs() + 1))
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    terms = terms.scatter_add(-1, safe.unsqueeze(-1), g) / scale
    return torch.matmul(terms, weight.abs()), torch.matmul(terms.t(), hidden.abs())


# --- error metrics -------------------------------------------------------------------------------

#: Largest relative error seen in this process, per (dtype name, output name).
MAX_RELATIVE_ERROR: dict[tuple[str, str], float] = defaultdict(float)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|`` (max-norm relative error; 0/0 counts as 0)."""
    actual, expected = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def normwise_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖₂ / ‖expected‖₂`` in fp64 (the absolute norm when ``expected`` is 0)."""
    diff = (actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).norm().item()
    scale = expected.detach().to(torch.float64).norm().item()
    return diff / scale if scale > 0 else diff


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str,
    dtype: torch.dtype,
    rtol: float,
    atol: float = 0.0,
    elementwise_rtol: float = 0.0,
    terms: torch.Tensor | None = None,
    track: bool = True,
    track_scale: float | None = None,
) -> None:
    """Elementwise ``|a - e| <= atol + rtol·scale + elementwise_rtol·|e|``, and record the error.

    ``scale`` is ``terms`` (per element, the magnitude of the terms the value is a sum of; see
    :func:`_gradient_term_magnitudes`) when given, else the largest reference value of the
    tensor: accumulated rounding scales with the terms, not with the result.
    ``elementwise_rtol`` covers a final cast (e.g. to bf16), whose rounding is relative to each
    element itself. The tracked error is max-norm relative, or ``max|a - e| / track_scale``
    when given (for cases whose natural scale is not the result's, e.g. the logit scale).
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    if terms is not None:
        scale = terms.detach().to(torch.float64)
    else:
        scale = e.abs().max().item() if e.numel() else 0.0
    bound = atol + rtol * scale + elementwise_rtol * e.abs()
    err = (a - e).abs()
    if track:
        key = (str(dtype).replace("torch.", ""), name)
        if track_scale is None:
            tracked = relative_error(a, e)
        else:
            tracked = err.max().item() / track_scale if err.numel() else 0.0
        MAX_RELATIVE_ERROR[key] = max(MAX_RELATIVE_ERROR[key], tracked)
    bad = err > bound
    if bool(bad.any()):
        worst = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())}/{err.numel()} elements out of tolerance; worst at flat index "
            f"{worst}: actual {a.flatten()[worst].item():.9g}, expected {e.flatten()[worst].item():.9g}, "
            f"|diff| {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
            f"(max-norm relative error {relative_error(a, e):.3g})"
        )


def error_table() -> str:
    """The tracked largest relative errors as text lines (for the end-of-suite report)."""
    lines = ["largest relative error vs the fp64 reference, this run (max|diff| / max|ref| unless the row says):"]
    for (dtype, name), err in sorted(MAX_RELATIVE_ERROR.items()):
        lines.append(f"  {dtype:9s} {name:9s} {err:.3e}")
    return "\n".join(lines)


# --- invariants ---------------------------------------------------------------------------------


def check_invariants(
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
) -> None:
    """fp32 outputs shaped like labels; log_prob ≤ 0, 0 ≤ entropy ≤ log V; ignored tokens exactly 0."""
    for name, out in (("log_prob", log_prob), ("entropy", entropy)):
        assert out.dtype == torch.float32, f"{name} dtype {out.dtype}, expected float32"
        assert out.shape == labels.shape, f"{name} shape {tuple(out.shape)} != labels {tuple(labels.shape)}"
        assert torch.isfinite(out).all(), f"{name} has non-finite values"
    assert (log_prob <= 0).all(), f"log_prob > 0: max {log_prob.max().item()}"
    assert (entropy >= 0).all(), f"entropy < 0: min {entropy.min().item()}"
    # Exactly, in fp64: the fp32 entropy may not exceed the real log V (docs/design.md §1.1).
    log_v = math.log(vocab_size)
    excess = (entropy.double() - log_v).max().item() if entropy.numel() else 0.0
    assert excess <= 0, f"entropy > log V={log_v!r} by {excess:.3g}"
    ignored = labels.long() == ignore_index
    assert (log_prob[ignored] == 0).all() and (entropy[ignored] == 0).all(), "ignored tokens must give exact zeros"
