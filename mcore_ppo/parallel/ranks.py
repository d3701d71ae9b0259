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
