"""mcore_ppo_testing.gpu_share on the CPU: a test call that raised torch.OutOfMemoryError runs
again holding the GPU's lock alone; other failures are not run again; a run alone waits for
the shared calls already in and blocks new ones.

An inner pytest run drives the hook wrapper as the suite's conftest wires it (the suite itself
uses it only in xdist workers with CUDA); the locks' interplay across processes is checked with
child processes that hold a shared call open until told to end it.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from mcore_ppo_testing.gpu_share import LOCK_NAME, GpuShare

REPO = Path(__file__).resolve().parents[2]

INNER_CONFTEST = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest

    from mcore_ppo_testing import gpu_share

    SHARE = gpu_share.GpuShare(Path(os.environ["GPU_SHARE_DIR"]))
    RETRIED = []


    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        return (yield from gpu_share.run_call(item, SHARE, RETRIED))


    def pytest_terminal_summary(terminalreporter):
        terminalreporter.write_line("retried: " + ",".join(n.split("::")[-1] for n in RETRIED))
    """
)

INNER_TESTS = textwrap.dedent(
    """
    import fcntl
    import os
    from pathlib import Path

    import torch

    LOCK = Path(os.environ["GPU_SHARE_DIR"]) / "mcore_ppo_gpu_share.lock"


    def held(operation):
        # Whether another open file description can take the lock now (flock: per description).
        with open(LOCK, "a+") as handle:
            try:
                fcntl.flock(handle, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(handle, fcntl.LOCK_UN)
            return True


    def calls(name):
        path = Path(os.environ["GPU_SHARE_DIR"]) / name
        count = int(path.read_text()) + 1 if path.exists() else 1
        path.write_text(str(count))
        return count


    def test_out_of_memory_once():
        if calls("once") == 1:
            # Among others: the lock is shared (another shared call may enter, no exclusive one).
            assert held(fcntl.LOCK_SH) and not held(fcntl.LOCK_EX)
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        assert not held(fcntl.LOCK_SH)  # alone: not even a shared call may enter


    def test_out_of_memory_alone_too():
        calls("always")
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")


    def test_another_error_is_not_run_again():
        calls("other")
        raise ValueError("not a memory error")


    def test_a_plain_test():
        assert calls("plain") == 1
    """
)


def test_a_test_out_of_gpu_memory_runs_again_alone_and_nothing_else_does(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text(INNER_CONFTEST)
    (inner / "test_inner.py").write_text(INNER_TESTS)
    share = tmp_path / "share"
    share.mkdir()
    env = {"GPU_SHARE_DIR": str(share), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(inner)],
        cwd=inner, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "2 failed, 2 passed" in out, out
    assert "retried: test_out_of_memory_once,test_out_of_memory_alone_too" in out, out
    counts = {name: int((share / name).read_text()) for name in ("once", "always", "other", "plain")}
    assert counts == {"once": 2, "always": 2, "other": 1, "plain": 1}
    assert "FAILED test_inner.py::test_out_of_memory_alone_too - torch.OutOfMemoryError" in out, out
    assert "FAILED test_inner.py::test_another_error_is_not_run_again - ValueError" in out, out


def _hold_shared(folder: str, entered, release) -> None:
    with GpuShare(Path(folder)).shared():
        entered.set()
        release.wait(60)


def test_alone_waits_for_the_shared_calls_in_and_blocks_new_ones(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    first_in, release_first = ctx.Event(), ctx.Event()
    first = ctx.Process(target=_hold_shared, args=(str(tmp_path), first_in, release_first))
    first.start()
    try:
        assert first_in.wait(60)
        share = GpuShare(tmp_path)
        alone = threading.Event()
        done = threading.Event()

        def run_alone() -> None:
            with share.alone():
                alone.set()
                done.wait(60)

        waiter = threading.Thread(target=run_alone)
        waiter.start()
        # While a shared call is in, the run alone waits, and a new shared call waits behind it.
        second_in, release_second = ctx.Event(), ctx.Event()
        second = ctx.Process(target=_hold_shared, args=(str(tmp_path), second_in, release_second))
        second.start()
        assert not alone.wait(1.0)
        assert not second_in.wait(1.0)
        release_first.set()
        assert alone.wait(60)  # the first call ended: the run alone has the GPU
        assert not second_in.wait(1.0)  # ... and the new shared call still waits
        done.set()
        waiter.join(60)
        assert second_in.wait(60)  # the run alone ended: shared calls enter again
        release_second.set()
        second.join(60)
        assert second.exitcode == 0
    finally:
        release_first.set()
        first.join(60)
    assert first.exitcode == 0
    with open(tmp_path / LOCK_NAME, "a+") as handle:  # everything let go
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
