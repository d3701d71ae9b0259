"""The multi-rank runner's isolation (scripts/run_distributed_tests.py), on 2 gloo ranks.

A throwaway test folder with the suite's own conftest holds a test that fails on one rank only
(its peer then waits in a collective), one that hangs on every rank, one that hangs on one rank
whose peer then fails with the connection gone, and one that passes; beside it a file whose
test runs after a slow start, a second file that passes and a third that fails to import, all
four in one torchrun. The runner must report exactly that, per file (1 passed; 1 failed, 2
hung, 1 passed; 1 passed; 1 failed: 2 failed, 2 hung, 3 passed in all; exit 1), print the
failing rank's traceback, the import error and the hung ranks' stacks, and still run the
passing tests after them.

Nothing here depends on the machine's speed: every hang is a deadlock (a rank waits for a
message nobody sends), so its short watchdog (the ``watchdog`` mark) can never cut a test that
would have finished; every test that must finish runs under the suite's default watchdog
(300 s) and does one collective after the rendezvous; start-up (imports, the rendezvous) is
outside the watchdog. A slow start is simulated outright (a rank that starts late, a Megatron
import slower than the watchdog of the first test, 20 s): it is start-up, not a hang.

Megatron is not what these cases are about: in their ranks a stand-in package answers ``import
megatron`` (the conftest's process group fixture still imports it, at the same point of the
start-up), so each torchrun costs a torch start-up per rank, not a Megatron import of ~10 s of
CPU. The suite itself (scripts/test.sh) runs the same conftest with the real Megatron.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The watchdog of the deadlocked tests, s: they never finish, so any value is safe; each hang costs it once.
DEADLOCK_WATCHDOG_S = 5
# The slow-start case's watchdog (its ``watchdog`` mark), s: start-up takes longer than it, and the
# test after it is one collective between two ranks that have both passed the rendezvous.
SLOW_START_WATCHDOG_S = 20

CASES = """
import faulthandler
import os
import signal

import conftest
import pytest
import torch
import torch.distributed as dist


def test_a_fails_on_rank1_only():
    if dist.get_rank() == 1:
        raise AssertionError("rank 1 alone fails here")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: rank 0 waits until rank 1's process is gone


@pytest.mark.watchdog(DEADLOCK_WATCHDOG_S)
def test_b_hangs_on_every_rank():
    dist.recv(torch.empty(1), src=1 - dist.get_rank())  # each waits for a message its peer never sends


@pytest.mark.watchdog(DEADLOCK_WATCHDOG_S)
def test_b2_hangs_and_the_peer_sees_it_go():
    # Rank 1 hangs; rank 0 outlives rank 1's watchdog (and torchrun's SIGTERM once rank 1 is gone),
    # so its collective fails with the peer gone. On a slow machine that happens without the help;
    # here it happens every time. The failure is the hang's consequence: still a hang, not a failure.
    # (Should rank 0's own timer fire first, both ranks are left unfinished: a hang all the same.)
    if dist.get_rank() == 0:
        faulthandler.dump_traceback_later(conftest.test_timeout_s(), exit=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.all_reduce(torch.ones(1))
    else:
        dist.recv(torch.empty(1), src=0)  # never sent


def test_c_passes():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # gloo runs on the CPUs, even on a GPU machine
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
"""

MORE_CASES = """
import torch
import torch.distributed as dist


def test_d_in_the_same_torchrun_passes():
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
"""

BROKEN = """
import a_module_that_does_not_exist_anywhere  # fails at import: the file's tests never run
"""


SLOW_START = """
import importlib.abc
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

DELAY_S = SLOW_START_WATCHDOG_S + 5
# The torchrun that runs this file's test starts slowly. In later rounds (the runner runs the other
# files' tests again, this one deselected) the ranks start as usual.
SLOW = not any(arg.endswith("::test_after_a_slow_start") for arg in sys.argv)


class SlowMegatronImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron":
            sys.meta_path.remove(self)
            time.sleep(DELAY_S)
        return None  # the real import follows


if SLOW and os.environ["RANK"] == "0":
    # Rank 0's first Megatron import (the suite's process group fixture) outlasts the watchdog,
    # as on a cold GPU host.
    assert "megatron" not in sys.modules, "Megatron is imported at collection: the case is moot"
    sys.meta_path.insert(0, SlowMegatronImport())
elif SLOW:
    time.sleep(DELAY_S)  # rank 1 starts later than the watchdog: rank 0 waits in the rendezvous


@pytest.mark.watchdog(SLOW_START_WATCHDOG_S)
def test_after_a_slow_start():  # the first test of its torchrun (its file comes first)
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
"""


# The stand-in for Megatron in the cases' ranks: the one module the conftest's start-up imports
# (mcore_ppo_testing.parallel_state_cache wraps its initialize_model_parallel, which no case calls).
MEGATRON_STANDIN = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/parallel_state.py": (
        "def initialize_model_parallel(*args, **kwargs):\n"
        "    raise AssertionError('the runner self-test stand-in for Megatron has no model parallelism')\n"
    ),
}


def run_cases(tmp_path, files: dict[str, str]) -> subprocess.CompletedProcess:
    """``files`` (name -> source) as test files beside the suite's conftest, through the runner on
    2 gloo ranks, whatever this process's environment says about the multi-rank suite."""
    folder = tmp_path / "cases"
    folder.mkdir()
    standin = tmp_path / "standin"
    for name, source in MEGATRON_STANDIN.items():
        (standin / name).parent.mkdir(parents=True, exist_ok=True)
        (standin / name).write_text(source)
    shutil.copy(ROOT / "tests" / "distributed" / "conftest.py", folder / "conftest.py")
    constants = f"DEADLOCK_WATCHDOG_S = {DEADLOCK_WATCHDOG_S}\nSLOW_START_WATCHDOG_S = {SLOW_START_WATCHDOG_S}\n"
    for name, source in files.items():
        (folder / name).write_text(constants + source)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PPO_TEST_")}
    path = os.pathsep.join(filter(None, [str(standin), str(ROOT), os.environ.get("PYTHONPATH")]))
    clean.update(MCORE_PPO_TEST_DIST_BACKEND="gloo", PYTHONPATH=path)
    command = [sys.executable, str(ROOT / "scripts" / "run_distributed_tests.py"), "--nproc", "2"]
    paths = [str(folder / name) for name in sorted(files)]
    return subprocess.run([*command, *paths], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=1800)


def _file_line(out: str, name: str) -> str:
    """The summary's line of the test file ``name``."""
    lines = [line for line in out.split("distributed suite summary", 1)[-1].splitlines() if f"/{name} " in line]
    assert len(lines) == 1, out
    return lines[0]


def test_runner_isolates_failures_and_hangs(tmp_path):
    files = {
        "test_a_slow_start.py": SLOW_START,
        "test_cases.py": CASES,
        "test_cases_more.py": MORE_CASES,
        "test_cases_broken.py": BROKEN,
    }
    proc = run_cases(tmp_path, files)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith("2 failed, 2 hung, 3 passed (2 ranks, gloo)"), out
    # A rank that starts late, and a Megatron import slower than the watchdog, are start-up: the
    # first test's watchdog starts after them.
    slow_start = _file_line(out, "test_a_slow_start.py")
    assert "1 passed" in slow_start and "hung" not in slow_start and "failed" not in slow_start, out
    assert "1 failed, 2 hung, 1 passed" in _file_line(out, "test_cases.py"), out
    assert "1 passed" in _file_line(out, "test_cases_more.py"), out
    assert "1 failed" in _file_line(out, "test_cases_broken.py"), out
    assert "FAILED: " in out and "test_a_fails_on_rank1_only" in out, out
    assert "HUNG: " in out and "test_b_hangs_on_every_rank" in out, out
    assert "test_b2_hangs_and_the_peer_sees_it_go" in out.split("HUNG: ", 1)[1], out
    assert "rank 1 alone fails here" in out and "--- rank(s) 1:" in out, out
    assert "a_module_that_does_not_exist_anywhere" in out and "(collect)" in out, out  # the import error
    assert f"Timeout (0:00:{DEADLOCK_WATCHDOG_S:02d})!" in out, out  # the hung ranks' stack dumps
