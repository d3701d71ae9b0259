"""Reuse Megatron's process groups across ``initialize_model_parallel`` calls (tests, demo).

Megatron's ``initialize_model_parallel`` creates a few dozen process groups every call and
``destroy_model_parallel`` only forgets them. Under gloo each group keeps three threads
(two run loops and a TCP loop) for the life of the process, so a test session that switches
layouts per test ended up with ~1,100 threads per rank and a load average of several hundred on
a 2-core machine. With :func:`install_parallel_state_cache`, the first initialisation of a
layout (the same arguments) creates the groups as usual and records Megatron's module state;
later calls with the same arguments restore that state instead of creating new groups.

Only the :data:`LIVE_LAYOUTS` most recently used layouts keep their groups: an idle gloo group
is not free (its TCP loop thread wakes up every 10 ms; 86 idle groups cost each rank 12% of a
core, measured on 4 ranks), and creating a layout's groups again takes well under a second, so
the groups of the least recently used layout beyond those are destroyed.

Megatron's extra gloo copies of the data-parallel groups are not created (they are destroyed by
``destroy_model_parallel``, so they could not be reused); on a gloo world every group is gloo
anyway.
"""

from __future__ import annotations

import contextlib
import types
from collections import OrderedDict
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

#: Layouts (argument sets) whose groups stay alive; every rank evicts the same ones at the same call.
LIVE_LAYOUTS = 2

_real_initialize = parallel_state.initialize_model_parallel
_snapshots: OrderedDict[tuple, dict[str, Any]] = OrderedDict()


def _module_state() -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(parallel_state).items()
        if name.startswith("_")
        and not name.startswith("__")
        and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    }


def _groups(value: Any) -> list[dist.ProcessGroup]:
    """The process groups in a module-state value (a group, or groups in lists, tuples, dicts)."""
    if isinstance(value, dist.ProcessGroup):
        return [value]
    if isinstance(value, (list, tuple, set)):
        return [group for item in value for group in _groups(item)]
    if isinstance(value, dict):
        return [group for item in value.values() for group in _groups(item)]
    return []


def _destroy_groups(snapshot: dict[str, Any]) -> None:
    """Destroy the groups of an evicted layout that no cached layout still holds."""
    kept = {id(group) for state in _snapshots.values() for value in state.values() for group in _groups(value)}
    mine = {id(group): group for value in snapshot.values() for group in _groups(value)}
    for key, group in mine.items():
        if key in kept or group is dist.GroupMember.WORLD:
            continue
        with contextlib.suppress(ValueError):  # already gone: the whole world was destroyed since
            dist.destroy_process_group(group)


def _cached_initialize(*args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("create_gloo_process_groups", False)
    key = (args, tuple(sorted(kwargs.items(), key=lambda item: item[0])))
    if key in _snapshots:
        _snapshots.move_to_end(key)
        for name, value in _snapshots[key].items():
            setattr(parallel_state, name, value)
        return
    _real_initialize(*args, **kwargs)
    _snapshots[key] = _module_state()
    while len(_snapshots) > LIVE_LAYOUTS:
        _, evicted = _snapshots.popitem(last=False)
        _destroy_groups(evicted)


def install_parallel_state_cache() -> None:
    """Make ``parallel_state.initialize_model_parallel`` reuse groups per argument set."""
    parallel_state.initialize_model_parallel = _cached_initialize


def uninstall_parallel_state_cache() -> None:
    """Restore Megatron's own ``initialize_model_parallel`` (cached groups stay alive)."""
    parallel_state.initialize_model_parallel = _real_initialize
