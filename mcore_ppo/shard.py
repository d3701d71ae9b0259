"""One rank's head, forward and backward, over a backend: what the head's ops run (:mod:`mcore_ppo.ops`).

Forward (one rank, its vocab shard ``[vocab_start, vocab_start + v)``):
  0. under sequence parallelism, the rank's token rows are all-gathered first;
  1. local statistics from the backend: the shard max ``m``, the label logit ``y`` and the sums
     of the call's :class:`~mcore_ppo.statistics.Statistics` (``Σexp(z - m)``, the entropy's,
     any detached statistic's), fp32, nothing ``[n, v]`` kept unless the backend returns a
     residual for its backward (the triton buffer);
  2. the cross-rank combine (:meth:`Statistics.combine <mcore_ppo.statistics.Statistics.combine>`):
     MAX, then one SUM;
  3. ``log_prob = y - lse``, the entropy and the detached statistics
     (:meth:`Statistics.finish <mcore_ppo.statistics.Statistics.finish>`), zero for ignored tokens.
With one label per token a backend that runs the fused forward
(:meth:`~mcore_ppo.backends.base.Backend.fused_forward_for`, the triton one) runs steps 1–3
itself, the label preparation and step 3 in its kernels, with the same results. With ``k`` ids
per token (labels ``[n, k]``) the statistics are taken with no label in the shard, the ``k``
logits come from :meth:`Backend.gather_logits` (each rank its own ids, one all-reduce SUM, as
Megatron's vocab-parallel cross entropy does for one label), and ``log q_j = z_{id_j} - lse``.

Backward: the backend returns this rank's *partial* ``d_hidden`` and ``d_weight``; with ``k`` ids
it is asked for the dense part with the upstream ``G = Σ_j g_j`` of each token and adds the
one-hot parts ``g_j`` at ``id_j`` to its ``dz`` before its products
(:class:`~mcore_ppo.backends.base.SparseGradient`), so ``dz_i = Σ_j g_j 1[i = id_j] - q_i (G +
e (log q_i + H))`` comes out of the same GEMMs. The partial ``d_hidden`` is then summed over TP
exactly once, as the call's :class:`~mcore_ppo.options.HiddenGrad` says: all-reduced,
reduce-scattered back to the rank's sequence shard (SP), or left to the caller (verl's contract).

Both directions run with autocast off for the inputs' device (:func:`autocast_off`): inside a
``torch.autocast`` region the head computes exactly as outside it, in its inputs' dtype with
fp32 statistics. The backward is first-order only: with ``create_graph=True`` it raises
(:data:`NO_DOUBLE_BACKWARD`) rather than return a graph whose second derivatives would be wrong,
and there is no forward-mode derivative: the call's checks refuse dual tensors and ``torch.func``
transforms' tensors before any work (:data:`NO_FORWARD_AD`, :func:`refuse_forward_ad`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.autograd import forward_ad

from mcore_ppo.backends.base import Backend, GradientRequest, HeadForward, SavedTokens, SparseGradient
from mcore_ppo.numerics import accumulation_dtype, max_entropy
from mcore_ppo.options import HiddenGrad
from mcore_ppo.parallel.combine import reduce_shard_statistics
from mcore_ppo.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim
from mcore_ppo.parallel.ranks import ProcessGroup, group_size
from mcore_ppo.statistics import Statistics

NO_DOUBLE_BACKWARD = (
    "mcore_ppo's fused PPO head is differentiable once: backward(create_graph=True) through it "
    "(double backward: Hessian-vector products, gradgradcheck, torch.autograd.functional.hessian) is not "
    "supported, since its backward is not itself differentiable; take higher-order derivatives on a "
    "logits path (log_softmax of the full logits) instead"
)

NO_FORWARD_AD = (
    "mcore_ppo's fused PPO head has no forward-mode derivative: dual tensors of "
    "torch.autograd.forward_ad and the tensors of torch.func transforms (jvp, jacfwd, vmap, grad, ...) "
    "are not supported as its hidden or weight, since its kernels would drop their tangents; differentiate "
    "it in reverse mode (backward) or take forward-mode derivatives on a logits path (log_softmax of the "
    "full logits) instead"
)

_NOTHING_TO_DISABLE = contextlib.nullcontext()


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device``'s type: a no-op where it is not on (or does not exist,
    e.g. meta), which is most calls, and costs no context of its own there."""
    kind = device.type
    if _autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return _NOTHING_TO_DISABLE


@functools.cache
def _autocast_available(device_type: str) -> bool:
    # A property of the torch build and the device type (asked once each).
    return torch.amp.is_autocast_available(device_type)


def refuse_double_backward() -> None:
    """Raise inside a backward run with ``create_graph=True`` (autograd runs a backward with
    grad mode on exactly then)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(NO_DOUBLE_BACKWARD)


def refuse_forward_ad(*tensors: torch.Tensor) -> None:
    """Raise :data:`NO_FORWARD_AD` for a dual tensor (forward-mode AD) or a ``torch.func``
    transform's tensor among ``tensors``: no backend forms tangents, and one that skipped them
    would hand forward AD a zero derivative. Not while ``torch.compile`` traces: the check is
    C++ that dynamo cannot trace, and a compiled region's inputs are plain tensors."""
    if torch.compiler.is_compiling():
        return
    for tensor in tensors:
        if forward_ad.unpack_dual(tensor).tangent is not None or is_functorch_wrapped_tensor(tensor):
            raise NotImplementedError(NO_FORWARD_AD)


class ShardForward(NamedTuple):
    """The forward's outputs (:class:`~mcore_ppo.backends.base.HeadForward`) and the token rows
    it computed on: ``hidden`` itself, or under sequence parallelism the gathered rows (which
    the backward needs)."""

    result: HeadForward
    token_hidden: torch.Tensor


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    given_statistics: torch.Tensor | None,
    *,
    backend: Backend,
    tp_group: ProcessGroup | None,
    hidden_grad: HiddenGrad,
    ignore_index: int,
    vocab_start: int,
    vocab_size: int,
    statistics: Statistics,
    labels_in_range: bool,
    grad_needed: bool,
) -> ShardForward:
    """The head's forward on this rank (module doc).

    ``hidden [n, h]`` token rows (this rank's sequence shard under SP), ``weight [v, h]`` this
    rank's vocab shard, ``labels`` global int64 ids ``[n]`` (one per token) or ``[n, k]``;
    ``temperature`` a float or per-token ``[n]`` (fp32, fp64 for fp64 inputs); ``given_statistics``
    (``k`` ids only) each token's global ``lse`` over the same tempered logits from another pass,
    which then replaces the statistics pass. ``statistics``: what the pass reduces (the entropy
    when it is among them, and the detached statistics). ``labels_in_range``: every label is known to be in
    ``[0, vocab_size)`` or ``ignore_index``; False: a label outside gets a NaN log-prob.
    ``grad_needed``: a backward will follow (the backend may keep a residual for it)."""
    with autocast_off(hidden.device):
        if hidden_grad is HiddenGrad.SEQUENCE_PARALLEL:  # all_gather_first_dim is the identity at one rank
            hidden = all_gather_first_dim(hidden, tp_group)
        if labels.dim() == 2:
            result = _ids_forward(
                hidden, weight, labels, temperature, given_statistics, backend, tp_group, ignore_index, vocab_start,
                vocab_size, statistics, grad_needed,
            )  # fmt: skip
            return ShardForward(result, hidden)
        result = None
        if backend.fused_forward_for(hidden, weight):
            combine = None
            if group_size(tp_group) > 1:
                combine = functools.partial(reduce_shard_statistics, tp_group=tp_group)
            result = backend.head_forward(
                hidden,
                weight,
                labels,
                temperature,
                ignore_index=ignore_index,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
                labels_in_range=labels_in_range,
                grad_needed=grad_needed,
                statistics=statistics,
                max_entropy=max_entropy(vocab_size, torch.float32),
                combine=combine,
            )
        if result is None:
            result = _label_forward(
                hidden, weight, labels, temperature, backend, tp_group, ignore_index, vocab_start, vocab_size,
                statistics, labels_in_range, grad_needed,
            )  # fmt: skip
        return ShardForward(result, hidden)


def backward(
    grad_log_prob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    saved: SavedTokens,
    temperature: float | torch.Tensor,
    *,
    backend: Backend,
    tp_group: ProcessGroup | None,
    hidden_grad: HiddenGrad,
    need_hidden: bool,
    weight_grad: torch.Tensor | None,
    weight_grad_unset: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d_hidden, d_weight)`` of this rank: ``d_hidden`` in ``hidden``'s dtype, summed over TP
    as ``hidden_grad`` says (module doc; under SP this rank's rows of the gathered ``hidden``),
    ``d_weight`` accumulated into ``weight_grad`` (None: not wanted; ``weight_grad_unset``: an
    unfilled buffer every row of which the backend writes). ``hidden`` is the forward's token
    rows (:attr:`ShardForward.token_hidden`)."""
    with autocast_off(hidden.device):
        if saved.entropy is None:
            grad_entropy = None
        if (grad_log_prob is None and grad_entropy is None) or not (need_hidden or weight_grad is not None):
            return None, None
        sparse = None
        if saved.local_ids is not None and grad_log_prob is not None:
            # The slots' one-hot gradients, and the dense part's upstream Σ_j g_j per token.
            g = torch.where(saved.slot_ok, grad_log_prob.to(accumulation_dtype(hidden.dtype)), 0.0).contiguous()
            sparse = SparseGradient(saved.local_ids, g)
            grad_log_prob = g.sum(dim=1)
        request = GradientRequest(
            grad_log_prob, grad_entropy, need_hidden, weight_grad, sparse, weight_grad_unset=weight_grad_unset
        )
        d_hidden, d_weight = backend.shard_gradients(hidden, weight, saved, request, temperature=temperature)
        if d_hidden is not None:
            if d_hidden.dtype != hidden.dtype:
                d_hidden = d_hidden.to(hidden.dtype)
            d_hidden = _reduce_hidden_grad(d_hidden, tp_group, hidden_grad)
        return d_hidden, d_weight


def _reduce_hidden_grad(d_hidden: torch.Tensor, tp_group: ProcessGroup | None, hidden_grad: HiddenGrad):
    """The one TP sum of the partial ``d_hidden`` (module doc)."""
    if group_size(tp_group) == 1 or hidden_grad is HiddenGrad.PARTIAL:
        return d_hidden
    if hidden_grad is HiddenGrad.SEQUENCE_PARALLEL:
        return reduce_scatter_first_dim(d_hidden, tp_group)
    d_hidden = d_hidden.contiguous()
    dist.all_reduce(d_hidden, group=tp_group)
    return d_hidden


def _label_forward(
    hidden, weight, labels, temperature, backend, tp_group, ignore_index, vocab_start, vocab_size, statistics,
    labels_in_range, grad_needed,
) -> HeadForward:  # fmt: skip
    """One label per token over :meth:`Backend.shard_statistics`: labels prepared and outputs
    finished by torch ops (what ``head_forward`` fuses)."""
    valid = labels != ignore_index
    if labels_in_range and vocab_start == 0 and weight.shape[0] == vocab_size:
        # One shard holding the whole vocab and labels known to lie in it: every valid label
        # is its own local row (each small op costs tens of microseconds of host time).
        local_labels = torch.where(valid, labels, -1)
    else:
        local_labels = labels - vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(in_shard, local_labels, -1)
    lse, label_logit, entropy, detached, residual = _statistics_pass(
        backend, hidden, weight, local_labels, valid, temperature, tp_group, statistics, vocab_size, grad_needed
    )
    # Rounding can push log p a hair above 0; the math forbids it.
    log_prob = torch.where(valid, (label_logit - lse).clamp_(max=0.0), 0.0)
    if not labels_in_range:
        # A label outside [0, vocab_size) poisons its log-prob instead of returning a plausible number.
        log_prob = log_prob.masked_fill(valid & ((labels < 0) | (labels >= vocab_size)), torch.nan)
    entropy_out = _entropy_output(entropy, valid, vocab_size)
    saved = SavedTokens(local_labels, valid, lse, entropy, residual)
    return HeadForward(log_prob, entropy_out, saved, detached)


def _ids_forward(
    hidden, weight, ids, temperature, given_statistics, backend, tp_group, ignore_index, vocab_start, vocab_size,
    statistics, grad_needed,
) -> HeadForward:  # fmt: skip
    """``k`` ids per token: the statistics with no label in the shard (or the given
    ``given_statistics``, see :func:`forward`), and the ids' logits."""
    n = hidden.shape[0]
    in_range = (ids >= 0) & (ids < vocab_size)
    slot_ok = (ids != ignore_index) & in_range
    valid = slot_ok.any(dim=1)
    local = ids - vocab_start
    in_shard = slot_ok & (local >= 0) & (local < weight.shape[0])
    local_ids = torch.where(in_shard, local, -1)
    no_label = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    if given_statistics is None:
        lse, _, entropy, detached, residual = _statistics_pass(
            backend, hidden, weight, no_label, valid, temperature, tp_group, statistics, vocab_size, grad_needed
        )
    else:
        given_lse, values = statistics.from_finished(given_statistics)
        # z − (−inf) is +inf, which the clamp below would make a plausible 0: NaN instead.
        lse = torch.where(torch.isfinite(given_lse), given_lse, torch.nan)
        entropy = values.get("entropy")
        if entropy is not None:
            entropy = entropy.clone()  # kept for the backward: a fresh tensor, not a view of an input
        detached = statistics.detached_outputs(values, valid, vocab_size)
        residual = ()
    logits = backend.gather_logits(hidden, weight, local_ids, temperature)
    if group_size(tp_group) > 1:
        # Each id lives on one rank; the others add exact zeros.
        dist.all_reduce(logits, op=dist.ReduceOp.SUM, group=tp_group)
    log_q = torch.where(slot_ok, (logits - lse[:, None].to(logits.dtype)).clamp_(max=0.0), 0.0)
    # An id outside the vocab (possible only when validation was off) poisons its slot.
    log_q = log_q.masked_fill((ids != ignore_index) & ~in_range, torch.nan)
    entropy_out = _entropy_output(entropy, valid, vocab_size)
    saved = SavedTokens(no_label, valid, lse, entropy, residual, local_ids, slot_ok)
    return HeadForward(log_q, entropy_out, saved, detached)


def _statistics_pass(
    backend, hidden, weight, local_labels, valid, temperature, tp_group, statistics, vocab_size, grad_needed
) -> tuple:
    """``(lse, label_logit, entropy or None, detached or None, residual)``: the backend's
    statistics of this shard, combined over TP and finished (the generic forward's steps 1-3)."""
    stats = backend.shard_statistics(
        hidden, weight, local_labels, valid, temperature, grad_needed=grad_needed, statistics=statistics
    )
    global_max, sums, label_logit = statistics.combine(stats.m, stats.sums, stats.y, tp_group)
    lse, values = statistics.finish(global_max, sums)
    detached = statistics.detached_outputs(values, valid, vocab_size)
    return lse, label_logit, values.get("entropy"), detached, stats.residual


def _entropy_output(entropy: torch.Tensor | None, valid: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    if entropy is None:
        return None
    # Rounding can push H a hair below 0, or, for near-uniform logits, above log V.
    return torch.where(valid, entropy.clamp(min=0.0, max=max_entropy(vocab_size, entropy.dtype)), 0.0)


def weight_grad_buffer(weight: torch.Tensor, backend: Backend) -> tuple[torch.Tensor, bool]:
    """``(buffer, unset)``: where this shard's ``d_weight`` goes when it is returned to autograd,
    and whether it was left unfilled.

    For a backend that forms each row of ``d_W`` in one fp32-accumulated GEMM, a buffer in the
    weight's dtype (half the memory, no cast), left unfilled when the backend writes its rows.
    Else fp32 (or wider) zeros.
    """
    capabilities = backend.capabilities
    if capabilities.weight_grad_in_weight_dtype:
        if capabilities.writes_weight_grad:
            return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device), False
    return torch.zeros(weight.shape, dtype=accumulation_dtype(weight.dtype), device=weight.device), False
