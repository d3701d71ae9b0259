"""A reference core attention that accepts packed THD batches, for tests without TransformerEngine.

Megatron's local ``DotProductAttention`` rejects ``PackedSeqParams`` (only TransformerEngine's
attention runs THD). :class:`ThdDotProductAttention` turns the packed boundaries into a
block-diagonal causal mask over the ``[t]`` packed tokens and runs the local attention on the
``[t, 1, ...]`` batch: the same math as THD attention, with ``O(t²)`` memory, so it is for
small test batches only. It works on any device (the GPU suite uses it too).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, t, t]`` bool mask, True where attention is *not* allowed (Megatron's convention):
    across sequence boundaries and to future positions."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    positions = torch.arange(total, device=device)
    seq_id = torch.bucketize(positions, bounds[1:], right=True)
    same_sequence = seq_id[:, None] == seq_id[None, :]
    causal = positions[None, :] <= positions[:, None]
    return ~(same_sequence & causal)[None, None]


class ThdDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also runs ``qkv_format == "thd"`` (see the module doc)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"ThdDotProductAttention: qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        # SelfAttention squeezed the dummy batch dim for THD: [t, heads, dim] -> [t, 1, heads, dim].
        query, key, value = (x.unsqueeze(1) if x.dim() == 3 else x for x in (query, key, value))
        mask = packed_causal_mask(cu_seqlens, query.shape[0], query.device)
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)


def thd_local_layer_spec(**kwargs: Any):
    """``get_gpt_layer_local_spec(**kwargs)`` with :class:`ThdDotProductAttention` as core attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(**kwargs))
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    return spec
