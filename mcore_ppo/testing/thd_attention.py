"""A reference core attention that accepts packed THD batches, for tests without TransformerEngine.

Megatron's local ``DotProductAttention`` rejects ``PackedSeqParams`` (only TransformerEngine's
attention runs THD). :class:`ThdDotProductAttention` turns the packed boundaries into a
block-diagonal causal mask over the ``[t]`` packed tokens and runs the local attention on the
``[t, 1, ...]`` batch: the same math as THD attention, with ``O(t²)`` memory, so it is for
small test batches only. It works on any device (the GPU suite uses it too).

:class:`SdpaThdAttention` runs the same block-diagonal causal attention through
``torch.nn.functional.scaled_dot_product_attention`` (on CUDA its memory-efficient kernel
takes the mask without materialising the ``[heads, t, t]`` scores), for benchmarks of
realistic micro-batch sizes without TransformerEngine (``scripts/bench_ppo.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
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


class SdpaThdAttention(ThdDotProductAttention):
    """:class:`ThdDotProductAttention` computed by ``scaled_dot_product_attention`` (packed THD only).

    Same math (scale ``softmax_scale``, block-diagonal causal mask, no dropout); the softmax is
    the kernel's (fp32 accumulation) instead of Megatron's unfused one.
    """

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
            raise ValueError(f"SdpaThdAttention: qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
        if attention_bias is not None or self.config.apply_query_key_layer_scaling:
            raise NotImplementedError("SdpaThdAttention: no attention bias or query-key layer scaling")
        if getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("SdpaThdAttention: only the vanilla softmax")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        # [t, heads, dim] (or [t, 1, heads, dim]) -> [1, heads, t, dim]
        q, k, v = (x.reshape(x.shape[0], *x.shape[-2:]).transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        allowed = ~packed_causal_mask(cu_seqlens, q.shape[2], q.device)  # SDPA: True = may attend
        dropout = self.config.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale)
        # [1, heads, t, dim] -> [t, 1, heads·dim], what DotProductAttention returns.
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[2], 1, self.hidden_size_per_partition)


def thd_local_layer_spec(*, attention: str = "reference", **kwargs: Any):
    """``get_gpt_layer_local_spec(**kwargs)`` with THD-capable core attention.

    Args:
        attention: ``"reference"`` (:class:`ThdDotProductAttention`, Megatron's unfused softmax)
            or ``"sdpa"`` (:class:`SdpaThdAttention`).
    """
    classes = {"reference": ThdDotProductAttention, "sdpa": SdpaThdAttention}
    if attention not in classes:
        raise ValueError(f"attention must be one of {sorted(classes)}, got {attention!r}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(**kwargs))
    spec.submodules.self_attention.submodules.core_attention = classes[attention]
    return spec
