"""The student's log-probs at ``k`` given ids per token, with gradients, over the TP vocab shards.

Per token, with ``z = hidden @ W.T / T`` over the global vocab and ``q = softmax(z)``, and ``k``
global ids ``id_1..id_k`` (e.g. a teacher's top-k from :func:`mcore_ppo.fused_topk`):

    log q_j = z_{id_j} - lse          lse = log Σ_i exp(z_i)          H = -Σ_i q_i log q_i

without the ``[tokens, V]`` logits. Two parts, each over this rank's vocab shard:

- **dense**: the per-token softmax statistics and their gradient come from the head's own
  per-shard backend (torch / triton), called with *no* label in the shard (every token's local
  label ``-1``, as for a label owned by another rank), then combined over TP like the head's.
  Its backward, asked for the upstream ``G = Σ_j g_j`` of the token, is ``dz = -q·G`` (plus the
  entropy term with upstream ``e``), and no one-hot term.
- **sparse**: the ``k`` logits ``z_{id_j} = h·W[id_j]/T``: each rank gathers the ids of its
  own shard (the others are masked to 0) and one all-reduce SUM over TP gives every rank all
  ``k`` (Megatron's vocab-parallel cross entropy does the same for one label). On CUDA
  (fp16/bf16/fp32) the gather is a Triton kernel (``gather_dot_kernel`` of
  :mod:`mcore_ppo.kernels.gather`: a slot outside the shard costs no work);
  elsewhere (CPU, fp64) gathered rows and a batched GEMM in bounded token chunks.
  Backward: the one-hot parts ``g_j/T`` at ``id_j``. With the triton backend on its kernels
  they are *folded* into its ``dz``: the request carries this shard's ids (-1 outside) and
  ``g`` (:class:`~mcore_ppo.backends.base.SparseGradient`), the backend adds ``g_j/T`` at
  ``dz[t, id_j]`` (duplicates summed) after the kernel that writes ``dz`` and before its GEMMs,
  so ``d_hidden`` and ``d_W`` come out of the same ``dz @ W`` and ``dzᵀ @ x`` as the dense part
  (``dz`` is stored in the inputs' dtype: in bf16 the entry at an id is the stored dense value
  plus ``g_j/T`` in fp32, rounded to bf16 again; the head rounds its label entry once).
  Other backends (torch; the triton backend's fp64 and empty inputs) get no one-hot term from
  the backend; here ``d_hidden += Σ_j g_j W[id_j]/T`` (a batched GEMM over gathered rows) and
  ``d_W[id_j] += g_j h/T`` (``index_add_``) are added to their fp32 results before the one
  cast to the inputs' dtype. See :data:`GATHER_KERNELS`.

Together: ``dz_i = Σ_j g_j 1[i = id_j] - q_i·(G + e·(log q_i + H))``, the head's gradient with
``k`` labels. A duplicate id in a row gets the same log-prob in both slots and both gradients.

The head with one label per token (``labels`` without the trailing ``k`` dim) is not this
module: :func:`mcore_ppo.fused_log_probs_and_entropy` sends only ``[..., k]`` labels here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_ppo import validation
from mcore_ppo.backends import Backend, import_optional, resolve_backend
from mcore_ppo.backends.base import GradientRequest, SavedTokens, SparseGradient
from mcore_ppo.function import NO_DOUBLE_BACKWARD, autocast_off, weight_grad_buffer
from mcore_ppo.pipeline import call_options
from parallel.combine import combine_shard_statistics
from parallel.groups import resolve_tp_group
from parallel.mappings import gather_sequence_parallel, reduce_grad_over_tp
from parallel.ranks import ProcessGroup, group_rank, group_size

__all__ = ["GATHER_ELEMENTS", "GATHER_KERNELS", "fused_log_probs_at"]

#: Gathered weight rows held at once, in elements (``tokens × k × h``; 128 MiB of fp32, the
#: same again for ``d_W``'s rows in the backward): the torch path walks the tokens in chunks of
#: ``max(1, GATHER_ELEMENTS // (k·h))`` (146 at k = 64, h = 3584), few enough launches per call
#: to stay off the host's critical path. Read at each call.
GATHER_ELEMENTS = 1 << 25

#: The sparse part's implementation: ``"auto"`` (the forward's gather kernel for CUDA tensors of
#: fp16 / bf16 / fp32, the torch gather otherwise; the backward folded into the backend's ``dz``
#: where the backend's ``folds_sparse_gradient`` says it can, the torch path otherwise),
#: ``"triton"`` (as ``"auto"``, with the gather kernel for every fp16 / bf16 / fp32 input, CPU
#: tensors included under ``TRITON_INTERPRET=1``; fp64 stays on the torch path) or ``"torch"``
#: (the torch gather and the torch backward, no fold). Read at each call.
GATHER_KERNELS = "auto"

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (BLOCK_J, BLOCK_H, num_warps) of the forward's gather kernel: 16 in-shard slots × 256 columns
# per step compile to ~120 registers on sm_90 without spills (64 × 128 spilled).
_ROWS_CONFIG = (16, 256, 4)
# Slots per step of its scan over a token's ids (a power of two, at most this).
_SCAN_SLOTS = 64


def fused_log_probs_at(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    backend: str | Backend = "auto",
    return_entropy: bool = True,
    validate: bool | None = None,
    accumulate_into_main_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log q`` at ``k`` global ids, and the entropy, of ``softmax(hidden @ W.T / T)``.

    :func:`mcore_ppo.fused_log_probs_and_entropy` with labels ``[..., k]`` calls this; the
    arguments are the same, except ``labels``.

    Args:
        hidden: ``[s, b, h]`` (``[t, 1, h]`` packed THD) or ``[n, h]``; with
            ``sequence_parallel`` this rank's sequence shard (all-gathered here, ``d_hidden``
            reduce-scattered back).
        weight: this rank's vocab shard ``[V/tp, h]``, the same dtype as ``hidden``.
        labels: ``[b, s, k]`` for hidden ``[s, b, h]`` (``[1, t, k]`` packed), ``[n, k]`` for
            ``[n, h]``, ``k >= 1``: global ids in ``[0, V)``, or ``ignore_index`` for a slot to
            skip (all ``k`` slots ignored: the token is skipped). Any dtype of
            :data:`mcore_ppo.validation.LABEL_DTYPES`. Under CP, this rank's tokens (the ids
            are per token: pass them split like the tokens).
        temperature: a Python number, or a per-token tensor shaped like ``labels[..., 0]`` or
            broadcastable to it (``[b, 1]`` per sequence); no gradient.
        tp_group, sequence_parallel, ignore_index, backend, return_entropy, validate: as for
            :func:`mcore_ppo.fused_log_probs_and_entropy`. ``backend`` must be a per-shard one
            (``"auto"``, ``"torch"``, ``"triton"`` or such an object; ``"liger"`` computes
            whole outputs for one label and is refused). ``validate`` checks that every id is
            in ``[0, V)`` or ``ignore_index`` (ValueError naming ``labels``); without it a bad
            id gets a NaN log-prob in its slot.
        accumulate_into_main_grad: the weight gradient goes into ``weight.main_grad`` (fp32),
            as Megatron's gradient-accumulation fusion does (the head module passes its
            ``gradient_accumulation_fusion``); the returned gradient is then zeros.

    Returns:
        ``(log_probs, entropy)``: ``log_probs`` ``[..., k]`` shaped like ``labels`` (0 in an
        ignored slot), ``entropy`` per token ``[...]`` (0 for a token whose slots are all
        ignored; None with ``return_entropy=False``); fp32 (fp64 for fp64 inputs), identical
        on every TP rank. Gradients reach ``hidden`` (reduced over TP exactly once) and ``weight``.

    Raises:
        TypeError: as for the head (dtypes of ``hidden``, ``weight``, ``labels``, the options).
        ValueError: a layout that does not fit (naming ``labels``), ``k = 0``, an id outside the
            vocab (with ``validate``), a bad temperature, or a backend that computes whole outputs.
    """
    options, row_temperature = call_options(
        temperature, ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate
    )
    validation.check_tensors(hidden, weight, labels)
    for name, flag in (
        ("sequence_parallel", sequence_parallel),
        ("accumulate_into_main_grad", accumulate_into_main_grad),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {validation.type_name(flag)}")
    tp_group = resolve_tp_group(tp_group)
    validation.check_process_group(tp_group)
    tp_size = group_size(tp_group)
    layout_error = None
    try:
        _check_ids_layout(hidden, weight, labels, tp_size, sequence_parallel)
    except ValueError as err:
        layout_error = err
    validation.check_equal_shards(weight, tp_group, layout_error)
    vocab_size = weight.shape[0] * tp_size
    labels = labels.long()
    batch_first = hidden.dim() == 3
    ids = _token_rows(labels, batch_first)
    temps, bad_temperature = _row_temperature(row_temperature, labels, hidden.dtype, batch_first, vocab_size, options)

    # "liger" is refused by name before it is built (building it imports Liger).
    impl = None if options.backend == "liger" else resolve_backend(options.backend, hidden.device)
    if impl is None or getattr(impl, "computes_outputs", False):
        name = "liger" if impl is None else impl.name
        raise ValueError(
            f"backend={name!r} computes whole outputs for one label per token; labels with k ids need a "
            "per-shard backend ('auto', 'torch' or 'triton')"
        )
    if sequence_parallel and tp_size > 1:
        hidden = gather_sequence_parallel(hidden, tp_group)
    else:
        hidden = reduce_grad_over_tp(hidden, tp_group)
    tokens = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    plan = _Plan(
        backend=impl,
        temperature=options.temperature,
        ignore_index=options.ignore_index,
        vocab_start=group_rank(tp_group) * weight.shape[0],
        vocab_size=vocab_size,
        tp_group=tp_group,
        return_entropy=options.return_entropy,
        accumulate_into_main_grad=accumulate_into_main_grad,
    )
    grad_needed = torch.is_grad_enabled() and (tokens.requires_grad or weight.requires_grad)
    log_probs, entropy = _StudentFunction.apply(tokens, weight, ids, plan, grad_needed, temps)
    if bad_temperature is not None:
        log_probs = log_probs.masked_fill(bad_temperature[:, None], torch.nan)
        entropy = None if entropy is None else entropy.masked_fill(bad_temperature, torch.nan)
    if batch_first:
        seq, batch = hidden.shape[:2]
        log_probs = log_probs.view(seq, batch, -1).transpose(0, 1).contiguous()
        entropy = None if entropy is None else entropy.view(seq, batch).t().contiguous()
    return log_probs, entropy


def _check_ids_layout(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tp_size: int, sequence_parallel: bool
) -> None:
    """The head's layout with a trailing ``k >= 1`` dim on ``labels``."""
    if labels.dim() != hidden.dim() or labels.dim() not in (2, 3):
        raise ValueError(
            f"labels with k ids per token must be [b, s, k] for hidden [s, b, h] or [n, k] for hidden [n, h], "
            f"got labels {tuple(labels.shape)} with hidden {tuple(hidden.shape)}"
        )
    if labels.shape[-1] < 1:
        raise ValueError(f"labels must hold k >= 1 ids per token (last dim), got shape {tuple(labels.shape)}")
    try:
        validation.check_layout(hidden, weight, labels[..., 0], tp_size, sequence_parallel)
    except ValueError as err:
        raise ValueError(
            f"{err}; labels {tuple(labels.shape)} were read as k={labels.shape[-1]} ids per token ([..., k])"
        ) from None


def _token_rows(values: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``[b, s, ...]`` in the tokens' (sequence-major) order: ``[s·b, ...]``; ``[n, ...]`` as it is."""
    if batch_first:
        return values.transpose(0, 1).reshape(values.shape[0] * values.shape[1], *values.shape[2:])
    return values


def _row_temperature(
    temperature: torch.Tensor | None,
    labels: torch.Tensor,
    dtype: torch.dtype,
    batch_first: bool,
    vocab_size: int,
    options,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(T [n] or None, bad [n] or None)`` after the value checks, as the head does
    (:func:`mcore_ppo.pipeline.run_head`): with ``validate`` ids and temperatures in one check
    (one host sync on CUDA); without it bad temperatures become 1 and are flagged for NaN outputs."""
    if temperature is None:
        if options.validate:
            validation.check_label_range(labels, vocab_size, options.ignore_index)
        return None, None
    expanded = validation.check_temperature_tensor(temperature, labels[..., 0])
    values = _token_rows(expanded, batch_first).reshape(-1)
    bad = validation.bad_temperatures(values)
    if options.validate:
        validation.check_label_range(labels, vocab_size, options.ignore_index, bad_temperature=bad, temperature=values)
    rows = values.to(torch.promote_types(dtype, torch.float32)).contiguous()
    if options.validate:
        return rows, None
    return torch.where(bad, torch.ones((), dtype=rows.dtype, device=rows.device), rows), bad


@dataclass(frozen=True)
class _Plan:
    backend: Backend
    temperature: float
    ignore_index: int
    vocab_start: int
    vocab_size: int
    tp_group: ProcessGroup | None
    return_entropy: bool
    accumulate_into_main_grad: bool = False


@functools.lru_cache(maxsize=64)
def _max_entropy(vocab_size: int, dtype: torch.dtype) -> float:
    """``log V`` rounded down to ``dtype`` (so ``entropy <= log V`` holds exactly), on the host."""
    log_v = math.log(vocab_size)
    bound = torch.tensor(log_v, dtype=dtype)
    if bound.item() > log_v:
        bound = torch.nextafter(bound, torch.tensor(-math.inf, dtype=dtype))
    return bound.item()


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _token_chunk(k: int, h: int) -> int:
    return max(1, GATHER_ELEMENTS // max(1, k * h))


def _use_kernels(tokens: torch.Tensor) -> bool:
    if GATHER_KERNELS not in ("auto", "triton", "torch"):
        raise ValueError(f"GATHER_KERNELS must be 'auto', 'triton' or 'torch', got {GATHER_KERNELS!r}")
    if GATHER_KERNELS == "torch" or tokens.dtype not in _KERNEL_DTYPES:
        return False
    if GATHER_KERNELS == "triton":
        return True
    return tokens.is_cuda and import_optional("triton") is not None


def _folds_sparse(backend: Backend, tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """The backend adds the one-hot gradients to its own ``dz`` (the triton backend on its
    kernels): unless :data:`GATHER_KERNELS` is ``"torch"``."""
    if GATHER_KERNELS not in ("auto", "triton", "torch"):
        raise ValueError(f"GATHER_KERNELS must be 'auto', 'triton' or 'torch', got {GATHER_KERNELS!r}")
    folds = getattr(backend, "folds_sparse_gradient", None)
    return GATHER_KERNELS != "torch" and folds is not None and folds(tokens, weight)


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scan_block(k: int) -> int:
    return min(_SCAN_SLOTS, max(16, 1 << max(0, (k - 1).bit_length())))


def _gather_dot(tokens: torch.Tensor, weight: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """fp32 ``[n, k]``: ``tokens[t] · weight[sparse[t, j]]``, 0 where ``sparse`` is -1."""
    from mcore_ppo.kernels.gather import gather_dot_kernel

    n, h = tokens.shape
    k = sparse.shape[1]
    out = torch.empty(n, k, dtype=torch.float32, device=tokens.device)
    if n == 0:
        return out
    tokens, weight = _rowmajor(tokens), _rowmajor(weight)
    block_j, block_h, warps = _ROWS_CONFIG
    gather_dot_kernel[(n,)](
        tokens, weight, sparse, out, n, k, h, tokens.stride(0), weight.stride(0),
        BLOCK_J=block_j, BLOCK_H=block_h, BLOCK_K=_scan_block(k), num_warps=warps,
    )  # fmt: skip
    return out


def _add_sparse_torch(
    d_hidden: torch.Tensor | None,
    d_weight: torch.Tensor | None,
    tokens: torch.Tensor,
    weight: torch.Tensor,
    local: torch.Tensor,
    in_shard: torch.Tensor,
    valid: torch.Tensor,
    g: torch.Tensor,
    scale: float | torch.Tensor,
) -> None:
    """The torch path of the sparse backward: gathered rows in token chunks, a batched GEMM into
    ``d_hidden`` and ``index_add_`` into ``d_weight`` (either may be None: nothing to do)."""
    if d_hidden is None and d_weight is None:
        return
    n, h = tokens.shape
    k = local.shape[1]
    acc = torch.promote_types(tokens.dtype, torch.float32)
    # Ignored tokens' hidden states may be anything (inf padding): never let them into a product.
    x_all = torch.where(valid[:, None], tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))
    g_local = torch.where(in_shard, g, 0.0)
    for t0, t1 in _chunks(n, _token_chunk(k, h)):
        g_c = _scaled(g_local[t0:t1], scale, t0, t1)  # [c, k]
        if d_hidden is not None:
            rows = weight[local[t0:t1]].to(acc)  # [c, k, h]; .to is free for fp32 / fp64 weights
            d_hidden[t0:t1] += torch.bmm(g_c[:, None, :], rows).squeeze(1)
        if d_weight is not None:
            x_c = x_all[t0:t1].to(acc)
            d_weight.index_add_(
                0,
                local[t0:t1].reshape(-1),
                (g_c[:, :, None] * x_c[:, None, :]).reshape(-1, h).to(d_weight.dtype),
            )


def _scaled(values: torch.Tensor, temperature: float | torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """``values [c, ...]`` of tokens ``[t0, t1)`` divided by their temperature."""
    if isinstance(temperature, torch.Tensor):
        rows = temperature[t0:t1]
        return values / rows.view(-1, *([1] * (values.dim() - 1)))
    return values / temperature


class _StudentFunction(torch.autograd.Function):
    """``(tokens [n, h], weight [v, h], ids [n, k] global int64, plan, grad_needed, T [n] or None)
    → (log_q [n, k], entropy [n] or None)``; ``tokens`` already wrapped in the TP mapping."""

    @staticmethod
    def forward(ctx, tokens, weight, ids, plan: _Plan, grad_needed: bool, temperature):
        ctx.set_materialize_grads(False)
        ctx.device = tokens.device
        with autocast_off(tokens.device):
            return _StudentFunction._forward(ctx, tokens, weight, ids, plan, grad_needed, temperature)

    @staticmethod
    def _forward(ctx, tokens, weight, ids, plan: _Plan, grad_needed: bool, temperature):
        n, h = tokens.shape
        v, k = weight.shape[0], ids.shape[1]
        acc = torch.promote_types(tokens.dtype, torch.float32)
        in_range = (ids >= 0) & (ids < plan.vocab_size)
        slot_ok = (ids != plan.ignore_index) & in_range
        valid = slot_ok.any(dim=1)
        local = ids - plan.vocab_start
        in_shard = slot_ok & (local >= 0) & (local < v)
        local = torch.where(in_shard, local, 0)
        scale = plan.temperature if temperature is None else temperature

        no_label = torch.full((n,), -1, dtype=torch.int64, device=tokens.device)
        entropy_off = {} if plan.return_entropy else {"with_entropy": False}
        stats = plan.backend.shard_statistics(
            tokens, weight, no_label, valid, scale, grad_needed=grad_needed, **entropy_off
        )
        m, s, u, y = stats.tensors()
        lse, entropy, _ = combine_shard_statistics(m, s, u if plan.return_entropy else None, y, plan.tp_group)

        if _use_kernels(tokens):
            # Ignored tokens have no slot in the shard: the kernel never multiplies their rows.
            z = _gather_dot(tokens, weight, torch.where(in_shard, local, -1))
            logits = torch.where(in_shard, _scaled(z, scale, 0, n), 0.0)
        else:
            logits = torch.zeros(n, k, dtype=acc, device=tokens.device)
            # Ignored tokens' hidden states may be anything (inf padding): never let them into a product.
            x_all = torch.where(valid[:, None], tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))
            for t0, t1 in _chunks(n, _token_chunk(k, h)):
                rows = weight[local[t0:t1]].to(acc)  # [c, k, h]; .to is free for fp32 / fp64 weights
                z = torch.bmm(rows, x_all[t0:t1].to(acc)[:, :, None]).squeeze(-1)
                logits[t0:t1] = torch.where(in_shard[t0:t1], _scaled(z, scale, t0, t1), 0.0)
        if group_size(plan.tp_group) > 1:
            # Each id lives on one rank; the others add exact zeros.
            dist.all_reduce(logits, op=dist.ReduceOp.SUM, group=plan.tp_group)

        # Rounding can push log q a hair above 0; the math forbids it.
        log_q = torch.where(slot_ok, (logits - lse[:, None]).clamp_(max=0.0), 0.0)
        # An id outside the vocab (possible only when validation was off) poisons its slot.
        log_q = log_q.masked_fill((ids != plan.ignore_index) & ~in_range, torch.nan)
        if entropy is None:
            entropy_out = None
        else:
            max_entropy = _max_entropy(plan.vocab_size, entropy.dtype)
            entropy_out = torch.where(valid, entropy.clamp(min=0.0, max=max_entropy), 0.0)
        ctx.save_for_backward(tokens, weight, local, in_shard, slot_ok, valid, lse, entropy, temperature)
        ctx.plan = plan
        ctx.residual = stats.residual
        return log_q, entropy_out

    @staticmethod
    def backward(ctx, grad_log_q, grad_entropy):
        if torch.is_grad_enabled():
            raise NotImplementedError(NO_DOUBLE_BACKWARD)
        with autocast_off(ctx.device):
            return _StudentFunction._backward(ctx, grad_log_q, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_log_q, grad_entropy):
        tokens, weight, local, in_shard, slot_ok, valid, lse, entropy, temperature = ctx.saved_tensors
        plan: _Plan = ctx.plan
        residual, ctx.residual = ctx.residual, None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 4
        if entropy is None:
            grad_entropy = None
        if (grad_log_q is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, *nones
        n = tokens.shape[0]
        acc = torch.promote_types(tokens.dtype, torch.float32)
        scale = plan.temperature if temperature is None else temperature
        g = None
        total = None
        if grad_log_q is not None:
            g = torch.where(slot_ok, grad_log_q.to(acc), 0.0)
            total = g.sum(dim=1)
        main_grad = getattr(weight, "main_grad", None) if plan.accumulate_into_main_grad else None
        fold = g is not None and _folds_sparse(plan.backend, tokens, weight)
        weight_grad, unset = None, False
        if need_weight:
            # Folded, every row of d_W comes out of the backend's own GEMMs (one rounding, as
            # the head); unfolded, the one-hot terms are added here afterwards.
            weight_grad, unset = weight_grad_buffer(
                weight, plan.accumulate_into_main_grad, plan.backend, backend_writes_rows=fold
            )
        no_label = torch.full((n,), -1, dtype=torch.int64, device=tokens.device)
        sparse = None
        if fold:
            sparse = SparseGradient(torch.where(in_shard, local, -1), g.float().contiguous())
        d_hidden, d_weight = plan.backend.shard_gradients(
            tokens,
            weight,
            SavedTokens(no_label, valid, lse, entropy, residual),
            GradientRequest(total, grad_entropy, need_hidden, weight_grad, sparse, weight_grad_unset=unset),
            temperature=scale,
        )
        if g is not None and not fold:
            if d_hidden is not None:
                d_hidden = d_hidden.to(acc)
            _add_sparse_torch(d_hidden, d_weight, tokens, weight, local, in_shard, valid, g, scale)
        if d_hidden is not None:
            d_hidden = d_hidden.to(tokens.dtype)
        if d_weight is not None and main_grad is not None:
            # Megatron's convention (as the head's Function): the gradient is in main_grad already;
            # DDP's hook gets a zero tensor.
            weight.grad_added_to_main_grad = True
            d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        elif d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, *nones
