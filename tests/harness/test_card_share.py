"""mcore_ppo_testing.card_share: the card shared by the test workers of a GPU machine, across
processes as xdist's workers hold it: ordinary tests beside each other, a heavy one alone, and a
heavy one waiting keeps newcomers out (it is not starved).

Each worker here is a plain Python subprocess that loads the module from its file (no torch) and
appends its name to a log while it holds the card; "waits" is read from the kernel's own table of
lock requests (``/proc/locks``, where ``->`` marks a blocked one), never from a timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_ppo_testing.card_share import HEAVY, HELD, CardShare, heavy_last

MODULE = Path(__file__).resolve().parents[2] / "mcore_ppo_testing" / "card_share.py"

_WORKER = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("card_share", sys.argv[1])
card_share = importlib.util.module_from_spec(spec)
spec.loader.exec_module(card_share)
directory, alone, name, release = pathlib.Path(sys.argv[2]), sys.argv[3] == "alone", sys.argv[4], sys.argv[5]
with card_share.CardShare(directory).held(alone=alone):
    with open(directory / "log", "a") as log:
        log.write(name + "\\n")
    deadline = time.monotonic() + 60
    while release and not pathlib.Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def _start(tmp_path: Path, alone: bool, name: str, release: Path | None = None) -> subprocess.Popen:
    how = "alone" if alone else "shared"
    # A worker of its own, not a subprocess of this test (which holds the card on a GPU machine).
    env = {key: value for key, value in os.environ.items() if key != HELD}
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(MODULE), str(tmp_path), how, name, str(release or "")], env=env
    )


def _joined(*workers: subprocess.Popen) -> bool:
    return all(worker.wait(timeout=60) == 0 for worker in workers)


def _log(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().split() if path.exists() else []


def _waiting(path: Path) -> int:
    """Lock requests blocked on ``path``."""
    inode = f":{os.stat(path).st_ino} "
    return sum("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_ordinary_tests_share_the_card(tmp_path):
    with CardShare(tmp_path).held(alone=False):
        assert _joined(_start(tmp_path, False, "beside"))
        assert _log(tmp_path) == ["beside"]  # it held the card beside this test


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs the kernel's /proc/locks to see waiters")
def test_a_heavy_test_waits_for_the_card_and_keeps_newcomers_out(tmp_path):
    """A heavy test waits for the ordinary test inside; an ordinary test arriving meanwhile waits
    behind it although the card is only shared; the heavy one goes first once the card is free."""
    share = CardShare(tmp_path)
    with share.held(alone=False):
        heavy = _start(tmp_path, True, "heavy")
        _wait_until(lambda: _waiting(share.room) == 1, "the heavy test to wait for the card")
        newcomer = _start(tmp_path, False, "newcomer")
        _wait_until(lambda: _waiting(share.turnstile) == 1, "the newcomer to wait behind the heavy test")
        assert _log(tmp_path) == []
    assert _joined(heavy, newcomer)
    assert _log(tmp_path) == ["heavy", "newcomer"]


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs the kernel's /proc/locks to see waiters")
def test_an_ordinary_test_waits_for_a_heavy_one(tmp_path):
    release = tmp_path / "release"
    share = CardShare(tmp_path)
    heavy = _start(tmp_path, True, "heavy", release)
    _wait_until(lambda: _log(tmp_path) == ["heavy"], "the heavy test to hold the card")
    late = _start(tmp_path, False, "late")
    _wait_until(lambda: _waiting(share.turnstile) == 1, "the ordinary test to wait for the heavy one")
    assert _log(tmp_path) == ["heavy"]
    release.touch()
    assert _joined(heavy, late)
    assert _log(tmp_path) == ["heavy", "late"]


def test_the_lock_files_are_per_user_in_one_folder(tmp_path):
    share = CardShare(tmp_path)
    assert share.turnstile.parent == share.room.parent == tmp_path and share.turnstile != share.room
    assert str(os.getuid()) in share.room.name


def test_a_tests_subprocesses_hold_nothing_more(tmp_path, monkeypatch):
    """While a test holds the card its subprocesses see the mark and take no lock (a heavy test
    waiting cannot block them behind their own parent); the mark goes with the hold."""
    monkeypatch.delenv(HELD, raising=False)
    share = CardShare(tmp_path)
    with share.for_test(alone=True):
        assert os.environ[HELD] == "1"
        child = subprocess.run(
            [sys.executable, "-c", _WORKER.replace(".held(alone=alone)", ".for_test(alone=alone)"), str(MODULE),
             str(tmp_path), "alone", "child", ""],
            timeout=60,
        )  # fmt: skip
        assert child.returncode == 0 and _log(tmp_path) == ["child"]  # it ran inside this exclusive hold
    assert HELD not in os.environ


class _Item:
    def __init__(self, name: str, heavy: bool):
        self.name, self.heavy = name, heavy

    def get_closest_marker(self, name: str):
        return "marker" if self.heavy and name == HEAVY else None


def test_heavy_tests_run_last_in_their_order():
    items = [_Item("a", False), _Item("H1", True), _Item("b", False), _Item("H2", True), _Item("c", False)]
    heavy_last(items)
    assert [item.name for item in items] == ["a", "b", "c", "H1", "H2"]
    light = [_Item("a", False), _Item("b", False)]
    heavy_last(light)
    assert [item.name for item in light] == ["a", "b"]
