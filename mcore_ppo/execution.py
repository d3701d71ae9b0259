"""What a checked head call runs, and each call signature's decisions kept for its later calls.

:func:`mcore_ppo.head_call.run_head` checks a call, then runs it here: :func:`execution_of`
decides, from the call's signature alone, the op's arguments (:class:`~mcore_ppo.ops.HeadCall`)
and how the outputs go back into the labels' layout (:class:`Execution`); :func:`run` prepares
the tokens, runs the head's op and returns the outputs. A later call of the same signature (what
the checks see but the token counts and the values; :func:`prepared_key`) finds its
:class:`Prepared` and skips the checks but for its token counts (docs/design.md §9).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from mcore_ppo import validation
from mcore_ppo.backends import backend_key
from mcore_ppo.ops import HeadCall, head
from mcore_ppo.options import HeadOptions, HiddenGrad, Layout, TokenOrder
from mcore_ppo.parallel.ranks import ProcessGroup, group_key, group_rank
from mcore_ppo.shard import refuse_forward_ad
from mcore_ppo.statistics import Statistics
from mcore_ppo.tokens import from_rows, hidden_rows, to_rows
from mcore_ppo.verdict import values_readable

if TYPE_CHECKING:
    from mcore_ppo.head_call import CheckedCall


class Execution(NamedTuple):
    """What a checked call decides for the head's op from its signature alone (the dtypes,
    dims, the weight's shape, the options and the layout; never a token count or a value): the
    op's arguments, and how its outputs go back into the labels' layout."""

    head_call: HeadCall
    flat: bool  # verl's token order: labels in any shape, outputs flat
    ids: bool  # k ids per token (a trailing dim)
    one_id: bool  # k = 1: the head's own one-label path
    batch_first: bool  # [b, s] labels against [s, b, h] hidden
    upcast: torch.dtype | None  # a 16-bit hidden multiplied with an fp32 weight: rows cast to it
    sum_pi_squared: int | None  # the row of the op's detached statistics, when returned
    return_sum_pi_squared: bool


def execution_of(
    call: CheckedCall,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    options: HeadOptions,
    tp_group: ProcessGroup | None,
    layout: Layout,
    given_statistics: torch.Tensor | None = None,
) -> Execution:
    """The :class:`Execution` of a checked call (:class:`mcore_ppo.head_call.CheckedCall`)."""
    labels = call.labels
    flat = layout.tokens is TokenOrder.FLAT
    statistics = statistics_of(options)
    names = statistics.detached_names
    head_call = HeadCall(
        backend=backend_key(options.backend, hidden.device, options.named_precision),
        tp_group=group_key(tp_group),
        # At one rank nothing is reduced or gathered, whatever the layout.
        hidden_grad=layout.hidden_grad if call.tp_size > 1 else HiddenGrad.PARTIAL,
        weight_grad=layout.weight_grad,
        ignore_index=options.ignore_index,
        vocab_start=group_rank(tp_group) * weight.shape[0],
        vocab_size=call.vocab_size,
        temperature_value=1.0 if isinstance(call.temperature, torch.Tensor) else call.temperature,
        statistics=statistics,
        labels_in_range=call.values_read,
    )
    return Execution(
        head_call,
        flat,
        call.ids,
        call.ids and labels.shape[-1] == 1 and given_statistics is None,
        not flat and labels.dim() == 2 + call.ids,
        # A 16-bit hidden with an fp32 weight (a precision other than "auto"): its values are
        # exact in fp32, so one differentiable upcast before the op gives the kernels one dtype
        # and autograd rounds d_hidden back to the input's dtype once.
        weight.dtype if hidden.dtype != weight.dtype else None,
        names.index("sum_pi_squared") if "sum_pi_squared" in names else None,
        options.return_sum_pi_squared,
    )


def run(
    execution: Execution,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_temperature: torch.Tensor | None,
    bad_temperature: torch.Tensor | None,
    values_read: bool,
    given_statistics: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Prepare the tokens, run the head's op, return the outputs in the labels' layout.
    ``labels`` int64; ``row_temperature``, ``bad_temperature``: a checked call's per-token
    temperatures and their flags (None for a number); ``values_read``: the labels' and
    temperatures' values were read and passed."""
    head_call, batch_first = execution.head_call, execution.batch_first
    if execution.flat:
        rows = labels.reshape(-1)
    else:
        rows = to_rows(labels, batch_first, per_token_dims=int(execution.ids))
    if execution.one_id:
        rows = rows[:, 0]
    token_rows = hidden_rows(hidden)
    if execution.upcast is not None:
        token_rows = token_rows.to(execution.upcast)
    log_probs, entropy, detached = head(token_rows, weight, rows, row_temperature, given_statistics, head_call)
    index = execution.sum_pi_squared
    per_token = [entropy, None if index is None else detached[index]]
    if bad_temperature is not None and not values_read:
        # Not read back: a bad temperature poisons its token's outputs (never a plausible number).
        bad = bad_temperature
        log_probs = log_probs.masked_fill(bad[:, None] if log_probs.dim() == 2 else bad, math.nan)
        per_token = [None if value is None else value.masked_fill(bad, math.nan) for value in per_token]
    if execution.one_id:
        log_probs = log_probs[:, None]
    if batch_first:
        batch, seq = labels.shape[:2]
        log_probs = from_rows(log_probs, True, batch, seq)
        per_token = [None if value is None else from_rows(value, True, batch, seq) for value in per_token]
    entropy, sum_pi_squared = per_token
    if execution.return_sum_pi_squared:
        return log_probs, entropy, sum_pi_squared
    return log_probs, entropy


#: Prepared calls kept (a process meets a few signatures; a new one past the bound clears them).
PREPARED_CALLS = 256


class Prepared(NamedTuple):
    """A signature's :class:`Execution`, reused by a later call of the same signature
    (:func:`prepared_key`) without its checks, kept where a checked call of the signature
    would run no collective of its verdict (:func:`mcore_ppo.verdict.shared_every_call` false):
    with the ``options`` and ``layout`` objects it was made for (the key holds their ids; holding
    them keeps those ids from being reused) and its TP size, for the per-call check of the token
    counts (:meth:`fits`)."""

    options: HeadOptions
    layout: Layout
    tp_size: int
    execution: Execution

    def fits(self, hidden, weight, labels, layout: Layout) -> bool:
        """The call's token counts agree (the one check that depends on them,
        :func:`mcore_ppo.validation.check_layout`); False sends the call through the checks,
        which name what is wrong and share it over the TP group."""
        try:
            if self.execution.flat:
                validation.check_flat_layout(hidden, weight, labels, self.tp_size)
            else:
                validation.check_layout(
                    hidden, weight, labels, self.tp_size, layout.sequence_parallel, ids=self.execution.ids
                )
        except ValueError:
            return False
        return True


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def prepared_key(hidden, weight, labels, temperature, options, tp_group, layout, ids) -> tuple | None:
    """The key under which a call finds its :class:`Prepared` (its signature: what the checks
    see but the token counts and the values), or None for a call that always takes the checks:

    - a temperature tensor (its values are checked on every call);
    - values the checks read (``validate`` on CPU tensors, :func:`~mcore_ppo.verdict.values_readable`);
    - a traced region (``torch.compile`` keeps its own guards), forward-mode AD or a
      ``torch.func`` transform (refused by the checks: :func:`mcore_ppo.shard.refuse_forward_ad`);
    - a tensor subclass or another type, which may dispatch on its own.
    """
    if type(temperature) not in (float, int) or torch.compiler.is_compiling():
        return None
    if type(hidden) not in _PLAIN_TENSORS or type(weight) not in _PLAIN_TENSORS or type(labels) not in _PLAIN_TENSORS:
        return None
    if options.validate and values_readable(labels):
        return None
    try:
        refuse_forward_ad(hidden, weight)
    except NotImplementedError:
        return None
    token_dim = labels.shape[-1] if labels.dim() == hidden.dim() and labels.dim() else 0
    return (
        id(options), id(layout), tp_group, ids, temperature, type(hidden), hidden.dtype, hidden.dim(),
        hidden.shape[-1] if hidden.dim() else 0, hidden.device, type(weight), weight.dtype, weight.shape,
        weight.device, type(labels), labels.dtype, labels.dim(), token_dim, labels.device,
    )  # fmt: skip


# Signature key -> Prepared (a memo like the backends' plan caches: what it holds follows from
# the key; dropping it only costs the next call its checks).
_PREPARED: dict[tuple, Prepared] = {}


def find(key: tuple | None) -> Prepared | None:
    """The :class:`Prepared` kept under ``key`` (None: none, or no key)."""
    return None if key is None else _PREPARED.get(key)


def keep(key: tuple, prepared: Prepared) -> None:
    """Keep ``prepared`` under ``key`` (the table bounded at :data:`PREPARED_CALLS`)."""
    if len(_PREPARED) >= PREPARED_CALLS:
        _PREPARED.clear()
    _PREPARED[key] = prepared


def statistics_of(options: HeadOptions) -> Statistics:
    """What the statistics pass reduces for ``options`` (:mod:`mcore_ppo.statistics`)."""
    return _STATISTICS[options.return_entropy, options.return_sum_pi_squared]


#: What the statistics pass reduces, by the options ``(return_entropy, return_sum_pi_squared)``
#: (:mod:`mcore_ppo.statistics`): built once, read as constants under ``torch.compile``.
_STATISTICS = {
    (entropy, square): Statistics.named([*(["entropy"] if entropy else []), *(["sum_pi_squared"] if square else [])])
    for entropy in (False, True)
    for square in (False, True)
}
