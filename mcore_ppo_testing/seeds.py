"""Seeds of the single-process tests' random data, and the generator they draw it from."""

from __future__ import annotations

import os

import torch


def fresh_seed() -> int:
    """A new random seed from the OS, printed so a failing test names the data it saw."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (tests never touch the global RNG)."""
    return torch.Generator().manual_seed(seed)
