"""The multi-rank runner's isolation (scripts/run_distributed_tests.py), on 2 gloo ranks.

A throwaway test folder with the suite's own conftest holds a test that fails on one rank only
(its peer then waits in a collective), one that hangs on every rank, one that hangs on one rank
whose peer then fails with the connection gone, and one that passes. The runner must report
exactly that (1 failed, 2 hung, 1 passed; exit 1), print the failing rank's
traceback and the hung ranks' stacks, and still run the passing test after them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = """
import faulthandler
import os
import signal

import torch
import torch.distributed as dist


def test_a_fails_on_rank1_only():
    if dist.get_rank() == 1:
        raise AssertionError("rank 1 alone fails here")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: rank 0 waits


def test_b_hangs_on_every_rank():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.barrier()  # a different collective: neither returns


def test_b2_hangs_and_the_peer_sees_it_go():
    # Rank 1 hangs; rank 0 outlives rank 1's watchdog (and torchrun's SIGTERM once rank 1 is gone),
    # so its collective fails with the peer gone. On a slow machine that happens without the help;
    # here it happens every time. The failure is the hang's consequence: still a hang, not a failure.
    if dist.get_rank() == 0:
        faulthandler.dump_traceback_later(60, exit=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.all_reduce(torch.ones(1))
    else:
        dist.barrier()


def test_c_passes():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # gloo runs on the CPUs, even on a GPU machine
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
"""


LATE_RANK = """
import os
import time

import torch
import torch.distributed as dist

if os.environ["RANK"] == "1":
    time.sleep(14)  # starts later than the watchdog's 10 s (cold imports on a busy machine)


def test_after_a_late_start():
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
"""


def run_cases(tmp_path, cases: str) -> subprocess.CompletedProcess:
    """``cases`` as a test file beside the suite's conftest, through the runner on 2 gloo ranks
    with a 10 s watchdog."""
    folder = tmp_path / "cases"
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "distributed" / "conftest.py", folder / "conftest.py")
    (folder / "test_cases.py").write_text(cases)
    env = dict(
        os.environ, MCORE_PPO_TEST_TIMEOUT="10", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    command = [sys.executable, str(ROOT / "scripts" / "run_distributed_tests.py"), "--nproc", "2"]
    return subprocess.run(
        [*command, str(folder / "test_cases.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_late_rank_is_not_a_hang(tmp_path):
    """The rendezvous waits for the slowest rank's start-up outside the first test's watchdog
    (on the GPU machine a rank once started >10 s late and its test was reported hung)."""
    proc = run_cases(tmp_path, LATE_RANK)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("1 passed (2 ranks, gloo)"), proc.stdout


def test_runner_isolates_failures_and_hangs(tmp_path):
    proc = run_cases(tmp_path, CASES)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith("1 failed, 2 hung, 1 passed (2 ranks, gloo)"), out
    assert "FAILED: " in out and "test_a_fails_on_rank1_only" in out, out
    assert "HUNG: " in out and "test_b_hangs_on_every_rank" in out, out
    assert "test_b2_hangs_and_the_peer_sees_it_go" in out.split("HUNG: ", 1)[1], out
    assert "rank 1 alone fails here" in out and "--- rank(s) 1:" in out, out
    assert "Timeout (0:00:10)!" in out, out  # the watchdog's stack dump of the hung ranks
