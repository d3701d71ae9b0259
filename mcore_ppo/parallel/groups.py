"""Process-group resolution for tensor and context parallelism.

Order of precedence, the same for TP and CP: an explicit group passed by the caller, else
Megatron's ``parallel_state`` when it has been initialised, else a single rank (``None``).
``None`` always means "one rank, no communication", so callers never special-case
``torch.distributed`` being absent. Megatron is never imported here: its groups are asked only
where its ``parallel_state`` module is already loaded (whoever initialised Megatron's groups
imported it), so a process with ``torch.distributed`` and without megatron-core (FSDP, a
trainer of its own) resolves one rank. The size and rank helpers
(:mod:`mcore_ppo.parallel.ranks`, re-exported here) need torch alone.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from mcore_ppo.parallel.ranks import ProcessGroup, group_from_key, group_key, group_rank, group_size

__all__ = [
    "ProcessGroup",
    "group_from_key",
    "group_key",
    "group_rank",
    "group_size",
    "resolve_cp_group",
    "resolve_tp_group",
]


_PARALLEL_STATE = "megatron.core.parallel_state"


def _megatron_parallel_state():
    """Megatron's ``parallel_state`` module if model parallelism has been initialised, else None
    (module doc: never imported here)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    if parallel_state is None:  # never loaded: Megatron's groups were not initialised in this process
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def resolve_tp_group(tp_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """The tensor-parallel group to use: ``tp_group``, Megatron's, or None for one rank."""
    if tp_group is not None:
        return tp_group
    state = _megatron_parallel_state()
    return state.get_tensor_model_parallel_group() if state is not None else None


def resolve_cp_group(cp_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """The context-parallel group to use: ``cp_group``, Megatron's, or None for one rank."""
    if cp_group is not None:
        return cp_group
    state = _megatron_parallel_state()
    return state.get_context_parallel_group() if state is not None else None
