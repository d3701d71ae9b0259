"""The head's one autograd Function, for one label per token and for ``k`` ids per token.

Forward (one rank, its vocab shard ``[vocab_start, vocab_start + v)``):
  1. local statistics ``(m, s, u, y)`` from the backend, fp32, nothing ``[n, v]`` kept unless
     the backend returns a residual for its backward (the triton buffer);
  2. the cross-rank combine (:func:`mcore_ppo.parallel.combine_shard_statistics`): MAX, then one SUM;
  3. ``log_prob = y - lse`` and ``entropy = H``, zero for ignored tokens.
With ``plan.return_sum_pi_squared`` the statistics carry ``q = Σ exp(2(z - m))`` too, packed into
the same SUM, and a third output ``Σπ² = Q / S²`` (clamped to ``[1/V, 1]``, zero for ignored
tokens) comes out of step 3; it is marked non-differentiable (verl uses it as a weight, not a
loss), so no gradient reaches it and none flows from it.
With one label per token, a backend whose :attr:`~mcore_ppo.backends.base.Capabilities.fused_forward`
is set (the triton one) runs the three steps itself, the label preparation and step 3 in its
kernels, with the same results. With ``k`` ids per token (labels ``[n, k]``) the statistics are
taken with no label in the shard, the ``k`` logits come from :meth:`Backend.gather_logits`
(each rank its own ids, one all-reduce SUM, as Megatron's vocab-parallel cross entropy does for
one label), and ``log q_j = z_{id_j} - lse``.
Saved for backward: the inputs and the fp32 per-token ``lse`` and ``entropy`` (no entropy when it
is off), the per-token temperature when there is one, the ``k`` ids when there are, and the
backend's residual (on ``ctx``, handed to the one backward that consumes it).

Backward: the backend returns this rank's *partial* ``d_hidden`` (fp32, cast once at the end)
and ``d_weight``; with ``k`` ids it is asked for the dense part with the upstream ``G = Σ_j g_j``
of each token and adds the one-hot parts ``g_j`` at ``id_j`` to its ``dz`` before its products
(:class:`~mcore_ppo.backends.base.SparseGradient`), so ``dz_i = Σ_j g_j 1[i = id_j] - q_i (G +
e (log q_i + H))`` comes out of the same GEMMs. The partial ``d_hidden`` is summed over TP by the
mapping that wraps ``hidden`` outside this Function (:mod:`mcore_ppo.parallel.mappings`), or by the caller
(verl's contract), so it is reduced exactly once, whatever the layout.

Both directions run with autocast off for the inputs' device (:func:`autocast_off`): inside a
``torch.autocast`` region the head computes exactly as outside it, in its inputs' dtype with
fp32 statistics. The backward is first-order only: with ``create_graph=True`` it raises
(:data:`NO_DOUBLE_BACKWARD`) rather than return a graph whose second derivatives would be wrong,
and it has no forward-mode derivative: the call's checks refuse dual tensors and ``torch.func``
transforms' tensors before any work (:data:`NO_FORWARD_AD`, :func:`refuse_forward_ad`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.autograd import forward_ad

from mcore_ppo.backends.base import Backend, GradientRequest, HeadForward, SavedTokens, SparseGradient
from mcore_ppo.numerics import accumulation_dtype, max_entropy
from mcore_ppo.options import WeightGrad
from mcore_ppo.parallel.combine import combine_shard_statistics
from mcore_ppo.parallel.ranks import ProcessGroup, group_size

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
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NOTHING_TO_DISABLE


def refuse_double_backward() -> None:
    """Raise inside a backward run with ``create_graph=True`` (autograd runs a backward with
    grad mode on exactly then)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(NO_DOUBLE_BACKWARD)


def refuse_forward_ad(*tensors: torch.Tensor) -> None:
    """Raise :data:`NO_FORWARD_AD` for a dual tensor (forward-mode AD) or a ``torch.func``
    transform's tensor among ``tensors``: no backend forms tangents, and one that skipped them
    would hand forward AD a zero derivative."""
    for tensor in tensors:
        if forward_ad.unpack_dual(tensor).tangent is not None or is_functorch_wrapped_tensor(tensor):
            raise NotImplementedError(NO_FORWARD_AD)


@dataclass(frozen=True)
class ShardPlan:
    """Everything one call of the Function needs besides its tensors.

    Attributes:
        backend: the per-shard backend (stateless: one may serve every call).
        temperature: python float > 0 (a per-token tensor, given to :func:`shard_head`, overrides it).
        ignore_index: label value of skipped tokens (or slots).
        vocab_start: the first global vocab id of this rank's shard.
        vocab_size: the global vocab size (every rank's shard together).
        tp_group: the group the statistics are combined over (None: one rank).
        weight_grad: where the weight gradient goes (autograd, or Megatron's ``main_grad``).
        return_entropy: False: no entropy work anywhere; the second output is None.
        return_sum_pi_squared: True: the third output is Σπ² per token (no gradient); False:
            None, and no work for it anywhere.
        labels_checked: every label is known to be in ``[0, vocab_size)`` or ``ignore_index``
            (the caller validated them); False: a label outside gets a NaN log-prob here.
    """

    backend: Backend
    temperature: float
    ignore_index: int
    vocab_start: int
    vocab_size: int
    tp_group: ProcessGroup | None = None
    weight_grad: WeightGrad = WeightGrad.GRAD
    return_entropy: bool = True
    labels_checked: bool = False
    return_sum_pi_squared: bool = False


def shard_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    temperature: torch.Tensor | None = None,
    log_normalizer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(log_prob, entropy [n] or None, sum_pi_squared [n] or None)``, fp32 (fp64 for fp64
    inputs with ``k`` ids), for ``hidden [n, h]``, this rank's ``weight [v, h]`` and global
    int64 ``labels``: ``[n]`` (one label per token; ``log_prob [n]``) or ``[n, k]`` (``k`` ids;
    ``log_prob [n, k]``).
    Differentiable once (this rank's partial ``d_hidden``). ``temperature``: per-token ``[n]``
    (fp32, fp64 for fp64 inputs, contiguous, validated), used instead of ``plan.temperature``;
    it gets no gradient. ``sum_pi_squared`` (with ``plan.return_sum_pi_squared``) is detached.
    ``log_normalizer``: with ``k`` ids only, the tokens' global ``lse`` already computed over the
    same tempered logits by another pass (the student's top-k in distillation): the statistics
    pass is skipped (no entropy, no Σπ²: the plan asks for neither) and the backward recomputes."""
    # Decided here, where grad mode is still visible: a backend keeps backward buffers only
    # when a backward can follow.
    grad_needed = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if temperature is not None:
        temperature = temperature.detach()
    if not grad_needed:
        # No graph to record: the forward alone, without the autograd Function's own host cost
        # (its outputs would carry no gradient either way).
        with autocast_off(hidden.device):
            log_prob, entropy, _, sum_pi_squared = _forward(
                hidden, weight, labels, plan, False, temperature, log_normalizer
            )
        return log_prob, entropy, sum_pi_squared
    return FusedPPOHeadFunction.apply(hidden, weight, labels, plan, grad_needed, temperature, log_normalizer)


def weight_grad_buffer(weight: torch.Tensor, plan: ShardPlan) -> tuple[torch.Tensor, bool]:
    """``(buffer, unset)``: where this shard's ``d_weight`` goes, and whether it was left unfilled.

    Megatron's ``main_grad`` when asked for and present. Else, for a backend that forms each row
    of ``d_W`` in one fp32-accumulated GEMM, a buffer in the weight's dtype (half the memory, no
    cast), left unfilled when the backend writes its rows. Else fp32 (or wider) zeros.
    """
    main_grad = getattr(weight, "main_grad", None) if plan.weight_grad is WeightGrad.MAIN_GRAD else None
    if main_grad is not None:
        return main_grad, False
    capabilities = plan.backend.capabilities
    if capabilities.weight_grad_in_weight_dtype:
        if capabilities.writes_weight_grad:
            return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device), False
    return torch.zeros(weight.shape, dtype=accumulation_dtype(weight.dtype), device=weight.device), False


def _combine(m, s, u, y, q=None, *, tp_group: ProcessGroup):
    return combine_shard_statistics(m, s, u, y, tp_group, q)


def _sum_pi_squared_flag(plan: ShardPlan) -> dict:
    """The backends' keyword for Σπ², given only when it is asked for (a backend built before
    the option existed keeps working without it)."""
    return {"with_sum_pi_squared": True} if plan.return_sum_pi_squared else {}


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    grad_needed: bool,
    row_temperature: torch.Tensor | None,
    log_normalizer: torch.Tensor | None = None,
) -> HeadForward:
    """The forward's outputs and what its backward needs (module doc)."""
    temperature = plan.temperature if row_temperature is None else row_temperature
    if labels.dim() == 2:
        return _ids_forward(hidden, weight, labels, plan, grad_needed, temperature, log_normalizer)
    if plan.backend.capabilities.fused_forward:
        combine = None
        if group_size(plan.tp_group) > 1:
            combine = functools.partial(_combine, tp_group=plan.tp_group)
        result = plan.backend.head_forward(
            hidden,
            weight,
            labels,
            temperature,
            ignore_index=plan.ignore_index,
            vocab_start=plan.vocab_start,
            vocab_size=plan.vocab_size,
            labels_checked=plan.labels_checked,
            grad_needed=grad_needed,
            with_entropy=plan.return_entropy,
            max_entropy=max_entropy(plan.vocab_size, torch.float32),
            combine=combine,
            **_sum_pi_squared_flag(plan),
        )
        if result is not None:
            return result
    return _label_forward(hidden, weight, labels, plan, grad_needed, temperature)


def _label_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    plan: ShardPlan,
    grad_needed: bool,
    temperature: float | torch.Tensor,
) -> HeadForward:
    """One label per token over :meth:`Backend.shard_statistics`: labels prepared and outputs
    finished by torch ops (what ``head_forward`` fuses)."""
    valid = labels != plan.ignore_index
    if plan.labels_checked and plan.vocab_start == 0 and weight.shape[0] == plan.vocab_size:
        # One shard holding the whole vocab and labels known to lie in it: every valid label
        # is its own local row (each small op costs tens of microseconds of host time).
        local_labels = torch.where(valid, labels, -1)
    else:
        local_labels = labels - plan.vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(in_shard, local_labels, -1)
    stats = plan.backend.shard_statistics(
        hidden, weight, local_labels, valid, temperature, grad_needed=grad_needed, with_entropy=plan.return_entropy,
        **_sum_pi_squared_flag(plan),
    )  # fmt: skip
    lse, entropy, label_logit, *square = combine_shard_statistics(*stats.tensors(), plan.tp_group, stats.q)
    # Rounding can push log p a hair above 0; the math forbids it.
    log_prob = torch.where(valid, (label_logit - lse).clamp_(max=0.0), 0.0)
    if not plan.labels_checked:
        # A label outside [0, vocab_size) that was not caught by validation (validate=False)
        # poisons its log-prob instead of returning a plausible number.
        log_prob = log_prob.masked_fill(valid & ((labels < 0) | (labels >= plan.vocab_size)), torch.nan)
    entropy_out = _entropy_output(entropy, valid, plan.vocab_size)
    saved = SavedTokens(local_labels, valid, lse, entropy, stats.residual)
    return HeadForward(log_prob, entropy_out, saved, sum_pi_squared_output(square, valid, plan.vocab_size))


def _ids_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    plan: ShardPlan,
    grad_needed: bool,
    temperature: float | torch.Tensor,
    log_normalizer: torch.Tensor | None,
) -> HeadForward:
    """``k`` ids per token: the statistics with no label in the shard (or the given
    ``log_normalizer``, see :func:`shard_head`), and the ids' logits."""
    n = hidden.shape[0]
    in_range = (ids >= 0) & (ids < plan.vocab_size)
    slot_ok = (ids != plan.ignore_index) & in_range
    valid = slot_ok.any(dim=1)
    local = ids - plan.vocab_start
    in_shard = slot_ok & (local >= 0) & (local < weight.shape[0])
    local_ids = torch.where(in_shard, local, -1)
    no_label = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    if log_normalizer is None:
        stats = plan.backend.shard_statistics(
            hidden, weight, no_label, valid, temperature, grad_needed=grad_needed, with_entropy=plan.return_entropy,
            **_sum_pi_squared_flag(plan),
        )  # fmt: skip
        lse, entropy, _, *square = combine_shard_statistics(*stats.tensors(), plan.tp_group, stats.q)
        residual = stats.residual
    else:
        # z − (−inf) is +inf, which the clamp below would make a plausible 0: NaN instead.
        lse = torch.where(torch.isfinite(log_normalizer), log_normalizer, torch.nan)
        entropy, square, residual = None, [], None
    logits = plan.backend.gather_logits(hidden, weight, local_ids, temperature)
    if group_size(plan.tp_group) > 1:
        # Each id lives on one rank; the others add exact zeros.
        dist.all_reduce(logits, op=dist.ReduceOp.SUM, group=plan.tp_group)
    log_q = torch.where(slot_ok, (logits - lse[:, None].to(logits.dtype)).clamp_(max=0.0), 0.0)
    # An id outside the vocab (possible only when validation was off) poisons its slot.
    log_q = log_q.masked_fill((ids != plan.ignore_index) & ~in_range, torch.nan)
    entropy_out = _entropy_output(entropy, valid, plan.vocab_size)
    saved = SavedTokens(no_label, valid, lse, entropy, residual, local_ids, slot_ok)
    return HeadForward(log_q, entropy_out, saved, sum_pi_squared_output(square, valid, plan.vocab_size))


def _entropy_output(entropy: torch.Tensor | None, valid: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    if entropy is None:
        return None
    # Rounding can push H a hair below 0, or, for near-uniform logits, above log V.
    return torch.where(valid, entropy.clamp(min=0.0, max=max_entropy(vocab_size, entropy.dtype)), 0.0)


def sum_pi_squared_output(square: list[torch.Tensor], valid: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Σπ² of the combine (``square``: ``[Q / S²]``, or empty when it was not asked for),
    clamped to ``[1/V, 1]`` (its exact range: rounding can push it a hair outside; NaN stays
    NaN) and 0 for ignored tokens."""
    if not square:
        return None
    return torch.where(valid, square[0].clamp(min=1.0 / vocab_size, max=1.0), 0.0)


class FusedPPOHeadFunction(torch.autograd.Function):
    """``(hidden [n,h], weight [v,h], labels [n] or [n, k], plan, grad_needed, temperature [n]
    or None, log_normalizer [n] or None) → (log_prob [n] or [n, k], entropy [n] or None,
    sum_pi_squared [n] or None)``; the third output is non-differentiable.

    ``labels`` are global vocab ids (or ``plan.ignore_index``); this rank owns rows
    ``[plan.vocab_start, plan.vocab_start + v)`` of the global vocab. Call it through
    :func:`shard_head`, which decides ``grad_needed``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, plan: ShardPlan, grad_needed: bool, temperature, log_normalizer):
        ctx.set_materialize_grads(False)
        ctx.device = hidden.device
        with autocast_off(hidden.device):
            log_prob, entropy_out, saved, sum_pi_squared = _forward(
                hidden, weight, labels, plan, grad_needed, temperature, log_normalizer
            )
        ctx.save_for_backward(
            hidden,
            weight,
            saved.local_labels,
            saved.valid,
            saved.lse,
            saved.entropy,
            temperature,
            saved.local_ids,
            saved.slot_ok,
        )
        ctx.plan = plan
        # Not a saved tensor: the one backward that uses it takes it (see backward).
        ctx.residual = saved.residual
        if sum_pi_squared is not None:
            ctx.mark_non_differentiable(sum_pi_squared)
        return log_prob, entropy_out, sum_pi_squared

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_sum_pi_squared=None):
        refuse_double_backward()
        with autocast_off(ctx.device):
            return FusedPPOHeadFunction._backward(ctx, grad_log_prob, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, local_labels, valid, lse, entropy, row_temperature, local_ids, slot_ok = ctx.saved_tensors
        plan: ShardPlan = ctx.plan
        # Taken, not read: the buffer is freed with this backward (a second one, with
        # retain_graph, recomputes), and the backend may overwrite it in place.
        residual, ctx.residual = ctx.residual, None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 5
        if entropy is None:
            grad_entropy = None
        if (grad_log_prob is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, *nones
        sparse = None
        if local_ids is not None and grad_log_prob is not None:
            # The slots' one-hot gradients, and the dense part's upstream Σ_j g_j per token.
            g = torch.where(slot_ok, grad_log_prob.to(accumulation_dtype(hidden.dtype)), 0.0).contiguous()
            sparse = SparseGradient(local_ids, g)
            grad_log_prob = g.sum(dim=1)
        weight_grad, unset = weight_grad_buffer(weight, plan) if need_weight else (None, False)
        d_hidden, d_weight = plan.backend.shard_gradients(
            hidden,
            weight,
            SavedTokens(local_labels, valid, lse, entropy, residual),
            GradientRequest(grad_log_prob, grad_entropy, need_hidden, weight_grad, sparse, weight_grad_unset=unset),
            temperature=plan.temperature if row_temperature is None else row_temperature,
        )
        if d_hidden is not None:
            d_hidden = d_hidden.to(hidden.dtype)
        if d_weight is not None:
            if plan.weight_grad is WeightGrad.MAIN_GRAD and hasattr(weight, "main_grad"):
                # Megatron's convention (ColumnParallelLinear with gradient accumulation
                # fusion): the gradient is already in main_grad; hand DDP's hook a dummy.
                weight.grad_added_to_main_grad = True
                d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            else:
                d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, *nones
