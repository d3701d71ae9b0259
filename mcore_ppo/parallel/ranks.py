"""Size and rank of a process group, with None meaning one rank: torch.distributed only.

The head's core (the autograd Function, the backends, the combine and the TP mappings) takes
a group that is already resolved and needs nothing else; which group to use by default
(Megatron's ``parallel_state``) is decided by :mod:`mcore_ppo.parallel.groups`, at the entry points.
"""

from __future__ import annotations

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def group_key(group: ProcessGroup | None) -> str:
    """The string an op names ``group`` by (ops take no Python objects): the group's own
    ``group_name``, which torch.distributed registers every group under; "" for one rank."""
    return "" if group is None else group.group_name


def group_from_key(key: str) -> ProcessGroup | None:
    """The group :func:`group_key` named, from torch.distributed's registry of groups by name
    (the one its functional collectives resolve names in); None for ""."""
    if not key:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(key)
