"""One GPU shared by pytest-xdist workers: a test that ran out of its memory beside them runs again alone.

The single-process suite runs on one GPU with several workers (``scripts/gpu_suite.sh -n 8``).
Most tests need little memory, a few need many GiB (full-vocab fp64 references, 16k-token
buffers), and on a card of 80 GB two of those at once can exhaust it: the test that asks last
fails with ``torch.OutOfMemoryError`` though it fits the card alone. So every test call holds a
*shared* lock on one file while it runs, and a call that raised ``torch.OutOfMemoryError`` runs
once more holding it *exclusively*: the other workers finish the calls they are in and wait
before their next, and the test gets the whole card. A test that runs out of memory alone still
fails; any other failure is never run again. The retried tests are listed in the run's summary.

The exclusive side first takes a turnstile lock that every shared side passes through on its way
in (taking it and letting go), so waiting for the exclusive lock is not starved by workers taking
new shared locks. Locks are ``fcntl.flock`` on files in a folder every worker of one run shares
(pytest's base temporary folder's parent under xdist); a pytest started inside a test (a new run)
has its own folder, so it never waits on its parent. The retry reuses the test's fixtures as the
first call left them.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
from collections.abc import Iterator
from pathlib import Path

import torch

LOCK_NAME = "mcore_ppo_gpu_share.lock"
TURNSTILE_NAME = "mcore_ppo_gpu_share.turnstile"


@contextlib.contextmanager
def _flock(path: Path, operation: int) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, operation)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class GpuShare:
    """The shared and exclusive sides of one run's GPU (module doc), in ``folder``."""

    def __init__(self, folder: Path):
        self.lock = Path(folder) / LOCK_NAME
        self.turnstile = Path(folder) / TURNSTILE_NAME

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """A test call among others: waits while a test runs (or waits to run) alone."""
        with _flock(self.turnstile, fcntl.LOCK_EX):
            pass
        with _flock(self.lock, fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """A test call with the GPU to itself: every other worker's call has ended."""
        with _flock(self.turnstile, fcntl.LOCK_EX), _flock(self.lock, fcntl.LOCK_EX):
            yield


def run_call(item, share: GpuShare, retried: list[str]):
    """The body of a ``pytest_runtest_call`` hook wrapper (``wrapper=True``; ``yield from``
    it): the test's call under ``share.shared()``, and after a ``torch.OutOfMemoryError`` once
    more under ``share.alone()``, whose outcome is then the test's. ``retried`` gets the
    test's id."""
    try:
        with share.shared():
            return (yield)
    except torch.OutOfMemoryError:
        retried.append(item.nodeid)
    # Out of the handler: the first call's traceback, and the tensors its frames held, are let go.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with share.alone():
        return item.runtest()
