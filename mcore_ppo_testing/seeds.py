"""Reproducible seeds for the single-process tests' random data.

Every test draws its data from seeds ``S, S + 1, S + 2, ...`` in the order it asks for them
(:func:`next_seed`), where ``S`` is the environment variable ``MCORE_PPO_TEST_SEED`` or
:data:`DEFAULT_SEED`, the default the distributed suite uses too. The sequence restarts for
each test (``tests/conftest.py`` calls :func:`start_test`), so a test sees the same data
whichever tests run before it, and every seed is printed: a failure's captured output names
``MCORE_PPO_TEST_SEED=...`` to replay it with, and a different ``S`` draws new data.
"""

from __future__ import annotations

import itertools
import os

import torch

ENV_VAR = "MCORE_PPO_TEST_SEED"
DEFAULT_SEED = 1234

_draws = itertools.count()


def base_seed() -> int:
    """``MCORE_PPO_TEST_SEED`` when set, else :data:`DEFAULT_SEED`."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return DEFAULT_SEED
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be an integer, got {value!r}") from None


def start_test() -> None:
    """Restart the sequence: the next :func:`next_seed` returns the base seed."""
    global _draws
    _draws = itertools.count()


def next_seed() -> int:
    """The test's next seed (base seed + how many it drew before), printed."""
    base = base_seed()
    seed = base + next(_draws)
    print(f"seed={seed} ({ENV_VAR}={base})")
    return seed


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (tests never touch the global RNG)."""
    return torch.Generator().manual_seed(seed)
