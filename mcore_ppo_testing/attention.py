"""Core attentions for Megatron's local layer spec, for runs without TransformerEngine.

Megatron's local ``DotProductAttention`` rejects packed (THD) batches and context parallelism:
both are TransformerEngine's. The tests, the CPU demo and the GPU benchmarks of this project
run without TransformerEngine, so this module provides two core attentions with the same
constructor and ``forward`` signature as Megatron's:

- :class:`ThdDotProductAttention` (``"reference"``): Megatron's own unfused softmax over a
  block-diagonal causal mask of the packed tokens. ``O(t²)`` memory; CP 1 only. It is the
  oracle the other is tested against.
- :class:`SdpaAttention` (``"sdpa"``): causal attention on ``torch`` SDPA for padded
  ``[s, b]`` and packed THD batches, GQA, and **Megatron's context parallelism**: each CP rank
  holds chunks ``r`` and ``2cp-1-r`` of every sequence (Megatron's load-balanced order), its
  keys and values are all-gathered over the CP group (the ``all_gather`` scheme of
  TransformerEngine's CP, ``cp_comm_type="all_gather"``; backward: reduce-scatter), and each
  local query chunk attends causally to its sequence's keys up to the chunk's end. Exact: the
  same softmax as CP 1, only the summation order differs. On CUDA in 16-bit it runs all
  segments in one flash-attention varlen call (``torch.nn.attention.varlen``): no per-sequence
  kernel launches and nothing compiled or planned per new sequence length. Elsewhere (CPU,
  fp32/fp64) it loops over segments with ``scaled_dot_product_attention``.

Segment boundaries (``cu_seqlens_q_padded`` of ``PackedSeqParams``, global as Megatron and
TransformerEngine define them under CP) are read to the host once per ``PackedSeqParams``
(cached on the object) and turned into index plans cached per layout.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from mcore_ppo.parallel.context_parallel import cp_token_index
from mcore_ppo.parallel.groups import ProcessGroup, group_rank, group_size
from mcore_ppo.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim

__all__ = ["SdpaAttention", "ThdDotProductAttention", "packed_causal_mask"]


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, t, t]`` bool mask, True where attention is *not* allowed (Megatron's convention):
    across sequence boundaries and to future positions."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    positions = torch.arange(total, device=device)
    seq_id = torch.bucketize(positions, bounds[1:], right=True)
    same_sequence = seq_id[:, None] == seq_id[None, :]
    causal = positions[None, :] <= positions[:, None]
    return ~(same_sequence & causal)[None, None]


def _padded_cu_seqlens(packed_seq_params: Any) -> torch.Tensor:
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu_seqlens is None else cu_seqlens


def _check_thd(packed_seq_params: Any, name: str) -> None:
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"{name}: qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")


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
        _check_thd(packed_seq_params, "ThdDotProductAttention")
        # SelfAttention squeezed the dummy batch dim for THD: [t, heads, dim] -> [t, 1, heads, dim].
        query, key, value = (x.unsqueeze(1) if x.dim() == 3 else x for x in (query, key, value))
        mask = packed_causal_mask(_padded_cu_seqlens(packed_seq_params), query.shape[0], query.device)
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)


# ---------------------------------------------------------------------------------------------
# Segment plans: which local queries attend to which keys


@dataclass(frozen=True)
class _Plan:
    """Attention segments of one rank's packed tokens (host lists; see :func:`_plan`).

    Segment ``i``: local queries ``[q_cu[i], q_cu[i+1])`` attend, causally aligned to the bottom
    right, to the keys at rows ``key_rows[k_cu[i]:k_cu[i+1]]`` of the key source (the local keys
    at CP 1, the CP-gathered keys otherwise, in gathered order).
    """

    q_cu: tuple[int, ...]
    k_cu: tuple[int, ...]
    key_rows: tuple[int, ...] | None  # None: the keys are the queries' own rows (CP 1)
    # device -> (key_rows, q_cu, k_cu) as tensors, made once per device (every layer reuses them)
    _on_device: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @functools.cached_property
    def max_q(self) -> int:
        """The longest query segment (computed once; every layer asks)."""
        return max((b - a for a, b in itertools.pairwise(self.q_cu)), default=0)

    @functools.cached_property
    def max_k(self) -> int:
        """The longest key segment."""
        return max((b - a for a, b in itertools.pairwise(self.k_cu)), default=0)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``(key_rows int64 or None, q_cu int32, k_cu int32)`` on ``device``."""
        if device not in self._on_device:
            rows = None if self.key_rows is None else torch.tensor(self.key_rows, dtype=torch.long, device=device)
            q_cu = torch.tensor(self.q_cu, dtype=torch.int32, device=device)
            k_cu = torch.tensor(self.k_cu, dtype=torch.int32, device=device)
            self._on_device[device] = (rows, q_cu, k_cu)
        return self._on_device[device]

    def keys_and_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment's keys and values laid out contiguously (``k_cu`` indexes them)."""
        rows = self.tensors(k.device)[0]
        if rows is None:
            return k, v
        return k.index_select(0, rows), v.index_select(0, rows)


# A rollout brings new layouts every step; 64 plans (with their index tensors on the device)
# cover a step's micro-batches in every layer without holding on to old steps.
@functools.lru_cache(maxsize=64)
def _plan(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> _Plan:
    """The segments of CP rank ``cp_rank`` for global sequence bounds ``bounds``.

    CP 1: one segment per non-empty sequence, causal. CP > 1: each sequence of padded length
    ``L`` is cut in ``2·cp`` chunks of ``L/(2cp)``; this rank's local tokens are chunks ``r``
    and ``2cp-1-r`` of every sequence, in order (:func:`mcore_ppo.parallel.context_parallel.cp_token_index`),
    and local chunk ``c`` attends to global keys ``[start, start + (c+1)·L/(2cp))`` of its
    sequence. The CP all-gather concatenates every rank's local tokens rank by rank, so a
    global position maps to a row of the gathered keys through the inverse of that order.
    """
    q_cu, k_cu = [0], [0]
    if cp_size == 1:
        for start, end in itertools.pairwise(bounds):
            if end > start:
                q_cu.append(q_cu[-1] + end - start)
                k_cu.append(k_cu[-1] + end - start)
        return _Plan(tuple(q_cu), tuple(k_cu), None)
    gathered_order = [p for rank in range(cp_size) for p in cp_token_index(bounds, cp_size, rank)]
    row_of = {position: row for row, position in enumerate(gathered_order)}
    key_rows: list[int] = []
    for start, end in itertools.pairwise(bounds):
        chunk = (end - start) // (2 * cp_size)
        if chunk == 0:
            continue
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            key_end = start + (c + 1) * chunk
            q_cu.append(q_cu[-1] + chunk)
            k_cu.append(k_cu[-1] + key_end - start)
            key_rows.extend(row_of[p] for p in range(start, key_end))
    return _Plan(tuple(q_cu), tuple(k_cu), tuple(key_rows))


def _host_bounds(packed_seq_params: Any) -> tuple[int, ...]:
    """The padded ``cu_seqlens`` as host ints, read once per ``PackedSeqParams`` (every layer reuses them)."""
    bounds = getattr(packed_seq_params, "_mcore_ppo_host_cu_seqlens", None)
    if bounds is None:
        bounds = tuple(int(x) for x in _padded_cu_seqlens(packed_seq_params).tolist())
        packed_seq_params._mcore_ppo_host_cu_seqlens = bounds
    return bounds


# ---------------------------------------------------------------------------------------------
# The two ways of computing the segments


@functools.cache
def _varlen_attn() -> tuple[Any, dict[str, Any], bool] | None:
    """torch's flash varlen attention, its causal keyword (torch 2.10: ``is_causal``; later:
    ``window_size``) and whether it takes ``enable_gqa``; None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _uses_varlen(query: torch.Tensor, dropout: float) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and _varlen_attn() is not None
    )


def _segments_varlen(q, k, v, plan: _Plan, scale: float) -> torch.Tensor:
    """All segments in one flash varlen call (keys of every segment laid out contiguously)."""
    varlen_attn, causal, takes_gqa = _varlen_attn()
    k, v = plan.keys_and_values(k, v)
    _, q_cu, k_cu = plan.tensors(q.device)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            gqa = {"enable_gqa": True}
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(
        q,
        k,
        v,
        q_cu,
        k_cu,
        plan.max_q,
        plan.max_k,
        scale=scale,
        **causal,
        **gqa,
    )


def _segments_sdpa(q, k, v, plan: _Plan, scale: float, dropout: float) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` per segment (any device and dtype)."""
    k, v = plan.keys_and_values(k, v)
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    outs = []
    for (qa, qb), (ka, kb) in zip(itertools.pairwise(plan.q_cu), itertools.pairwise(plan.k_cu), strict=True):
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[qa:qb], k[ka:kb], v[ka:kb]))
        q_len, k_len = qb - qa, kb - ka
        if q_len == k_len:
            mask, is_causal = None, True
        else:  # query i sits at key position i + (k_len - q_len): causal aligned to the bottom right
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
            is_causal = False
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale
        )
        outs.append(out.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------------------------------
# The module


class SdpaAttention(MegatronModule):
    """Causal core attention on torch SDPA: padded and packed THD, GQA, context parallelism.

    Constructed by Megatron's ``SelfAttention`` like ``DotProductAttention`` (see the module doc).
    Supported: causal self-attention (``attention_mask`` None), the vanilla softmax, no
    attention bias, no query-key layer scaling, no sliding window. Under CP every sequence's
    padded length must divide by ``2·cp`` (Megatron's and verl's packers pad so).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_later_megatron_keywords: Any,  # newer Megatron versions pass more; none changes this math
    ) -> None:
        super().__init__(config=config)
        if config.apply_query_key_layer_scaling or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("SdpaAttention: no query-key layer scaling, only the vanilla softmax")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("SdpaAttention: no sliding-window attention")
        if cp_comm_type not in (None, "all_gather"):
            raise NotImplementedError(f"SdpaAttention: CP runs as all_gather, got cp_comm_type={cp_comm_type!r}")
        self.tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        # A model built with context_parallel_size=1 on a CP world (a cp=1 reference run beside
        # the CP one) sees whole sequences: no CP group then.
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
            if group_size(self.cp_group) != config.context_parallel_size:
                raise ValueError(
                    f"SdpaAttention: the CP group has {group_size(self.cp_group)} ranks but "
                    f"config.context_parallel_size is {config.context_parallel_size}"
                )
        tp = group_size(self.tp_group)
        head_dim = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.hidden_size_per_partition = head_dim * self.num_attention_heads_per_partition
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

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
        """``[s, b, heads, d]`` (or THD ``[t, heads, d]``) queries, keys, values → ``[s, b, heads·d]``
        (THD: ``[t, 1, heads·d]``), this rank's tokens in Megatron's CP order."""
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention: no attention bias")
        if attention_mask is not None:
            raise NotImplementedError(
                "SdpaAttention runs causal attention from the layout (padded rows or packed "
                "cu_seqlens): pass attention_mask=None"
            )
        cp, cp_rank = group_size(self.cp_group), group_rank(self.cp_group)
        if packed_seq_params is not None:
            _check_thd(packed_seq_params, "SdpaAttention")
            q, k, v = (x.reshape(x.shape[0], *x.shape[-2:]) for x in (query, key, value))
            bounds = _host_bounds(packed_seq_params)
        else:
            # Padded rows are sequences: [s, b, heads, d] -> row-major [b·s, heads, d].
            seq, batch = query.shape[:2]
            q, k, v = (x.transpose(0, 1).reshape(batch * seq, *x.shape[2:]) for x in (query, key, value))
            bounds = tuple(range(0, batch * seq * cp + 1, seq * cp))
        total = q.shape[0]
        if bounds[0] != 0 or bounds[-1] != total * cp:
            raise ValueError(f"SdpaAttention: cu_seqlens {list(bounds)} do not cover {total} local tokens × cp {cp}")
        plan = _plan(bounds, cp, cp_rank)
        if cp > 1:
            # Every rank's keys and values, rank by rank; the backward sums each rank's
            # gradient contributions and hands every rank its own rows (reduce-scatter).
            k, v = gather_sequence_parallel(k, self.cp_group), gather_sequence_parallel(v, self.cp_group)
        dropout = self.dropout if self.training else 0.0
        if _uses_varlen(q, dropout):
            out = _segments_varlen(q, k, v, plan, self.softmax_scale)
        else:
            out = _segments_sdpa(q, k, v, plan, self.softmax_scale, dropout)
        if packed_seq_params is not None:
            return out.reshape(total, 1, self.hidden_size_per_partition)
        return out.reshape(batch, seq, self.hidden_size_per_partition).transpose(0, 1).contiguous()


class _GatherSequenceParallel(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_first_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_first_dim(grad, ctx.group), None


def gather_sequence_parallel(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather sequence-parallel ``tensor`` ([s/tp, ...] → [s, ...]); backward reduce-scatters."""
    if group_size(group) == 1:
        return tensor
    return _GatherSequenceParallel.apply(tensor, group)
