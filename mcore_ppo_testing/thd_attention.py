"""A reference core attention that accepts packed THD batches, for tests without TransformerEngine.

Megatron's local ``DotProductAttention`` rejects ``PackedSeqParams`` (only TransformerEngine's
attention runs THD). :class:`ThdDotProductAttention` turns the packed boundaries into a
block-diagonal causal mask over the ``[t]`` packed tokens and runs the local attention on the
``[t, 1, ...]`` batch: the same math as THD attention, with ``O(t²)`` memory, so it is for
small test batches only. It works on any device (the GPU suite uses it too).

:class:`SdpaThdAttention` computes the same attention with
``torch.nn.functional.scaled_dot_product_attention``, causal, one call per packed sequence:
the cost of varlen (THD) attention without TransformerEngine, for benchmarks of realistic
micro-batch sizes (``scripts/bench_ppo.py``).
"""

from __future__ import annotations

import copy
import itertools
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
    """Packed THD attention as ``scaled_dot_product_attention`` per sequence (causal, no mask tensor).

    The same math as :class:`ThdDotProductAttention` (scale ``softmax_scale``, each packed
    segment attends causally within itself), with the work of varlen attention:
    ``O(Σ len²)`` compute and no ``[heads, t, t]`` scores in memory (on CUDA SDPA picks a
    flash / memory-efficient kernel; the softmax is the kernel's, fp32-accumulated). The
    segment boundaries are read to the host once per ``PackedSeqParams`` (one sync per
    micro-batch, cached on the object). Packed THD batches only.
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
        total = query.shape[0]
        bounds = _host_bounds(packed_seq_params)
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"SdpaThdAttention: cu_seqlens {bounds} do not cover the {total} packed tokens")
        # [t, heads, dim] (or [t, 1, heads, dim]) -> [1, heads, t, dim]
        q, k, v = (x.reshape(total, *x.shape[-2:]).transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        options = {
            "dropout_p": self.config.attention_dropout if self.training else 0.0,
            "is_causal": True,
            "scale": self.softmax_scale,
        }
        segments = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        out = torch.cat(
            [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], **options) for a, b in segments],
            dim=2,
        )
        # [1, heads, t, dim] -> [t, 1, heads·dim], what DotProductAttention returns.
        return out.squeeze(0).transpose(0, 1).reshape(total, 1, self.hidden_size_per_partition)


def _host_bounds(packed_seq_params: Any) -> list[int]:
    """The padded ``cu_seqlens`` as host ints, read once per ``PackedSeqParams`` (every layer reuses them)."""
    bounds = getattr(packed_seq_params, "_mcore_ppo_host_cu_seqlens", None)
    if bounds is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        bounds = [int(x) for x in cu_seqlens.tolist()]
        packed_seq_params._mcore_ppo_host_cu_seqlens = bounds
    return bounds


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
