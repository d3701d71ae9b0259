"""The multi-rank test suite: the files in one torchrun, every test isolated, every rank's failure readable.

    python scripts/run_distributed_tests.py [--nproc N] [--files-per-round K] [--out DIR] [FILE ...] [-- PYTEST_ARGS]

Runs ``tests/distributed/test_*.py`` (or the files given) in one ``torchrun --standalone
--nproc_per_node N -m pytest FILE... -x`` (``--files-per-round K``: K files per torchrun; 1 runs
each file alone), so Megatron's import and the rendezvous happen once per rank, not once per
file. Every rank writes each test's start, outcome, time and full failure report to its own
results file the moment it is known (``tests/distributed/conftest.py``), so a rank that fails
leaves its traceback even if another rank then hangs, and a hung rank leaves its stack
(per-test watchdog, ``MCORE_PPO_TEST_TIMEOUT``).

Isolation: when a round stops early (a failure with ``-x``, a crash, a hang), the tests it kept
from running are run again in a fresh torchrun, with the finished ones deselected, until every
test has an outcome. So one failing test never makes later tests (of its file or the next ones)
fail or hang, and never hides them. A test that hangs is reported as HUNG with every rank's
stack. A file that fails to import is reported FAILED with the import error and left out of
the next rounds (with ``-x`` pytest stops at it before running any test).

Environment: ``MCORE_PPO_TEST_DIST_BACKEND`` (gloo: the CPUs, GPUs hidden | nccl: one GPU per
rank), ``MCORE_PPO_TEST_BACKEND`` (head backend), ``MCORE_PPO_TEST_TIMEOUT`` (per-test watchdog,
s), ``MCORE_PPO_TEST_SEED``. Exit status 0 only when no test failed or hung. The summary gives
each file's outcomes and test time (max over ranks) and each torchrun group's wall time, whose
remainder is start-up and teardown. ``--out`` keeps every rank's log, the results files and a
JSON summary; the final error table merges every file's largest relative errors.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# `python scripts/run_distributed_tests.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.reports import error_table, merge_errors

_OUTCOME = re.compile(r"^(PASSED|FAILED|SKIPPED|ERROR|XFAILED|XPASSED|PEERLOST) (collect|setup|call|teardown) (\S+)$")
# PEERLOST: the rank failed only because another rank's process went away inside a collective
# (tests/distributed/conftest.py). It never decides a test on its own while another rank hung.
_WORST = {"PASSED": 0, "XFAILED": 0, "SKIPPED": 1, "XPASSED": 2, "PEERLOST": 3, "FAILED": 4, "ERROR": 4}


@dataclass
class RankLog:
    """One rank's results file of one round: tests started, outcomes, failure reports, anything else (stacks)."""

    collected: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    outcome: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # test -> its time on this rank
    reports: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


def parse_rank_log(path: str) -> RankLog:
    log = RankLog()
    if not os.path.exists(path):
        return log
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("COLLECTED "):
            log.collected.append(line[10:])
        elif line.startswith("START "):
            log.started.append(line[6:])
        elif line.startswith("TIME "):
            with contextlib.suppress(ValueError):
                took, nodeid = line[5:].split(" ", 1)
                log.seconds[nodeid] = float(took)
        elif match := _OUTCOME.match(line):
            status, when, nodeid = match.groups()
            status = "FAILED" if status == "ERROR" else status
            # a test's outcome: the worst of its phases (a passing call with a failing teardown fails)
            if when == "call" or status != "PASSED":
                previous = log.outcome.get(nodeid, "PASSED")
                log.outcome[nodeid] = max(previous, status, key=_WORST.__getitem__)
        elif line.startswith("--- rank "):
            block = [line]
            i += 1
            while i < len(lines) and lines[i] != "---":
                block.append(lines[i])
                i += 1
            log.reports.append("\n".join(block))
        elif line.strip():
            log.other.append(line)
        i += 1
    return log


def _print_reports(ranks: list[RankLog]) -> None:
    """Every rank's failure reports, each distinct text once with the ranks that gave it."""
    seen: dict[str, list[int]] = {}
    for rank, log in enumerate(ranks):
        for report in log.reports:
            body = re.sub(r" at 0x[0-9a-f]+", "", report.split("\n", 1)[1] if "\n" in report else "")
            header = report.split("\n", 1)[0].split(" ", 3)[-1]
            seen.setdefault(f"{header}\n{body}", []).append(rank)
    for text, ranks_with_it in seen.items():
        header, body = text.split("\n", 1)
        print(f"--- rank(s) {','.join(map(str, ranks_with_it))}: {header}\n{body}")


def _all_deselected(rank0_stdout: list[str]) -> bool:
    """pytest's report of a round with nothing left to run (every test deselected: exit 5)."""
    text = _tail(rank0_stdout[0], 5) if rank0_stdout else ""
    return re.search(r"^\d+ deselected in ", text, re.MULTILINE) is not None


def _run(cmd: list[str], env: dict[str, str], timeout: float, stdout_path: str) -> int:
    """``cmd`` in its own session, killed with its whole process group after ``timeout`` s."""
    with open(stdout_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except BaseException as stop:  # the backstop, or this runner stopped (Ctrl-C, SIGTERM): no rank outlives it
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if not isinstance(stop, subprocess.TimeoutExpired):
                raise
            return 124


def _tail(path: str, n: int) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def _file_of(nodeid: str) -> str:
    """The test file's name in a node id (``tests/distributed/test_x.py::test_y`` -> ``test_x.py``).
    Names are unique within a round: pytest refuses two test modules of one name."""
    return os.path.basename(nodeid.split("::", 1)[0])


def run_group(paths: list[str], args: argparse.Namespace, workdir: str, label: str) -> dict:
    """Every test of ``paths`` to an outcome, in one torchrun per round (one start-up and one
    rendezvous for all the files) and as many rounds as failures need; the outcomes per file."""
    outcomes: dict[str, str] = {}
    seconds: dict[str, float] = {}  # test -> its time (max over ranks)
    collected: set[str] = set()
    notes: list[str] = []
    reports: list[dict] = []
    start = time.monotonic()
    todo = list(paths)  # files still run (a file that fails to import is not run again)
    for round_no in range(1, args.max_rounds + 1):
        round_dir = os.path.join(workdir, f"{label}.round{round_no}")
        os.makedirs(round_dir, exist_ok=True)
        env = dict(os.environ)
        env["MCORE_PPO_TEST_RESULTS_DIR"] = round_dir
        env["MCORE_PPO_ERROR_REPORT"] = os.path.join(round_dir, "errors.json")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if args.backend != "nccl":
            # gloo: the suite runs on the CPUs (conftest.DEVICE) and Megatron through the CPU
            # shims, which are for processes that see no GPU. So on a GPU machine the gloo suite
            # (the README's test command) hides the GPUs, and runs exactly as the CPU CI does.
            env["CUDA_VISIBLE_DEVICES"] = ""
        deselect = [f"--deselect={nodeid}" for nodeid in outcomes if "::" in nodeid]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            "--log-dir", os.path.join(round_dir, "torchrun"), "--redirects", "3",
            "-m", "pytest", *todo, "-q", "-rs", "-x", "--disable-warnings", "-p", "no:cacheprovider",
            *deselect, *args.pytest_args,
        ]  # fmt: skip
        print(f"-- {label} round {round_no}: {len(todo)} file(s) in one torchrun", flush=True)
        round_start = time.monotonic()
        status = _run(cmd, env, args.file_timeout * len(todo), os.path.join(round_dir, "torchrun.out"))
        round_s = time.monotonic() - round_start
        ranks = [parse_rank_log(os.path.join(round_dir, f"rank{r}.log")) for r in range(args.nproc)]
        rank0_out = sorted(glob.glob(os.path.join(round_dir, "torchrun", "**", "0", "stdout.log"), recursive=True))
        if rank0_out:
            print(_tail(rank0_out[0], args.tail * len(todo)), end="")
        with contextlib.suppress(OSError, ValueError):
            with open(env["MCORE_PPO_ERROR_REPORT"]) as f:
                reports.append(json.load(f).get("errors", {}))
        _print_reports(ranks)
        for rank, log in enumerate(ranks):
            # Stacks matter where a test started but never finished on this rank (a hang, a kill).
            if status != 0 and log.other and set(log.started) - log.outcome.keys():
                print(f"--- rank {rank}, {label} round {round_no}: stack dumps and other output ---")
                print("\n".join(log.other[-args.tail :]))
        for log in ranks:
            collected.update(log.collected)
            for nodeid, s in log.seconds.items():
                seconds[nodeid] = max(seconds.get(nodeid, 0.0), s)
        # A file that failed to import (or was skipped whole): its outcome, and no later round.
        modules = {n: o for log in ranks for n, o in log.outcome.items() if "::" not in n}
        outcomes.update(modules)
        broken = {_file_of(n) for n, o in modules.items() if o == "FAILED"}
        todo = [p for p in todo if os.path.basename(p) not in broken]
        started_anywhere = {n for log in ranks for n in log.started}
        finished = {}
        for nodeid in started_anywhere:
            seen = [log.outcome[nodeid] for log in ranks if nodeid in log.outcome]
            if any(s == "FAILED" for s in seen) or len(seen) == args.nproc:
                worst = max(seen, key=_WORST.__getitem__)
                finished[nodeid] = "FAILED" if worst == "PEERLOST" else worst
        outcomes.update(finished)
        test_s = sum(seconds.get(n, 0.0) for n in started_anywhere)
        print(f"-- {label} round {round_no}: {round_s:.0f} s, of which tests {test_s:.0f} s", flush=True)
        if status == 0 or not todo or (not started_anywhere and _all_deselected(rank0_out)):
            break
        # Started on every rank, finished on fewer than all (and failed on none by itself): a hang, or a
        # crash inside it. Not re-run.
        stuck = [n for n in started_anywhere - finished.keys() if all(n in log.started for log in ranks)]
        for nodeid in stuck:
            outcomes[nodeid] = "HUNG" if status == 124 or any(log.other for log in ranks) else "CRASHED"
        if all(n in outcomes for log in ranks for n in log.collected) and any(log.collected for log in ranks):
            break  # every test collected in this round has its outcome: nothing left to re-run
        if not finished and not stuck and not modules:
            notes.append(f"round {round_no}: torchrun exited {status} before any test finished")
            print(_tail(os.path.join(round_dir, "torchrun.out"), args.tail), end="")
            for path in todo:
                name = os.path.basename(path)
                if any(_file_of(n) == name and n not in outcomes for n in collected) or not any(
                    _file_of(n) == name for n in outcomes
                ):
                    outcomes[f"{path} (collection or start-up)"] = "CRASHED"
            break
    files = []
    for path in paths:
        name = os.path.basename(path)
        mine = {n: o for n, o in outcomes.items() if _file_of(n) == name}
        counts: dict[str, int] = {}
        for outcome in mine.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        test_s = sum(s for n, s in seconds.items() if _file_of(n) == name)
        files.append({"file": path, "seconds": round(test_s, 1), "counts": counts, "outcomes": mine})
    return {
        "group": label,
        "rounds": round_no,
        "seconds": round(time.monotonic() - start, 1),
        "files": files,
        "notes": notes,
        "errors": merge_errors(reports),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files (default: tests/distributed/test_*.py)")
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("MCORE_PPO_TEST_RANKS", "4")))
    parser.add_argument("--out", help="keep logs and a JSON summary here (default: a temporary folder)")
    parser.add_argument(
        "--files-per-round", type=int, default=0, help="test files per torchrun (default 0: all in one)"
    )
    parser.add_argument(
        "--file-timeout", type=float, default=1200.0, help="backstop of a torchrun round, s per file in it"
    )
    parser.add_argument("--max-rounds", type=int, default=20)
    parser.add_argument("--tail", type=int, default=60, help="lines of rank 0's report shown per round")
    args = parser.parse_args(argv)
    args.pytest_args = pytest_args
    args.files = args.files or sorted(glob.glob("tests/distributed/test_*.py"))
    args.backend = os.environ.get("MCORE_PPO_TEST_DIST_BACKEND", "gloo")  # what conftest.py reads
    return args


def rounds_of(files: list[str], per_round: int) -> list[list[str]]:
    """The files in groups of ``per_round`` (0: all in one), each group one torchrun per round."""
    size = per_round if per_round > 0 else max(1, len(files))
    return [files[i : i + size] for i in range(0, len(files), size)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (scripts/test.sh stopped) ends the runner like Ctrl-C: the running torchrun, in its
    # own session, is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        workdir = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="mcore_ppo_dist_"))
        os.makedirs(workdir, exist_ok=True)
        start = time.monotonic()
        groups = []
        for number, paths in enumerate(rounds_of(args.files, args.files_per_round), 1):
            label = f"group{number}"
            print(f"== {label}: {len(paths)} file(s), torchrun, {args.nproc} ranks ({args.backend})", flush=True)
            for path in paths:
                print(f"   {path}")
            groups.append(run_group(paths, args, workdir, label))
        total: dict[str, int] = {}
        print(f"\n== distributed suite summary: {args.nproc} ranks ({args.backend}), {time.monotonic() - start:.0f} s")
        for group in groups:
            tests_s = sum(r["seconds"] for r in group["files"])
            print(
                f"{group['group']}: {len(group['files'])} file(s), {group['seconds']:.0f} s in "
                f"{group['rounds']} torchrun round(s) (tests {tests_s:.0f} s, the rest start-up and teardown)"
            )
            for r in group["files"]:
                for outcome, n in r["counts"].items():
                    total[outcome] = total.get(outcome, 0) + n
                counts = ", ".join(f"{n} {o.lower()}" for o, n in sorted(r["counts"].items())) or "no test"
                print(f"{r['file']:<52} {counts} (tests {r['seconds']:.0f} s)")
                for nodeid, outcome in sorted(r["outcomes"].items()):
                    if outcome not in ("PASSED", "SKIPPED", "XFAILED"):
                        print(f"    {outcome}: {nodeid}")
            for note in group["notes"]:
                print(f"    {note}")
        errors = merge_errors([g["errors"] for g in groups])
        if errors:
            print("\nlargest normwise relative error, max over ranks and files:")
            print("\n".join(error_table(errors)))
        line = ", ".join(f"{n} {o.lower()}" for o, n in sorted(total.items()))
        print(f"\n{line} ({args.nproc} ranks, {args.backend})")
        if args.out:
            with open(os.path.join(workdir, "summary.json"), "w") as f:
                json.dump({"ranks": args.nproc, "backend": args.backend, "groups": groups, "total": total}, f, indent=1)
    bad = sum(n for o, n in total.items() if o not in ("PASSED", "SKIPPED", "XFAILED"))
    return 1 if bad or not total else 0


if __name__ == "__main__":
    sys.exit(main())
