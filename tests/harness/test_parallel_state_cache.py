"""The multi-rank suite's reuse of Megatron's process groups (mcore_ppo_testing.parallel_state_cache),
on a one-rank gloo world: a layout met again gets its groups back, and only the
``LIVE_LAYOUTS`` most recently used layouts keep theirs (an idle gloo group costs CPU: its TCP
loop thread wakes every 10 ms); the groups of the one evicted are destroyed, and meeting that
layout again creates new ones."""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from mcore_ppo_testing import parallel_state_cache as cache


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether torch still holds ``group`` (destroy_process_group removes it from this registry)."""
    return group in dist.distributed_c10d._world.pg_map


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_only_the_most_recently_used_layouts_keep_their_groups():
    from megatron.core import parallel_state

    from mcore_ppo_testing.cpu_shims import cpu_shims

    assert cache.LIVE_LAYOUTS == 2  # the sequence below evicts with two live layouts
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    shims = cpu_shims() if not torch.cuda.is_available() else contextlib.nullcontext()
    # Three argument sets that Megatron accepts on one rank and the cache tells apart.
    a, b, c = (1,), (1, 1), (1, 1, None)
    met: list[tuple[tuple, list[dist.ProcessGroup]]] = []
    cache.install_parallel_state_cache()
    try:
        with shims:
            for args in (a, b, c, b, a):
                parallel_state.initialize_model_parallel(*args)
                groups = cache._groups(list(cache._module_state().values()))
                met.append((args, list({id(g): g for g in groups}.values())))
                dist.all_reduce(torch.ones(1), group=parallel_state.get_tensor_model_parallel_group())
                parallel_state.destroy_model_parallel()
        (_, first_a), (_, first_b), (_, first_c), (_, again_b), (_, again_a) = met
        assert len(first_a) > 5  # Megatron's groups of one layout (tensor, pipeline, data, ...)
        assert again_b == first_b  # met again while live: the same groups
        assert not any(_alive(g) for g in first_a)  # evicted when c came: destroyed, every one
        assert not {id(g) for g in again_a} & {id(g) for g in first_a}  # a again: new groups
        assert all(_alive(g) for g in again_a + again_b)
        assert not any(_alive(g) for g in first_c)  # evicted when a came back (b was used after c)
        assert [key[0] for key in cache._snapshots] == [b, a]
    finally:
        cache.uninstall_parallel_state_cache()
        while cache._snapshots:  # leave no idle groups behind in this worker
            cache._destroy_groups(cache._snapshots.popitem()[1])
        if created:
            dist.destroy_process_group()
