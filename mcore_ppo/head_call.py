"""The one path from every entry point to the head's autograd Function: check, prepare, execute.

:func:`mcore_ppo.fused_log_probs_and_entropy` (one label or ``k`` ids per token), the
:class:`~mcore_ppo.head.VocabParallelFusedPPOHead` module, verl's
:func:`~mcore_ppo.integrations.verl.kernel.linear_cross_entropy` and the NeMo-RL adapter each call
:func:`run_head` with their :class:`~mcore_ppo.options.HeadOptions` and
:class:`~mcore_ppo.options.Layout`:

1. **check**: every argument, on every rank, without raising; then one verdict shared over the
   TP group (:mod:`mcore_ppo.verdict`), so a bad argument on one rank raises on all of them
   before any collective.
2. **prepare**: the TP mapping of ``hidden`` that carries the one reduction of ``d_hidden``
   (or none: the caller's, verl's contract), and every per-token value in token order
   (:mod:`mcore_ppo.tokens`).
3. **execute**: the head's op (:func:`mcore_ppo.ops.head`), then the outputs back in the labels' layout.

A call whose signature (what the checks see but the token counts and the values) was met
before, where the checks read no value and the verdict is not shared on every call, goes from
step 1's token counts straight to step 3 (:class:`mcore_ppo.execution.Prepared`; docs/design.md
§9). Steps 2 and 3 are :mod:`mcore_ppo.execution`'s.

A new framework adapter belongs beside those entry points and calls :func:`run_head` too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar

import torch

from mcore_ppo import execution, validation
from mcore_ppo.backends import Backend, resolve_backend
from mcore_ppo.execution import statistics_of
from mcore_ppo.options import HeadOptions, Layout, TokenOrder
from mcore_ppo.parallel.ranks import ProcessGroup, group_size
from mcore_ppo.shard import refuse_forward_ad
from mcore_ppo.tokens import to_rows
from mcore_ppo.verdict import (
    bad_values,
    label_error,
    share_verdict,
    shared_every_call,
    temperature_error,
    values_readable,
)

T = TypeVar("T")


class CheckedCall(NamedTuple):
    """A call whose arguments passed every check on every rank.

    ``labels`` are int64 in the caller's layout; ``ids``: they carry ``k`` ids per token (a
    trailing dim); ``temperature`` is the checked float, or the per-token values in token order
    (``[n]``, fp32 or fp64 for fp64 inputs, contiguous), where ``bad_temperature`` flags the
    values outside ``[MIN_TEMPERATURE, inf)`` (replaced by 1: with value checks on the verdict
    refused them, with checks off their tokens' outputs become NaN); None for a float."""

    labels: torch.Tensor
    ids: bool
    temperature: float | torch.Tensor
    temperature_values: torch.Tensor | None  # as the caller gave them, in token order (messages)
    bad_temperature: torch.Tensor | None
    backend: Backend | None
    tp_size: int
    vocab_size: int
    values_read: bool = False  # labels' and temperatures' values read and passed (validate on, where free)


def run_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    options: HeadOptions,
    *,
    tp_group: ProcessGroup | None,
    layout: Layout,
    ids: bool | None = None,
    prior_error: Exception | None = None,
    given_statistics: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token ``(log_probs, entropy)`` of ``softmax(hidden @ weight.T / T)`` over the TP-sharded vocab
    (``(log_probs, entropy, sum_pi_squared)`` with ``options.return_sum_pi_squared``).

    Args:
        hidden, weight, labels: as for :func:`mcore_ppo.fused_log_probs_and_entropy` in
            ``layout.tokens`` order (:class:`~mcore_ppo.options.TokenOrder`).
        temperature: a number, or a per-token floating-point tensor shaped like the labels'
            tokens or broadcastable to them (``[b, 1]``: one per sequence of ``[b, s]`` labels;
            in the flat order also any shape of ``N`` elements, in the labels' memory order).
            It covers the same tokens as ``labels`` (the whole gathered sequence under SP, this
            rank's CP part: split it like the labels, :func:`mcore_ppo.parallel.split_temperature_for_cp`)
            and gets no gradient.
        options: the caller's :class:`~mcore_ppo.options.HeadOptions`.
        tp_group: the TP group, already resolved (None: one rank).
        layout: token order, who reduces ``d_hidden`` (SP included) and where ``d_W`` goes.
        ids: None: labels with a trailing dim beyond the Megatron pairing are ``k`` ids per
            token; True: they must be (``fused_log_probs_at``); False: one label per token.
        prior_error: what the entry point's own checks of its arguments raised (see
            :func:`attempt`), shared with the other ranks like any other refusal; ``options``
            and ``layout`` are then its fallbacks.
        given_statistics: for ``k`` ids per token, the call's statistics of the same tempered
            logits, already computed and finished by another pass (the student's top-k,
            :func:`mcore_ppo.distill.topk.topk_and_statistics`): ``[1 + terms, n]``, each
            token's global ``log Σ_v exp(z_v)``, then the value of each statistic the options ask
            for (:meth:`Statistics.finished <mcore_ppo.statistics.Statistics.finished>`: the
            entropy, then Σπ²), in the rows' order, in the accumulation dtype. The head then
            skips its statistics pass and its backward recomputes the logits. None: the head
            computes them. Its values are not read back: a token whose ``lse`` is not finite
            gets NaN log-probs (never the 0 that ``log q ≤ 0``'s clamp would make of
            ``z − (−inf)``).

    Returns:
        fp32 ``(log_probs, entropy)``, identical on every TP rank, shaped like ``labels`` (``[N]``
        in the flat order; ``entropy`` per token with ``k`` ids); zero where labels equal
        ``options.ignore_index``. ``entropy`` is None when ``options.return_entropy`` is False.
        With ``options.return_sum_pi_squared`` a third output, ``sum_pi_squared``: per token
        (like ``entropy``) ``Σ_v softmax(z/T)_v²``, fp32, in ``[1/V, 1]``, 0 for ignored
        tokens, identical on every TP rank, detached (no gradient); NaN for a token whose
        temperature is bad when ``validate`` is off.
    """
    prepared = key = None
    if prior_error is None and given_statistics is None:
        key = execution.prepared_key(hidden, weight, labels, temperature, options, tp_group, layout, ids)
        prepared = execution.find(key)
    if prepared is not None and prepared.fits(hidden, weight, labels, layout):
        labels = labels if labels.dtype == torch.int64 else labels.long()
        return execution.run(prepared.execution, hidden, weight, labels, None, None, False, None)
    call = check_call(
        hidden, weight, labels, temperature, options, tp_group, layout, ids, prior_error=prior_error,
        given_statistics=given_statistics,
    )  # fmt: skip
    decided = execution.execution_of(call, hidden, weight, options, tp_group, layout, given_statistics)
    if key is not None and not shared_every_call(tp_group, every_call=options.validate):
        execution.keep(key, execution.Prepared(options, layout, call.tp_size, decided))
    return execution.run(
        decided, hidden, weight, call.labels, _row_temperature(call), call.bad_temperature, call.values_read,
        given_statistics,
    )  # fmt: skip


def _check_given_statistics(given_statistics: object, call: CheckedCall, options: HeadOptions, hidden: torch.Tensor):
    """``given_statistics`` fits the call (:func:`run_head`)."""
    if not call.ids:
        raise ValueError("given_statistics stands in for the statistics pass only for k ids per token")
    if not isinstance(given_statistics, torch.Tensor):
        raise TypeError(f"given_statistics must be a torch.Tensor, got {validation.type_name(given_statistics)}")
    tokens = call.labels[..., 0].numel()
    expected = torch.promote_types(hidden.dtype, torch.float32)
    if given_statistics.dtype != expected:
        raise TypeError(f"given_statistics must be {expected} (the accumulation dtype), got {given_statistics.dtype}")
    rows = 1 + len(statistics_of(options).optional)
    if given_statistics.shape != (rows, tokens) or given_statistics.device != hidden.device:
        raise ValueError(
            f"given_statistics must be [{rows}, {tokens}] on {hidden.device} (lse and each statistic the options ask "
            f"for, per token in the rows' order), got {list(given_statistics.shape)} on {given_statistics.device}"
        )


def attempt(build: Callable[[], T], fallback: T) -> tuple[T, Exception | None]:
    """``(build(), None)``, or ``(fallback, the error)`` when ``build`` raises TypeError or
    ValueError: an entry point's own argument checks (its options, its layout flags), whose
    verdict :func:`check_call` shares over the TP group as ``prior_error`` instead of raising on
    this rank alone while its peers wait in a collective."""
    try:
        return build(), None
    except (TypeError, ValueError) as err:
        return fallback, err


def share_refusal(
    tp_group: ProcessGroup | None,
    error: Exception | None,
    *,
    validate: bool,
    signature: Hashable,
    weight_rows: int = 0,
) -> None:
    """Share an entry point's own refusal (:func:`attempt`'s error) over the TP group on its own,
    for an entry point whose first collectives come before the head's verdict (the model's
    forward, :func:`mcore_ppo.gpt_log_probs_and_entropy`): raise on every rank if any rank's
    arguments failed, else return on every rank. ``validate`` and ``signature`` (what the
    entry point's checks saw): when the verdict is shared, as for the head's own
    (:func:`mcore_ppo.verdict.share_verdict`); ``weight_rows``: this rank's weight shard rows,
    checked equal as in :func:`check_call` (0 without a head)."""
    share_verdict(
        tp_group, weight_rows, error, None, _no_value_error, signature=None if error else signature, every_call=validate
    )


def _no_value_error(bad_label: int, bad_temperature: int) -> Exception:
    # Never called: no value flags travel with a refusal alone.
    return RuntimeError(f"no values were checked, yet flags {bad_label, bad_temperature} came back")


def check_call(
    hidden: object,
    weight: object,
    labels: object,
    temperature: object,
    options: HeadOptions,
    tp_group: object,
    layout: Layout,
    ids: bool | None,
    *,
    unsupported: Callable[[torch.Tensor], str | None] | None = None,
    prior_error: Exception | None = None,
    given_statistics: object = None,
) -> CheckedCall:
    """Every check of :func:`run_head`, its verdict shared over the TP group (module doc).

    ``unsupported``: for an entry point that runs something else than the head's backends
    (Liger, the teacher's top-k), the message of why it cannot run these inputs, or None; it may
    also raise TypeError or ValueError for its own arguments. It replaces the backend's own
    check (the call's ``backend`` is then None). ``prior_error``, ``given_statistics``: see
    :func:`run_head`. Dual tensors of forward-mode AD and ``torch.func`` transforms' tensors are
    refused here too (NotImplementedError, :data:`mcore_ppo.shard.NO_FORWARD_AD`)."""
    validation.check_process_group(tp_group)  # the verdict travels over it: not shareable
    call, local_error, values = None, prior_error, None
    if local_error is None:
        try:
            call = _checked_locally(hidden, weight, labels, temperature, options, tp_group, layout, ids, unsupported)
            if given_statistics is not None:
                _check_given_statistics(given_statistics, call, options, hidden)
            if options.validate and values_readable(call.labels):
                values = bad_values(call.labels, call.vocab_size, options.ignore_index, call.bad_temperature)
        except (TypeError, ValueError, NotImplementedError) as err:
            local_error = err

    def value_error(bad_label: int, bad_temperature: int) -> Exception:
        if bad_label:
            return label_error(call.labels, call.vocab_size, options.ignore_index)
        return temperature_error(call.temperature_values, call.bad_temperature)

    rows = weight.shape[0] if local_error is None else 0
    signature = None if local_error is not None else _signature(hidden, weight, call, options, layout)
    share_verdict(tp_group, rows, local_error, values, value_error, signature=signature, every_call=options.validate)
    return call._replace(values_read=values is not None)


def _signature(hidden: torch.Tensor, weight: torch.Tensor, call: CheckedCall, options: HeadOptions, layout: Layout):
    """What this rank's checks saw, but the token counts: a verdict shared once per group and
    signature (where sharing costs a host sync) covers every later call with the same one."""
    temperature = call.temperature.dtype if isinstance(call.temperature, torch.Tensor) else float
    return (
        hidden.dtype, hidden.dim(), hidden.shape[-1], hidden.device, weight.dtype, tuple(weight.shape),
        call.labels.dim(), call.labels.shape[-1] if call.ids else 0, temperature, options, layout,
    )  # fmt: skip


def _checked_locally(hidden, weight, labels, temperature, options, tp_group, layout, ids, unsupported) -> CheckedCall:
    """This rank's own checks, in the order their errors are most useful."""
    validation.check_tensors(hidden, weight, labels, options.effective_precision)
    refuse_forward_ad(hidden, weight)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a mcore_ppo.options.Layout, got {validation.type_name(layout)}")
    tp_size = group_size(tp_group)
    if layout.tokens is TokenOrder.FLAT:
        if layout.sequence_parallel:
            raise ValueError("the flat token order (verl's) has no sequence-parallel layout: its caller gathers")
        if ids:
            raise ValueError("the flat token order (verl's) takes one label per token")
        validation.check_flat_layout(hidden, weight, labels, tp_size)
        ids = False
    else:
        if ids is None:
            ids = labels.dim() == hidden.dim() and hidden.dim() in (2, 3)
        validation.check_layout(hidden, weight, labels, tp_size, layout.sequence_parallel, ids=ids)
    # int64 from here on: ignore_index and the vocab bounds are compared in it (no wrap-around).
    labels = labels if labels.dtype == torch.int64 else labels.long()
    token_labels = labels[..., 0] if ids else labels
    batch_first = layout.tokens is TokenOrder.MEGATRON and token_labels.dim() == 2
    bad_temperature = values = None
    if isinstance(temperature, torch.Tensor):
        expanded = validation.check_temperature_tensor(
            temperature, token_labels, flat_labels=layout.tokens is TokenOrder.FLAT
        )
        values = to_rows(expanded, batch_first)
        bad_temperature = validation.bad_temperatures(values)
        rows = values.to(torch.promote_types(hidden.dtype, torch.float32))
        temperature = torch.where(bad_temperature, torch.ones((), dtype=rows.dtype, device=rows.device), rows)
    else:
        temperature = validation.check_temperature(temperature)
    if unsupported is None:
        if isinstance(options.backend, str) and torch.compiler.is_compiling():
            # A name is resolved (and its backend checked) by the op's shape function, which
            # runs while the region is traced: resolving it here would build the backend inside
            # the trace, whose later calls the trace's guards would then see change.
            backend = None
        else:
            backend = resolve_backend(options.backend, hidden.device, options.named_precision)
            reason = backend.unsupported(hidden)
            if reason is not None:
                raise ValueError(f"backend={backend.name!r} cannot run these inputs: {reason}")
    else:
        backend, reason = None, unsupported(hidden)
        if reason is not None:
            raise ValueError(reason)
    return CheckedCall(labels, ids, temperature, values, bad_temperature, backend, tp_size, weight.shape[0] * tp_size)


def _row_temperature(call: CheckedCall) -> torch.Tensor | None:
    return call.temperature if isinstance(call.temperature, torch.Tensor) else None
