"""The plumbing of scripts/ab_timing.sh, on a CPU: a GPU call is scarce, a typo in the script
must not be what it finds.

- a bad action, an unknown step or a tree not prepared is refused before anything runs (exit 2);
- ``prepare`` puts a commit's tree, without its tests and docs, where ``run`` reads it, with this
  tree's ``head_time.py``;
- ``run`` visits the trees in B A A B order, B's visits in B's tree, each visit's output in a
  folder of its own packed into one archive, one row per visit in ``steps.tsv``; a visit the
  whole-call budget cannot fit is skipped and said so.

A ``python3`` shim stands in for the measurements: it records where it ran and what it was given.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # git archive and bash start-ups

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ab_timing.sh"


def _script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    shim = tmp_path / "bin" / "python3"
    if not shim.exists():
        shim.parent.mkdir()
        shim.write_text('#!/usr/bin/env bash\necho "ran in $PWD with: $*" >> "$SHIM_LOG"\n')
        shim.chmod(0o755)
    full_env = {
        **os.environ,
        "PATH": f"{shim.parent}:{os.environ['PATH']}",
        "SHIM_LOG": str(tmp_path / "shim.log"),
        "AB_DIR": str(tmp_path / "trees"),
        "OUT": str(tmp_path / "out"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=full_env
    )


def _rows(tmp_path: Path) -> list[list[str]]:
    return [line.split("\t") for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]


def test_bad_requests_are_refused_before_anything_runs(tmp_path):
    assert _script(tmp_path).returncode == 2
    assert _script(tmp_path, "measure", "HEAD").returncode == 2
    missing = _script(tmp_path, "run", "HEAD")
    assert missing.returncode == 2 and "prepare" in missing.stderr
    assert _script(tmp_path, "prepare", "HEAD").returncode == 0
    unknown = _script(tmp_path, "run", "HEAD", "gpu", "bogus")
    assert unknown.returncode == 2 and "unknown step bogus" in unknown.stderr
    assert not (tmp_path / "shim.log").exists() and not (tmp_path / "out").exists()


def test_run_visits_both_trees_in_turn(tmp_path):
    prepared = _script(tmp_path, "prepare", "HEAD")
    assert prepared.returncode == 0, prepared.stderr
    tree = tmp_path / "trees" / "HEAD"
    assert (tree / "mcore_ppo" / "__init__.py").exists() and not (tree / "tests").exists()
    assert (tree / "scripts" / "head_time.py").read_text() == (ROOT / "scripts" / "head_time.py").read_text()
    done = _script(tmp_path, "run", "HEAD", "gpu", "host", AB_SHARDS="qwen7b:8")
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path)
    names = [row[0] for row in rows]
    assert names == ["env", "gpu_B1", "gpu_A1", "gpu_A2", "gpu_B2", "host_B1", "host_A1", "host_A2", "host_B2"]
    assert all(row[1] == "0" for row in rows), rows
    runs = (tmp_path / "shim.log").read_text().splitlines()
    measured = [line for line in runs if "scripts/" in line]
    assert len(measured) == 8
    for line, name in zip(measured, names[1:], strict=True):
        assert (f"ran in {tree} " in line) == name.startswith(("gpu_B", "host_B")), (name, line)
        assert ("head_time.py --shards qwen7b:8" in line) == name.startswith("gpu"), line
        assert ("--tp-combine" in line) == (name == "host_A2"), line
        assert f"visits/{name}" in line, line
    with tarfile.open(tmp_path / "out" / "ab_timing.tgz") as packed:
        assert {f"visits/{name}/log.txt" for name in names} <= set(packed.getnames())


def test_visits_past_the_budget_are_skipped(tmp_path):
    assert _script(tmp_path, "prepare", "HEAD").returncode == 0
    done = _script(tmp_path, "run", "HEAD", "host", AB_BUDGET_S="20")
    assert done.returncode == 0, done.stderr
    assert [row[1] for row in _rows(tmp_path)] == ["skipped"] * 5
