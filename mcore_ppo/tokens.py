"""Per-token values between a caller's layout and the head's token order.

The kernels see tokens as rows: ``hidden [n, h]`` and per-token values ``[n, ...]``. Megatron's
hidden ``[s, b, h]`` is sequence-major, so its ``[b, s, ...]`` labels (and temperatures, and
outputs) are transposed on the way in and back on the way out; ``[n, ...]`` and verl's flat
order pass as they are. The head, its ``[..., k]`` labels and the teacher's top-k share these.
"""

from __future__ import annotations

import math

import torch


def hidden_rows(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [..., h]`` as ``[n, h]`` (a 2-D tensor as it is: a view costs host time)."""
    if hidden.dim() == 2:
        return hidden
    return hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])


def to_rows(values: torch.Tensor, batch_first: bool, per_token_dims: int = 0) -> torch.Tensor:
    """Per-token ``values`` in token order: ``[b, s, *rest]`` (``batch_first``) as
    ``[s·b, *rest]``, else ``[*tokens, *rest]`` as ``[n, *rest]``; ``rest`` is the last
    ``per_token_dims`` dims (``k`` ids per token: 1)."""
    rest = tuple(values.shape[values.dim() - per_token_dims :])
    if batch_first:
        batch, seq = values.shape[:2]
        return values.transpose(0, 1).reshape(seq * batch, *rest)
    if values.dim() == 1 + per_token_dims:
        return values
    return values.reshape(-1, *rest)


def from_rows(values: torch.Tensor, batch_first: bool, batch: int, seq: int) -> torch.Tensor:
    """Token-order ``values [s·b, *rest]`` back as ``[b, s, *rest]`` (``batch_first``), else as they are."""
    if not batch_first:
        return values
    rest = tuple(values.shape[1:])
    return values.view(seq, batch, *rest).transpose(0, 1).contiguous()
