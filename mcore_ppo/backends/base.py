"""The contracts a backend of the head implements, and what travels between its two calls.

A per-shard :class:`Backend` computes, for one rank's vocab shard, the per-token softmax
statistics of the tempered logits ``z = hidden @ weight.T / T`` and, in the backward, this
shard's gradient contributions. It never communicates (the cross-rank combine and the
``d_hidden`` reduction live in :mod:`parallel` and in the autograd Function) and keeps nothing
between calls: whatever its backward may reuse from its forward is returned by
:meth:`Backend.shard_statistics` as :attr:`ShardStatistics.residual`, kept by the autograd
Function, and handed back in :attr:`SavedTokens.residual`.

Arguments shared by both per-shard methods:
    hidden: ``[n, h]`` activations (any float dtype; the backend computes in fp32).
    weight: ``[v, h]`` this rank's vocab shard.
    local_labels: ``[n]`` int64, the label's row in this shard, or -1 where the label is
        ignored or owned by another rank.
    valid: ``[n]`` bool, False for ignored tokens (their outputs and gradients are zero, and
        a backend may skip their GEMM work).
    temperature: python float > 0, or a per-token ``[n]`` tensor (fp32; fp64 for fp64 inputs;
        contiguous, validated, no gradient): row ``i``'s logits are divided by ``T_i``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from mcore_ppo.statistics import Statistics


@dataclass(frozen=True)
class ShardStatistics:
    """fp32 statistics of one shard, packed as :mod:`mcore_ppo.statistics` describes, and what
    the backward may reuse.

    ``m``: ``[n]`` shard max of ``z``; ``sums``: ``[terms, n]`` the call's
    :attr:`Statistics.sums <mcore_ppo.statistics.Statistics.sums>` relative to ``m`` (``S =
    Σexp(z-m)`` first); ``y``: ``[n]`` ``z_label`` (0 if the label is not in this shard).
    ``residual``: the backend's own tensors for its backward (the triton backend's probability
    buffer and row order), empty when the backward recomputes from nothing kept; plain tensors,
    so the head's op can return and save them where saved-tensor hooks see them.
    """

    m: torch.Tensor
    sums: torch.Tensor
    y: torch.Tensor
    residual: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class SavedTokens:
    """What the forward leaves for the backward: per-token ``[n]`` tensors and the residual.

    ``local_labels`` and ``valid`` as in the module doc; ``lse`` and ``entropy`` are the
    combined (global, over every TP rank) fp32 values (``entropy`` None when it is off: then
    no entropy gradient is asked for either); ``residual`` is
    :attr:`ShardStatistics.residual` of the same call (empty: nothing kept). With ``k`` ids per
    token, ``local_ids`` ``[n, k]`` holds each id's row in this shard (-1 elsewhere) and
    ``slot_ok`` which slots count; both are the Function's, None with one label per token.
    ``fused_forward``: the backend's own :meth:`Backend.head_forward` made them (its buffers are
    fresh allocations of known alignment, which a backend may key its backward's launches on).
    """

    local_labels: torch.Tensor
    valid: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    residual: tuple[torch.Tensor, ...] = ()
    local_ids: torch.Tensor | None = None
    slot_ok: torch.Tensor | None = None
    fused_forward: bool = False


@dataclass(frozen=True)
class SparseGradient:
    """One-hot upstream gradients at ``k`` ids per token, for a backend to add to its ``dz``.

    ``ids``: ``[n, k]`` int64, contiguous, rows in token order: each slot's row in this shard,
    or -1 (another rank's id, or an ignored slot). ``g``: ``[n, k]`` in the accumulation dtype
    (fp32; fp64 for fp64 inputs), contiguous, the slots' upstream gradients (any value where
    ``ids`` is -1: never read there). A duplicate id in a row gets the sum of its slots' ``g``.
    """

    ids: torch.Tensor
    g: torch.Tensor


@dataclass(frozen=True)
class GradientRequest:
    """What one backward asks of a shard.

    ``grad_log_prob`` / ``grad_entropy``: per-token ``[n]`` upstream gradients of the two
    outputs, None for an output that is unused. ``need_hidden_grad``: ``d_hidden`` is wanted.
    ``weight_grad``: the ``[v, h]`` buffer ``d_weight`` is accumulated into (zeros in fp32 or,
    see :attr:`Backend.weight_grad_in_weight_dtype`, the weight's dtype; or Megatron's
    ``main_grad``), None when no weight gradient is wanted. ``weight_grad_unset``: the buffer
    was allocated and not zeroed (``torch.empty``): the backend writes every row of it instead of
    adding (only for a backend with ``writes_weight_grad``). ``sparse``: extra one-hot terms,
    ``dz[t, ids[t, j]] += g[t, j]`` (then divided by ``T`` like the rest of ``dz``), summed into
    ``d_hidden`` and ``d_weight`` with the dense part (the head's ``[..., k]`` labels), or None.
    """

    grad_log_prob: torch.Tensor | None
    grad_entropy: torch.Tensor | None
    need_hidden_grad: bool
    weight_grad: torch.Tensor | None
    sparse: SparseGradient | None = None
    weight_grad_unset: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares about itself, read by the head's autograd Function.

    Attributes:
        fused_forward: :meth:`Backend.head_forward` runs the whole single-label forward of its
            shard (labels prepared and outputs finished in its kernels); False: the Function
            runs the generic forward over :meth:`Backend.shard_statistics`.
        weight_grad_in_weight_dtype: the ``d_W`` buffer may be in the weight's own dtype when
            Megatron's ``main_grad`` is not used: only for a backend that forms every row of
            ``d_W`` in one fp32-accumulated reduction over all tokens (one rounding).
        writes_weight_grad: with the above, the buffer may come unfilled (``torch.empty``,
            :attr:`GradientRequest.weight_grad_unset`): the backend writes every row.
    """

    fused_forward: bool = False
    weight_grad_in_weight_dtype: bool = False
    writes_weight_grad: bool = False


class HeadForward(NamedTuple):
    """What :meth:`Backend.head_forward` returns: the head's outputs (fp32 ``[n]``, ``entropy``
    None when it is off) and what its backward needs (the ``SavedTokens`` that
    :meth:`Backend.shard_gradients` receives; ``lse`` / ``entropy`` the combined values).
    ``detached``: fp32 ``[len(statistics.detached), n]``, the call's detached statistics
    (:meth:`Statistics.detached_outputs <mcore_ppo.statistics.Statistics.detached_outputs>`:
    clamped to their ranges, 0 for ignored tokens; no gradient), None when there are none."""

    log_prob: torch.Tensor
    entropy: torch.Tensor | None
    saved: SavedTokens
    detached: torch.Tensor | None = None


@runtime_checkable
class Backend(Protocol):
    """Per-shard statistics and gradients of the fused head, stateless between calls; its
    settings are a frozen config given to its constructor."""

    name: str
    capabilities: Capabilities

    def unsupported(self, hidden: torch.Tensor) -> str | None:
        """Why this backend cannot run on these inputs (the head raises ValueError with it
        before any collective), or None when it can."""
        ...

    def fused_forward_for(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`head_forward` runs the one-label forward of these inputs (False
        whenever :attr:`Capabilities.fused_forward` is). Decided from shapes, dtypes and devices
        alone: the head's shape function calls it with fake tensors."""
        ...

    def residual_spec(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        *,
        fused: bool,
        grad_needed: bool,
        statistics: Statistics,
        row_temperature: bool,
    ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """``(shape, dtype)`` of each tensor of the residual the forward will return for these
        inputs (:meth:`head_forward` when ``fused``, else :meth:`shard_statistics`), from their
        shapes, dtypes and devices alone (the head's shape function calls it with fake tensors)."""
        ...

    def shard_statistics(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        grad_needed: bool,
        statistics: Statistics,
    ) -> ShardStatistics:
        """This shard's statistics: the terms of ``statistics``, in one pass. ``grad_needed``: a
        backward will follow, so a residual for it may be returned (a backend keeps none
        otherwise)."""
        ...

    def gather_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, local_ids: torch.Tensor, temperature: float | torch.Tensor
    ) -> torch.Tensor:
        """fp32 (fp64 for fp64 inputs) ``[n, k]``: ``hidden[t] · weight[local_ids[t, j]] / T_t``,
        0 where ``local_ids`` is -1 (another rank's id, or an ignored slot: such a row's hidden
        state is never read into a product)."""
        ...

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This shard's ``(d_hidden, d_weight)`` in fp32 (``d_hidden`` may come already rounded
        once to ``hidden``'s dtype, from fp32 accumulation, when that saves the backend a pass).

        ``d_hidden`` (None unless ``request.need_hidden_grad``) is this shard's partial sum: the
        caller reduces it over TP. ``d_weight`` is ``request.weight_grad`` accumulated into and
        returned (None when it is None). ``request.sparse`` one-hot terms are added to ``dz``
        before its products. A residual in ``saved`` is consumed (it may be overwritten in place).
        """
        ...

    def head_forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        ignore_index: int,
        vocab_start: int,
        vocab_size: int,
        labels_in_range: bool,
        grad_needed: bool,
        statistics: Statistics,
        max_entropy: float,
        combine: Callable | None,
    ) -> HeadForward:
        """Called only when :meth:`fused_forward_for` these inputs: the generic forward's results for
        global int64 ``labels [n]``: ``log_prob = min(y - lse, 0)``, NaN for a label outside
        ``[0, vocab_size)`` unless ``labels_in_range``; entropy clamped to ``[0, max_entropy]``;
        both 0 for ignored tokens. ``combine``: None when this shard is the whole vocab, else
        :func:`mcore_ppo.parallel.combine.reduce_shard_statistics` over the TP group as
        ``combine(shard_max, sums_relative_to) -> (global_max, summed)``: the backend passes its
        per-token max and a function that packs its label logits and sums (the packed layout of
        :mod:`mcore_ppo.statistics`) rescaled to the group's max, and forms the outputs from what
        comes back: the entropy when ``statistics.entropy``, and ``statistics.detached``."""
        ...
