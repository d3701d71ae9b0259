"""fp64 full-logits reference of :func:`mcore_ppo.fused_topk`, for the single- and multi-rank tests.

The whole ``[tokens, V]`` logits in float64, ``log_softmax``, then a stable descending sort of
each row (so equal values keep ascending ids: the tie rule), the first ``k`` kept and the rest
summed for the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopKReference:
    """Reference outputs in ``fused_topk``'s layout, and the full log-probs they come from."""

    ids: torch.Tensor  # int64 [..., k]
    log_probs: torch.Tensor  # fp64 [..., k]
    tail_log_mass: torch.Tensor  # fp64 [...]
    full_log_probs: torch.Tensor  # fp64 [..., V]
    valid: torch.Tensor  # bool [...], False where the label is ignore_index


def full_log_probs(hidden: torch.Tensor, weight: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """fp64 ``log_softmax(hidden @ W.T / T)`` in the outputs' token layout (``[s, b, h] -> [b, s, V]``).

    ``temperature``: a number, or a per-token tensor in that layout (``[b, s]``, ``[n]``) or
    broadcastable to it; its values are taken exactly (fp64)."""
    logits = hidden.double() @ weight.double().t()
    if hidden.dim() == 3:
        logits = logits.transpose(0, 1)
    if isinstance(temperature, torch.Tensor):
        return torch.log_softmax(logits / temperature.double().cpu()[..., None], dim=-1)
    return torch.log_softmax(logits / temperature, dim=-1)


def topk_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> TopKReference:
    """The global top-``k`` of the full fp64 distribution (``weight`` is the whole ``[V, h]``);
    ``temperature`` a number or per token in the outputs' layout (:func:`full_log_probs`)."""
    log_p = full_log_probs(hidden, weight, temperature)
    values, ids = log_p.sort(stable=True, dim=-1, descending=True)
    tail = torch.logsumexp(values[..., k:], dim=-1)
    valid = torch.ones(log_p.shape[:-1], dtype=torch.bool) if labels is None else labels != ignore_index
    ids, top = ids[..., :k], values[..., :k]
    ids = torch.where(valid[..., None], ids, torch.full_like(ids, ignore_index))
    top = torch.where(valid[..., None], top, torch.zeros_like(top))
    tail = torch.where(valid, tail, torch.zeros_like(tail))
    return TopKReference(ids, top, tail, log_p, valid)


def log_probs_at(ref: TopKReference, ids: torch.Tensor) -> torch.Tensor:
    """The reference's fp64 log-probs at ``ids`` (0 for an ignored token, as ``fused_topk`` gives)."""
    safe = torch.where(ref.valid[..., None], ids.cpu(), torch.zeros_like(ids.cpu()))
    picked = ref.full_log_probs.gather(-1, safe)
    return torch.where(ref.valid[..., None], picked, torch.zeros_like(picked))


def integer_case(shape: tuple[int, ...], vocab: int, hidden_size: int, generator: torch.Generator):
    """``(hidden, weight)`` with entries in {-1, 0, 1}: every logit is a small integer, exact in
    any dtype and any summation order, and most of them tie (across chunks and shards)."""
    hidden = torch.randint(-1, 2, (*shape, hidden_size), generator=generator).double()
    weight = torch.randint(-1, 2, (vocab, hidden_size), generator=generator).double()
    return hidden, weight


def full_pairs(full: torch.Tensor) -> list[tuple[int, int]]:
    """The (row, tile) pairs that a launch of the teacher's kernel path recomputed whole, from
    its flags ``full [n, tiles]`` (nonzero: full), by row then tile; reads them back to the host
    (for tests and benchmarks)."""
    return [tuple(pair) for pair in full.nonzero().tolist()]
