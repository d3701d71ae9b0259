"""One verdict on a call's inputs, the same on every TP rank, before the first collective.

A bad argument may reach one rank only (its own labels, a shape it computed itself). If that
rank raised alone, the others would wait in the head's first collective for a rank that has
left. So each rank runs its checks without raising, and one all-reduce (MAX) over the TP group
carries what they concluded: whether its arguments passed, its weight shard's size, and, where
its labels and temperatures were read, whether they hold a bad value. Then every rank raises,
the failing one its own exception naming the argument, the others a ValueError that says a
peer refused its inputs; or every rank goes on.

No check makes the host wait for the device (docs/design.md §5). Tensor values are read only
where reading costs no device sync (:func:`values_readable`: CPU tensors, outside a compiled
region); elsewhere a bad label or temperature gives its token NaN outputs on every rank. The
verdict itself is shared on every call where its all-reduce runs on the CPU (a gloo group); over
an accelerator's group (NCCL), whose read-back would be a host sync, it is shared on the first
call of each group and call signature (what the checks saw, but the token counts), so a loop
with steady shapes pays one sync in all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from mcore_ppo import validation
from mcore_ppo.parallel.ranks import ProcessGroup, group_size

PEER_REFUSED = (
    "another rank of the tensor-parallel group rejected its inputs (its exception names the argument); "
    "this rank's inputs passed the checks"
)


def values_readable(tensor: torch.Tensor) -> bool:
    """Reading ``tensor``'s values costs no device sync: a CPU tensor, in eager mode (a compiled
    region must not read data-dependent values)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def bad_values(
    labels: torch.Tensor, vocab_size: int, ignore_index: int, bad_temperature: torch.Tensor | None
) -> torch.Tensor:
    """int64 ``[2]`` on the labels' device: whether any label lies outside ``[0, vocab_size)``
    and is not ``ignore_index`` (int64 ``labels``: neither bound wraps), and whether
    ``bad_temperature`` (a mask, or None) flags any value."""
    bad_labels = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))).any()
    if bad_temperature is None:
        bad_temperature = torch.zeros((), dtype=torch.bool, device=labels.device)
    return torch.stack([bad_labels, bad_temperature.any()]).long()


def label_error(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> ValueError:
    """The ValueError for labels :func:`bad_values` flagged, with the first bad one."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    first = labels[bad].flatten()[0].item()
    return ValueError(
        f"labels must be in [0, {vocab_size}) (the global vocab) or ignore_index={ignore_index}; "
        f"found {first} ({int(bad.sum())} bad labels)"
    )


def temperature_error(temperature: torch.Tensor, bad_temperature: torch.Tensor) -> ValueError:
    """The ValueError for temperature values :func:`bad_values` flagged, with the first bad one."""
    first = temperature[bad_temperature].flatten()[0].item()
    return ValueError(
        f"temperature values must be finite and >= {validation.MIN_TEMPERATURE:g} (MIN_TEMPERATURE), got {first} "
        f"({int(bad_temperature.sum())} bad values)"
    )


def share_verdict(
    tp_group: ProcessGroup | None,
    weight_rows: int,
    local_error: Exception | None,
    values: torch.Tensor | None,
    value_error: Callable[[int, int], Exception],
    *,
    signature: Hashable | None,
    every_call: bool = True,
) -> None:
    """Raise on every rank if any rank's inputs failed (module doc); return on every rank otherwise.

    Args:
        tp_group: the TP group (None: one rank, nothing to share).
        weight_rows: this rank's weight shard rows (any value when ``local_error`` is set).
        local_error: this rank's own exception from its argument checks, or None.
        values: :func:`bad_values` of this rank (its values were read), or None.
        value_error: builds this rank's exception from its two value flags (called only when
            one is set here).
        signature: what this rank's checks saw but the token counts (None when they failed):
            over an accelerator's group the verdict is shared once per group and signature.
        every_call: False (the call's ``validate`` off): not even a CPU group shares it per call.
    """
    if group_size(tp_group) == 1:
        if local_error is not None:
            raise local_error
        if values is not None:
            _raise_for_values(values.tolist(), value_error)
        return
    device = _collective_device(tp_group)
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        # A compiled region is traced once per guarded signature (the trace is that signature's
        # verdict) and a captured graph cannot read back: this rank's own refusal only.
        if local_error is not None:
            raise local_error
        return
    if not _per_call(device, every_call):
        seen = _shared_signatures(tp_group)
        if local_error is None and signature in seen:
            return
        _share(tp_group, weight_rows, local_error, None, value_error, device)
        seen.add(signature)
        return
    _share(tp_group, weight_rows, local_error, values, value_error, device)


def shared_every_call(tp_group: ProcessGroup | None, *, every_call: bool) -> bool:
    """Whether :func:`share_verdict` shares the verdict over ``tp_group`` on every call (a CPU
    group, ``every_call`` on), rather than once per call signature (or never: one rank)."""
    return group_size(tp_group) > 1 and _per_call(_collective_device(tp_group), every_call)


def _per_call(device: torch.device, every_call: bool) -> bool:
    # Over the CPU the all-reduce costs no device sync, so it carries each call's value flags.
    return every_call and device.type == "cpu"


def _share(tp_group, weight_rows, local_error, values, value_error, device) -> None:
    """The verdict's all-reduce and what every rank concludes from it."""
    failed = local_error is not None
    rows = 0 if failed else weight_rows
    flags = torch.tensor([int(failed), rows, -rows, 0, 0], dtype=torch.int64, device=device)
    if values is not None and not failed:
        flags[3:] = values.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=tp_group)
    any_failed, largest, neg_smallest, any_bad_label, any_bad_temperature = flags.tolist()
    if local_error is not None:
        raise local_error
    if any_failed:
        raise ValueError(PEER_REFUSED)
    if largest != -neg_smallest:
        raise ValueError(
            f"weight shards must have the same number of rows on every tensor-parallel rank; "
            f"this rank has {weight_rows}, the group has sizes from {-neg_smallest} to {largest}"
        )
    if any_bad_label or any_bad_temperature:
        mine = [0, 0] if values is None else values.tolist()
        _raise_for_values(mine, value_error)
        raise ValueError(PEER_REFUSED)


def _raise_for_values(flags: list[int], value_error: Callable[[int, int], Exception]) -> None:
    if any(flags):
        raise value_error(*flags)


def _collective_device(group: ProcessGroup) -> torch.device:
    """Where a small tensor for ``group``'s collectives lives: the current CUDA device for NCCL,
    else the CPU (the same rule on every rank, whatever device one rank's inputs are on)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The signatures whose verdict a group has shared (over an accelerator: once each), keyed by
# the group object itself: a new group never inherits an old one's entry.
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_SHARED_BY_NAME: dict[tuple, set] = {}


def _shared_signatures(tp_group: ProcessGroup) -> set:
    try:
        return _SHARED.setdefault(tp_group, set())
    except TypeError:  # a group object without weak references: keyed by its ranks and name
        key = (tuple(dist.get_process_group_ranks(tp_group)), getattr(tp_group, "group_name", None))
        return _SHARED_BY_NAME.setdefault(key, set())
