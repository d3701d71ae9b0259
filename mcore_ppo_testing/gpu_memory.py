"""The GPU memory each test of the single-process suite needs, and what it leaves to the others.

On a GPU machine the suite's pytest-xdist workers share one card (``scripts/gpu_suite.sh -n 8``).
A few tests need many GiB (full-vocab fp64 references, 16k-token buffers), and two of them at
once, or one beside a worker whose caching allocator still holds what its last test reserved,
can run an 80 GB card out of memory. So, in every process where CUDA is initialised:

- each test's peak of allocated memory is recorded (``torch.cuda.max_memory_allocated`` after a
  reset at its start), and the run's summary lists the largest (:func:`largest_peaks`): the
  tests that should not run beside each other;
- after each test the caching allocator gives back the blocks it keeps
  (``torch.cuda.empty_cache``), so memory a finished test reserved is there for a large test in
  another worker instead of held by an idle one;
- a test marked ``gpu_heavy`` (a peak of about 9 GiB or more in that summary) runs with the card
  to itself (:class:`mcore_ppo_testing.card_share.CardShare`, held by every test on a GPU
  machine: shared by most, alone by a heavy one). Without CUDA nothing is locked.

Nothing here initialises CUDA (a process that forks workers must not have done so): a test
that never touched CUDA, in a process that never did, is skipped by both.
"""

from __future__ import annotations

import torch

#: Tests the summary lists, largest peak first.
TOP = 12


def start_test() -> None:
    """Before a test: its peak starts from what is allocated now."""
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def end_test(nodeid: str, peaks: list[tuple[float, str]]) -> None:
    """After a test (its fixtures torn down): its peak in GiB into ``peaks``, and the caching
    allocator's free blocks given back to the device."""
    if torch.cuda.is_initialized():
        peaks.append((torch.cuda.max_memory_allocated() / 2**30, nodeid))
        torch.cuda.empty_cache()


def largest_peaks(peaks: list[tuple[float, str]], top: int = TOP) -> list[str]:
    """The summary's lines: the ``top`` largest peaks, largest first (ties by test id)."""
    ranked = sorted(peaks, key=lambda peak: (-peak[0], peak[1]))[:top]
    return [f"{gib:7.2f} GiB  {nodeid}" for gib, nodeid in ranked]
