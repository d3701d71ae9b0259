"""One rank's work at TP > 1 inside a one-process benchmark: this process as rank 0 of a world of
torch's fake process group (``torch.testing._internal.distributed.fake_pg``), whose collectives
return at once. A TP call then runs all of that rank's own GPU work (its shard, the merges of
what the other ranks would send) but the collectives' time; its outputs are not the
multi-rank result (the other ranks' parts are missing)."""

from __future__ import annotations

import torch.distributed as dist


def init_fake_world(world: int) -> None:
    """Make this process rank 0 of a fake world of ``world`` ranks (the default process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
