"""Multi-rank tests, run under ``torchrun --nproc_per_node 4 -m pytest tests/distributed``.

Every rank runs the same tests in the same order, so collectives line up. The world is 4
ranks; each test carves the layout it needs (TP 2/4, CP 2, TP 2 × CP 2) out of it with
:func:`tp_cp_groups`, with Megatron's rank order (TP fastest: ``rank = cp_rank·tp + tp_rank``).
A test that fails on one rank makes the others time out on their next collective
(``MCORE_PPO_TEST_TIMEOUT`` seconds) instead of hanging.

Outside torchrun (no ``WORLD_SIZE``) the whole folder is skipped at collection, so a plain
``pytest tests`` stays single-process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

if "WORLD_SIZE" not in os.environ:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """One gloo process group for the whole session."""
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=int(os.environ.get("MCORE_PPO_TEST_TIMEOUT", "300")))
        dist.init_process_group("gloo", timeout=timeout)
    yield dist.group.WORLD
    dist.barrier()


@dataclass(frozen=True)
class Layout:
    """This rank's place in a TP × CP layout of the world."""

    tp_size: int
    cp_size: int
    tp_group: dist.ProcessGroup | None
    cp_group: dist.ProcessGroup | None
    tp_rank: int
    cp_rank: int


_LAYOUTS: dict[tuple[int, int], Layout] = {}


def tp_cp_groups(tp_size: int, cp_size: int = 1) -> Layout:
    """Groups for ``tp_size × cp_size`` ranks (the first tp·cp ranks of the world; the rest
    get a Layout whose groups are None and must skip the collective part of the test).

    Groups are created once per layout and by every rank in the same order, as
    ``dist.new_group`` requires.
    """
    key = (tp_size, cp_size)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    world, rank = dist.get_world_size(), dist.get_rank()
    used = tp_size * cp_size
    if used > world:
        pytest.skip(f"layout tp={tp_size} × cp={cp_size} needs {used} ranks, world has {world}")
    tp_group = cp_group = None
    for c in range(cp_size):
        ranks = [c * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp_size):
        ranks = [c * tp_size + t for c in range(cp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            cp_group = group
    inside = rank < used
    layout = Layout(
        tp_size=tp_size,
        cp_size=cp_size,
        tp_group=tp_group if inside else None,
        cp_group=cp_group if inside else None,
        tp_rank=rank % tp_size if inside else 0,
        cp_rank=rank // tp_size if inside else 0,
    )
    _LAYOUTS[key] = layout
    return layout


def shared_seed() -> int:
    """A fresh seed per call, identical on every rank (rank 0 draws it from the OS).

    Printed, so a failing test's captured output names the seed that reproduces it.
    """
    seed = torch.tensor([int.from_bytes(os.urandom(4), "little") if dist.get_rank() == 0 else 0])
    dist.broadcast(seed, src=0)
    print(f"shared_seed={int(seed.item())}")
    return int(seed.item())
