"""Multi-rank tests, run under torchrun by ``scripts/run_distributed_tests.py`` (every file in one torchrun).

Every rank runs the same tests in the same order, so collectives line up. The world is 4
ranks on CPU (gloo) or one rank per GPU (NCCL: ``MCORE_PPO_TEST_DIST_BACKEND=nccl``); each test
carves the layout it needs (TP 2/4, CP 2, TP 2 × CP 2) out of it with :func:`tp_cp_groups` or
Megatron's ``parallel_state``, with Megatron's rank order (TP fastest). Every tensor of a test
lives on :data:`DEVICE`, this rank's GPU under NCCL, else the CPU: the same tests run on both.

Isolation, so that one failure neither hides nor breaks another test:

- :func:`check` collects soft comparisons and fails a test on *every* rank together (one
  all-reduce at :meth:`Checks.done`), so a mismatch on one rank does not leave the others
  waiting in the next test's collectives.
- Each rank appends every test's start and outcome, with the full failure report, to its own
  file in ``MCORE_PPO_TEST_RESULTS_DIR`` the moment it is known (before any later collective
  can hang). The runner prints those files and re-runs, in a fresh torchrun, the tests a failure
  or a hang kept from running.
- A per-test watchdog (``MCORE_PPO_TEST_TIMEOUT`` seconds, default 300) dumps every thread's
  stack into that file and ends the rank; ``SIGTERM`` (torchrun stopping the other ranks after
  one failed) dumps the stack too. The watchdog counts only the tests: Megatron's import and the
  rendezvous happen before it starts. Collectives time out later than the watchdog. A test
  marked ``watchdog(seconds)`` has its own (the runner's self-tests give their deadlocks a short one).
- Several files share one session (one torchrun): each file cleans up what it installs (module
  fixtures), and a file that fails to import stops the round before any test; the runner reports
  it and runs the other files again without it.

Seeds: :func:`shared_seed` is ``MCORE_PPO_TEST_SEED`` (default 1234) mixed with the test's name,
identical on every rank and printed, so a failure can be replayed.

Outside torchrun (no ``WORLD_SIZE``) the whole folder is skipped at collection, so a plain
``pytest tests`` stays single-process.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import math
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mcore_ppo_testing.reports import error_table, merge_errors

if "WORLD_SIZE" not in os.environ:
    collect_ignore_glob = ["test_*.py"]


# gloo (CPU, CI) by default; ``MCORE_PPO_TEST_DIST_BACKEND=nccl`` on several GPUs (one per rank).
DIST_BACKEND = os.environ.get("MCORE_PPO_TEST_DIST_BACKEND", "gloo")
# Where every tensor of a test lives: this rank's GPU under NCCL, else the CPU.
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if DIST_BACKEND == "nccl" else torch.device("cpu")


def test_timeout_s() -> int:
    """The per-test watchdog (``MCORE_PPO_TEST_TIMEOUT`` s, default 300)."""
    return int(os.environ.get("MCORE_PPO_TEST_TIMEOUT", "300"))


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for the other ranks: the watchdog's time plus 60 s, so a hung
    rank dumps its stack (watchdog) before its peers give up on it.

    Every group the tests create must get it explicitly: ``dist.new_group`` does not inherit the
    world's timeout (it defaults to 30 minutes), so a rank left behind would outlive the CI.
    """
    return datetime.timedelta(seconds=test_timeout_s() + 60)


def rendezvous_timeout() -> datetime.timedelta:
    """How long the world's initialisation waits for every rank: at least 10 minutes, so a slow
    start-up is never an error. It is also the world group's collective timeout, which only has
    to outlast the watchdog (a hung rank's watchdog ends it, and its peers then see it gone)."""
    return max(collective_timeout(), datetime.timedelta(minutes=10))


def megatron_timeout_minutes() -> int:
    """:func:`collective_timeout` for Megatron's ``initialize_model_parallel(distributed_timeout_minutes=)``."""
    return max(1, math.ceil(collective_timeout().total_seconds() / 60))


@contextlib.contextmanager
def model_parallel(tp: int, cp: int = 1) -> Iterator[None]:
    """Megatron's parallel_state for TP × CP over the world (a ``GPTModel`` reads it); a state
    leaked by an earlier test is dropped first (module globals only, no collective)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=megatron_timeout_minutes(),
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------
# Per-rank results file and watchdog (see the module doc).

_RESULTS = None  # this rank's results file, line-buffered


def _results_file():
    global _RESULTS
    if _RESULTS is None:
        folder = os.environ.get("MCORE_PPO_TEST_RESULTS_DIR")
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        _RESULTS = open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.log"), "a", buffering=1)
        # Torchrun stops the other ranks with SIGTERM once one has failed: leave their stacks.
        faulthandler.register(signal.SIGTERM, file=_RESULTS, all_threads=True, chain=True)
    return _RESULTS


def _record(line: str) -> None:
    results = _results_file()
    if results is not None:
        results.write(line + "\n")
        results.flush()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "watchdog(seconds): this test's own watchdog (default MCORE_PPO_TEST_TIMEOUT)")


def pytest_collection_finish(session) -> None:
    """Every test this run will run, so the runner knows which ones a failure kept from running."""
    for item in session.items:
        _record(f"COLLECTED {item.nodeid}")


# The running test's watchdog, s: MCORE_PPO_TEST_TIMEOUT, or the test's ``watchdog(seconds)`` mark.
_WATCHDOG_S = {"now": 0}


def _arm_watchdog() -> None:
    """Dump every thread's stack and end the rank if the running test outlives the watchdog."""
    seconds = _WATCHDOG_S["now"] or test_timeout_s()
    faulthandler.dump_traceback_later(seconds, exit=True, file=_results_file() or sys.stderr)


_STARTED_AT: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location) -> None:
    _record(f"START {nodeid}")
    _STARTED_AT[nodeid] = time.monotonic()
    _arm_watchdog()


def pytest_runtest_logfinish(nodeid, location) -> None:
    faulthandler.cancel_dump_traceback_later()
    _record(f"TIME {time.monotonic() - _STARTED_AT.pop(nodeid, time.monotonic()):.2f} {nodeid}")


def pytest_collectreport(report) -> None:
    """A test file that fails to import, or skips itself whole: its outcome, under the file's node
    id (the runner reports it with the file and does not run that file again)."""
    if report.failed or report.skipped:
        _record(f"{report.outcome.upper()} collect {report.nodeid}")
    if report.failed:
        _record(f"--- rank {os.environ.get('RANK', '0')} {report.nodeid} (collect)\n{report.longreprtext}\n---")


_FAILED_HERE = False  # a test failed on this rank (see process_group's teardown)

# What a collective raises on this rank when another rank's process is gone (its watchdog ended
# it, or it crashed). Such a failure is the other rank's story: the runner then reports the test
# by what that rank did (a hang, a failure), not as this rank's failure.
_PEER_GONE = (
    "Connection closed by peer",  # gloo
    "Connection reset by peer",  # gloo, the TCP store
    "Broken pipe",
    "remote process exited",  # NCCL's ncclRemoteError
)


def _peer_gone(failure_text: str) -> bool:
    return any(marker in failure_text for marker in _PEER_GONE)


def pytest_runtest_logreport(report) -> None:
    """Each phase's outcome at once; a failure's full report with it."""
    global _FAILED_HERE
    _FAILED_HERE = _FAILED_HERE or report.failed
    if report.when == "call" or report.outcome != "passed":
        outcome = "PEERLOST" if report.failed and _peer_gone(report.longreprtext) else report.outcome.upper()
        _record(f"{outcome} {report.when} {report.nodeid}")
    if report.failed:
        _record(f"--- rank {os.environ.get('RANK', '0')} {report.nodeid} ({report.when})\n{report.longreprtext}\n---")


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """One gloo process group for the whole session; Megatron's groups are reused per layout
    (see mcore_ppo_testing.parallel_state_cache: otherwise every initialisation leaks threads)."""
    # Megatron's import (tens of seconds on a cold or busy machine) and the rendezvous (which waits
    # for the slowest rank's start-up) are not the first test's time: the watchdog is off for both
    # and starts afresh once every rank is here. The rendezvous has its own generous bound (an
    # error, not a hang, if a rank never comes).
    faulthandler.cancel_dump_traceback_later()
    from mcore_ppo_testing.parallel_state_cache import install_parallel_state_cache

    if not dist.is_initialized():
        if DIST_BACKEND == "nccl":
            torch.cuda.set_device(DEVICE)
            dist.init_process_group(DIST_BACKEND, timeout=rendezvous_timeout(), device_id=DEVICE)
        else:
            dist.init_process_group(DIST_BACKEND, timeout=rendezvous_timeout())
    install_parallel_state_cache()
    _STARTED_AT[_CURRENT_TEST["nodeid"]] = time.monotonic()  # the test's time starts here too
    _arm_watchdog()
    yield dist.group.WORLD
    if _FAILED_HERE:
        # A rank that failed leaves without session collectives: its peers may still wait inside
        # the failed test's collectives, which a report all-gather here could pair with. The
        # runner re-runs what they had not finished, in a fresh torchrun.
        return
    _gather_error_report()
    dist.barrier()
    # Destroy every group (Megatron's too) before the interpreter exits: NCCL communicators left
    # to the destructors made the ranks of a finished run stall for about a minute and exit 1.
    dist.destroy_process_group()


def layout_fits(ranks: int) -> bool:
    """Whether a layout of ``ranks`` ranks (tp·cp·pp) can be initialised on this world (Megatron
    needs the world to be a multiple of it)."""
    world = dist.get_world_size()
    return ranks <= world and world % ranks == 0


# Layouts a test left out for lack of ranks: test id -> descriptions (printed in the summary).
_LEFT_OUT: dict[str, list[str]] = {}


def require_ranks(ranks: int, what: str) -> None:
    """Skip the test, saying why, when ``what`` (a layout of ``ranks`` ranks) does not fit the world."""
    if not layout_fits(ranks):
        pytest.skip(f"{what} needs {ranks} ranks (a divisor of the world); the world has {dist.get_world_size()}")


def fitting(layouts, ranks_of, describe) -> list:
    """The layouts that fit the world; the others are recorded (with the running test) for the summary."""
    kept = []
    for layout in layouts:
        if layout_fits(ranks_of(layout)):
            kept.append(layout)
        else:
            note = f"{describe(layout)} (needs {ranks_of(layout)} ranks, world {dist.get_world_size()})"
            notes = _LEFT_OUT.setdefault(_CURRENT_TEST["nodeid"], [])
            if note not in notes:  # a test may ask once per case
                notes.append(note)
    return kept


@dataclass(frozen=True)
class Layout:
    """This rank's place in a TP × CP layout of the world."""

    tp_size: int
    cp_size: int
    tp_group: dist.ProcessGroup | None
    cp_group: dist.ProcessGroup | None
    tp_rank: int
    cp_rank: int


_LAYOUTS: dict[tuple[int, int], Layout] = {}


def layout_id(tp: int, cp: int = 1) -> str:
    """A test id for a TP × CP layout: ``tp2``, ``cp2``, ``tp2xcp2`` (sizes of 1 left out)."""
    return "x".join(part for part in (f"tp{tp}" * (tp > 1), f"cp{cp}" * (cp > 1)) if part) or "tp1"


def tp_cp_groups(tp_size: int, cp_size: int = 1) -> Layout:
    """Groups for ``tp_size × cp_size`` ranks (the first tp·cp ranks of the world; the rest
    get a Layout whose groups are None and must skip the collective part of the test).

    Groups are created once per layout and by every rank in the same order, as
    ``dist.new_group`` requires.
    """
    key = (tp_size, cp_size)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    world, rank = dist.get_world_size(), dist.get_rank()
    used = tp_size * cp_size
    if used > world:
        pytest.skip(f"layout tp={tp_size} × cp={cp_size} needs {used} ranks, world has {world}")
    tp_group = cp_group = None
    for c in range(cp_size):
        ranks = [c * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks, timeout=collective_timeout())
        if rank in ranks:
            tp_group = group
    for t in range(tp_size):
        ranks = [c * tp_size + t for c in range(cp_size)]
        group = dist.new_group(ranks, timeout=collective_timeout())
        if rank in ranks:
            cp_group = group
    inside = rank < used
    layout = Layout(
        tp_size=tp_size,
        cp_size=cp_size,
        tp_group=tp_group if inside else None,
        cp_group=cp_group if inside else None,
        tp_rank=rank % tp_size if inside else 0,
        cp_rank=rank // tp_size if inside else 0,
    )
    _LAYOUTS[key] = layout
    return layout


# The small GPT of the actor tests (build_gpt_model's shape keywords).
ACTOR_GPT = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 8,  # TP 8 on a world of 8
    "ffn_hidden_size": 64,
    "vocab_size": 128,
    "max_sequence_length": 64,
}


_CURRENT_TEST = {"nodeid": ""}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    _CURRENT_TEST["nodeid"] = item.nodeid
    # A test marked ``watchdog(seconds)`` runs under its own watchdog (the runner's self-tests give
    # their deadlocks, which never finish, a short one); the rest under MCORE_PPO_TEST_TIMEOUT.
    mark = item.get_closest_marker("watchdog")
    _WATCHDOG_S["now"] = int(mark.args[0]) if mark else 0
    _arm_watchdog()


def shared_seed() -> int:
    """The test's seed, identical on every rank: ``MCORE_PPO_TEST_SEED`` (default 1234) mixed
    with the test's id, so tests draw different data but a run is reproducible. Printed, so a
    failing test's captured output names it (replay: ``MCORE_PPO_TEST_SEED=<base>``)."""
    base = int(os.environ.get("MCORE_PPO_TEST_SEED", "1234"))
    seed = (base + zlib.crc32(_CURRENT_TEST["nodeid"].encode())) % 2**31
    print(f"shared_seed={seed} (MCORE_PPO_TEST_SEED={base}, {_CURRENT_TEST['nodeid']})")
    return seed


# ---------------------------------------------------------------------------------------------
# Soft comparisons that fail on every rank together, and the error report of the session.

# comparison kind -> output name -> largest normwise relative error seen (this rank).
_ERRORS: dict[str, dict[str, float]] = {}
# test id -> number of cases compared (this rank).
_CASES: dict[str, int] = {}
# Rank 0's merged report, printed by pytest_terminal_summary.
_REPORT: dict[str, dict] = {}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error ``max|actual - expected| / max|expected|`` (in float64).

    Infinite when the shapes differ or ``actual`` is not finite.
    """
    if actual.shape != expected.shape:
        return float("inf")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    if a.numel() == 0:
        return 0.0
    diff = (a - e).abs().max().item()
    scale = e.abs().max().item()
    return diff / scale if scale > 0 else diff


class Checks:
    """Soft assertions for one test; :meth:`done` fails the test on every rank if any rank failed."""

    def __init__(self, test_id: str):
        self.test_id = test_id
        self.context = ""
        self.failures: list[str] = []
        self.finished = False

    def case(self, description: str) -> None:
        """Start a new compared case (counted in the session report); names later failures."""
        self.context = description
        _CASES[self.test_id] = _CASES.get(self.test_id, 0) + 1

    def fail(self, message: str) -> None:
        self.failures.append(f"[rank {dist.get_rank()}] {self.context}: {message}")

    def close(self, output: str, actual: torch.Tensor, expected: torch.Tensor, *, tol: float, kind: str) -> float:
        """``actual`` ≈ ``expected`` to normwise relative error ``tol``; recorded under ``kind``."""
        err = relative_error(actual, expected)
        per_output = _ERRORS.setdefault(kind, {})
        per_output[output] = max(per_output.get(output, 0.0), err)
        if not err <= tol:
            self.fail(
                f"{output} ({kind}): relative error {err:.3e} > {tol:.1e} "
                f"(shapes {tuple(actual.shape)} vs {tuple(expected.shape)})"
            )
        return err

    def equal(self, output: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Bitwise equality (same shape, dtype and bits)."""
        same = actual.shape == expected.shape and actual.dtype == expected.dtype and torch.equal(actual, expected)
        if not same:
            self.fail(f"{output}: not bitwise equal (relative error {relative_error(actual, expected):.3e})")

    def raises(self, exception: type[Exception], match: str, fn: Callable[..., object], *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` raises ``exception`` whose message contains ``match``."""
        try:
            fn(*args, **kwargs)
        except exception as err:
            if match not in str(err):
                self.fail(f"{exception.__name__} raised, but its message lacks {match!r}: {err}")
            return
        except Exception as err:  # any other exception is a failure of this check, not of the run
            self.fail(f"expected {exception.__name__} ({match!r}), got {type(err).__name__}: {err}")
            return
        self.fail(f"expected {exception.__name__} ({match!r}), nothing was raised")

    def done(self) -> None:
        """Collective over the world: raise on every rank if any rank recorded a failure."""
        self.finished = True
        failed = torch.tensor([len(self.failures)], dtype=torch.int64, device=DEVICE)
        dist.all_reduce(failed)
        if failed.item():
            local = "\n".join(self.failures) or "(no failure on this rank)"
            raise AssertionError(f"{failed.item()} failed comparison(s) across ranks; this rank's:\n{local}")


@pytest.fixture
def check(request) -> Checks:
    """A :class:`Checks` for this test; the test must call ``check.done()`` on every rank."""
    checks = Checks(request.node.nodeid.split("::", 1)[-1])
    yield checks
    call = getattr(request.node, "rep_call", None)
    if call is not None and call.passed and not checks.finished:
        # A test that never calls done() could not fail on a mismatch.
        pytest.fail("test did not call check.done(): its comparisons were never asserted", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep the call phase's report on the item, for the ``check`` fixture's teardown."""
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


def _gather_error_report() -> None:
    """Merge every rank's largest errors and case counts (max over ranks) into rank 0's report."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"errors": _ERRORS, "cases": _CASES})
    cases: dict[str, int] = {}
    for part in gathered:
        for test, count in part["cases"].items():
            cases[test] = max(cases.get(test, 0), count)
    if dist.get_rank() != 0:
        return
    _REPORT.update(errors=merge_errors([part["errors"] for part in gathered]), cases=cases)
    path = os.environ.get("MCORE_PPO_ERROR_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_REPORT, f, indent=2, sort_keys=True)


def pytest_terminal_summary(terminalreporter) -> None:
    """Rank 0 prints the largest relative error per comparison and output, and case counts."""
    # Only rank 0 holds the merged report; every rank may have layouts left out.
    if _REPORT.get("errors"):
        terminalreporter.section("largest normwise relative error, max over ranks")
        for line in error_table(_REPORT["errors"]):
            terminalreporter.write_line(line)
    if _REPORT.get("cases"):
        terminalreporter.section("cases compared per test (max over ranks)")
        for test, count in sorted(_REPORT["cases"].items()):
            terminalreporter.write_line(f"{count:>5}  {test}")
    if _LEFT_OUT:
        terminalreporter.section("layouts left out inside tests (too few ranks)")
        for test, layouts in sorted(_LEFT_OUT.items()):
            terminalreporter.write_line(f"{test}: {'; '.join(layouts)}")


@pytest.fixture
def fresh_parallel_state():
    """No Megatron model-parallel state around the test (a leaked one is destroyed first).

    With it initialised, ``tp_group=None`` would resolve to Megatron's group, so single-rank
    references would silently become multi-rank calls. ``destroy_model_parallel`` only drops
    module globals: no collective, safe on any rank.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def gpt_cpu_shims():
    """Megatron's GPTModel on CPU (mcore_ppo_testing.cpu_shims); nothing on CUDA, where it runs unmodified."""
    from mcore_ppo_testing import cpu_shims

    if torch.cuda.is_available():
        yield
        return
    with cpu_shims():
        yield
