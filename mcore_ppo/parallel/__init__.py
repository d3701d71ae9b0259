"""Communication layer of mcore_ppo: TP/CP groups, the statistics combine, the one
``d_hidden`` reduction, SP gather/scatter, and the CP label roll and split. Knows nothing
of PPO, and imports with torch alone: Megatron's ``parallel_state`` is consulted only inside
:func:`resolve_tp_group` / :func:`resolve_cp_group`, when ``torch.distributed`` is initialised
and Megatron's module is already loaded (never imported here)."""

from mcore_ppo.parallel.combine import combine_log_sum_exp, reduce_shard_statistics
from mcore_ppo.parallel.context_parallel import (
    roll_and_split_labels,
    roll_labels,
    sequence_bounds,
    split_for_cp,
    split_temperature_for_cp,
)
from mcore_ppo.parallel.groups import group_rank, group_size, resolve_cp_group, resolve_tp_group
from mcore_ppo.parallel.mappings import (
    all_gather_first_dim,
    reduce_scatter_first_dim,
)

__all__ = [
    "all_gather_first_dim",
    "combine_log_sum_exp",
    "group_rank",
    "group_size",
    "reduce_scatter_first_dim",
    "reduce_shard_statistics",
    "resolve_cp_group",
    "resolve_tp_group",
    "roll_and_split_labels",
    "roll_labels",
    "sequence_bounds",
    "split_for_cp",
    "split_temperature_for_cp",
]
