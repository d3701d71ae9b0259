"""One verdict on a call's inputs, the same on every TP rank, before the first collective.

A bad argument may reach one rank only (its own labels, a shape it computed itself). If that
rank raised alone, the others would wait in the head's first collective for a rank that has
left. So each rank runs its checks without raising, and one all-reduce (MAX) over the TP group
carries what they concluded: whether its arguments passed, its weight shard's size, and, with
value checks on, whether its labels or temperatures hold a bad value. Then every rank raises,
the failing one its own exception naming the argument, the others a ValueError that says a
peer refused its inputs; or every rank goes on.

The all-reduce and its read-back cost one host sync: every call pays it when the value checks
are on (they sync anyway) or the group runs on the CPU (gloo: the read is free). A call with
``validate=False`` on an accelerator reads nothing back (CUDA graphs, host-bound loops): there
the shard sizes are checked collectively on the first call per group and size, and a rank whose
own arguments fail raises alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_ppo import validation
from mcore_ppo.parallel.ranks import ProcessGroup, group_size

PEER_REFUSED = (
    "another rank of the tensor-parallel group rejected its inputs (its exception names the argument); "
    "this rank's inputs passed the checks"
)


def bad_values(
    labels: torch.Tensor, vocab_size: int, ignore_index: int, bad_temperature: torch.Tensor | None
) -> torch.Tensor:
    """int64 ``[2]`` on the labels' device, no host sync: whether any label lies outside
    ``[0, vocab_size)`` and is not ``ignore_index`` (int64 ``labels``: neither bound wraps), and
    whether ``bad_temperature`` (a mask, or None) flags any value."""
    bad_labels = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))).any()
    if bad_temperature is None:
        bad_temperature = torch.zeros((), dtype=torch.bool, device=labels.device)
    return torch.stack([bad_labels, bad_temperature.any()]).long()


def refuse_capture(device: torch.device) -> None:
    """Value checks read back to the host, which CUDA-graph capture forbids: say so, naming the fix."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "validate=True reads labels (and a temperature tensor) back to the host, which CUDA-graph "
            "capture forbids: pass validate=False to a head that is captured"
        )


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
    every_call: bool,
) -> None:
    """Raise on every rank if any rank's inputs failed (module doc); return on every rank otherwise.

    Args:
        tp_group: the TP group (None: one rank, nothing to share).
        weight_rows: this rank's weight shard rows (any value when ``local_error`` is set).
        local_error: this rank's own exception from its argument checks, or None.
        values: :func:`bad_values` of this rank (value checks on and its arguments passed), or None.
        value_error: builds this rank's exception from its two value flags (called only when
            one is set here).
        every_call: the call's value checks are on, so the verdict is shared on this call
            whatever the device (the ranks of a group must agree on it: it is the call's
            ``validate``); off, it is shared per call only on the CPU (module doc).
    """
    if group_size(tp_group) == 1:
        if local_error is not None:
            raise local_error
        if values is not None:
            bad_label, bad_temperature = values.tolist()
            if bad_label or bad_temperature:
                raise value_error(bad_label, bad_temperature)
        return
    device = _collective_device(tp_group)
    if not every_call and device.type != "cpu":
        if local_error is not None:
            raise local_error
        _check_shards_once(tp_group, weight_rows, device)
        return
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
    _check_equal(weight_rows, largest, -neg_smallest)
    if any_bad_label or any_bad_temperature:
        mine = values.tolist()
        if any(mine):
            raise value_error(*mine)
        raise ValueError(PEER_REFUSED)


def _check_equal(rows: int, largest: int, smallest: int) -> None:
    if largest != smallest:
        raise ValueError(
            f"weight shards must have the same number of rows on every tensor-parallel rank; "
            f"this rank has {rows}, the group has sizes from {smallest} to {largest}"
        )


def _collective_device(group: ProcessGroup) -> torch.device:
    """Where a small tensor for ``group``'s collectives lives: the current CUDA device for NCCL,
    else the CPU (the same rule on every rank, whatever device one rank's inputs are on)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Groups whose shard sizes were checked, with the sizes: keyed by the group object itself where
# it takes weak references (a new group never inherits an old one's entry, as it could through a
# reused id()), else by its ranks and name.
_CHECKED_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHECKED_SHARDS: set[tuple] = set()


def _check_shards_once(tp_group: ProcessGroup, rows: int, device: torch.device) -> None:
    """The shard-size check alone, once per group and size (no per-call host sync)."""
    try:
        seen, key = _CHECKED_GROUPS.setdefault(tp_group, set()), (rows,)
    except TypeError:  # no weak references to this group object
        seen = _CHECKED_SHARDS
        key = (tuple(dist.get_process_group_ranks(tp_group)), getattr(tp_group, "group_name", None), rows)
    if key in seen:
        return
    sizes = torch.tensor([rows, -rows], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=tp_group)
    largest, neg_smallest = sizes.tolist()
    _check_equal(rows, largest, -neg_smallest)
    seen.add(key)
