"""Reuse Megatron's process groups across ``initialize_model_parallel`` calls (tests, demo).

Megatron's ``initialize_model_parallel`` creates a few dozen process groups every call and
``destroy_model_parallel`` only forgets them. Under gloo each group keeps three threads
(two run loops and a TCP loop) for the life of the process, so a test session that switches
layouts per test ended up with ~1,100 threads per rank and a load average of several hundred on
a 2-core machine. With :func:`install_parallel_state_cache`, the first initialisation of a
layout (the same arguments) creates the groups as usual and records Megatron's module state;
later calls with the same arguments restore that state instead of creating new groups.

Megatron's extra gloo copies of the data-parallel groups are not created (they are destroyed by
``destroy_model_parallel``, so they could not be reused); on a gloo world every group is gloo
anyway.
"""

from __future__ import annotations

import types
from typing import Any

from megatron.core import parallel_state

_real_initialize = parallel_state.initialize_model_parallel
_snapshots: dict[tuple, dict[str, Any]] = {}


def _module_state() -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(parallel_state).items()
        if name.startswith("_")
        and not name.startswith("__")
        and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    }


def _cached_initialize(*args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("create_gloo_process_groups", False)
    key = (args, tuple(sorted(kwargs.items(), key=lambda item: item[0])))
    if key in _snapshots:
        for name, value in _snapshots[key].items():
            setattr(parallel_state, name, value)
        return
    _real_initialize(*args, **kwargs)
    _snapshots[key] = _module_state()


def install_parallel_state_cache() -> None:
    """Make ``parallel_state.initialize_model_parallel`` reuse groups per argument set."""
    parallel_state.initialize_model_parallel = _cached_initialize


def uninstall_parallel_state_cache() -> None:
    """Restore Megatron's own ``initialize_model_parallel`` (cached groups stay alive)."""
    parallel_state.initialize_model_parallel = _real_initialize
