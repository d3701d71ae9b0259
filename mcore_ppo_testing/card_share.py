"""The GPU shared by the test workers of one machine: most tests beside each other, a heavy one alone.

pytest-xdist's workers share one card (``scripts/gpu_suite.sh -n 8``); a test that needs many
GiB (``gpu_heavy``: :mod:`mcore_ppo_testing.gpu_memory` lists the peaks) must not run beside
others. :class:`CardShare` is a readers-writer lock across processes, ``flock`` on two files:
every test holds the *room* shared, a heavy one exclusively; a heavy test takes the *turnstile*
first and holds it while it waits, and an ordinary test passes the turnstile on its way in, so no
new test enters while a heavy one waits (it is not starved by a stream of ordinary ones).
A heavy test waits for the tests inside to end, and while it waits no test starts: the suite
stands still for the longest of them. So the heavy tests run last (:func:`heavy_last`, the
collection's order), when little is left to wait for.

A test's subprocesses (a torchrun of pytest ranks, a launch script) run inside its hold: the
hold is marked in the environment they inherit (:data:`HELD`), and a process that finds the mark
takes no lock of its own (:meth:`CardShare.for_test`). Without that, ordinary ranks queued behind
a waiting heavy test would wait for it while it waits for their parent test: a deadlock.

Nothing here imports torch: the tests of the lock run it in plain subprocesses.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The marker of a test that runs with the card to itself.
HEAVY = "gpu_heavy"

#: Set in the environment while a test holds the card: its subprocesses hold nothing more.
HELD = "MCORE_PPO_CARD_HELD"


class CardShare:
    """The card shared by the workers of one machine (module doc). ``directory``: where the two
    lock files live (every worker must name the same one; default: the system's temporary folder)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        folder = Path(directory if directory is not None else tempfile.gettempdir())
        user = os.getuid() if hasattr(os, "getuid") else 0
        # The turnstile stops new tests while a heavy one waits; the room is what they hold.
        self.turnstile = folder / f"mcore_ppo_gpu_turnstile_{user}.lock"
        self.room = folder / f"mcore_ppo_gpu_room_{user}.lock"

    @contextlib.contextmanager
    def held(self, *, alone: bool) -> Iterator[None]:
        """Hold the card, ``alone`` (exclusively) or beside other tests (shared)."""
        with open(self.turnstile, "a") as turnstile, open(self.room, "a") as room:
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_EX)
                try:
                    fcntl.flock(room, fcntl.LOCK_EX)
                    try:
                        yield
                    finally:
                        fcntl.flock(room, fcntl.LOCK_UN)
                finally:
                    fcntl.flock(turnstile, fcntl.LOCK_UN)
                return
            fcntl.flock(turnstile, fcntl.LOCK_SH)
            fcntl.flock(room, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(room, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def for_test(self, *, alone: bool) -> Iterator[None]:
        """A test's hold (:meth:`held`), marked for its subprocesses (:data:`HELD`); nothing where
        this process is such a subprocess (its parent test holds the card)."""
        if os.environ.get(HELD) == "1":
            yield
            return
        with self.held(alone=alone):
            os.environ[HELD] = "1"
            try:
                yield
            finally:
                del os.environ[HELD]


def heavy_last(items: list) -> None:
    """Move the tests marked :data:`HEAVY` to the end of the collection ``items``, in place,
    each group keeping its order (module doc)."""
    heavy = [item for item in items if item.get_closest_marker(HEAVY) is not None]
    if heavy:
        items[:] = [item for item in items if item.get_closest_marker(HEAVY) is None] + heavy
