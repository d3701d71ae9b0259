"""The plumbing of scripts/multi_gpu_suite.sh, on a CPU: a GPU call is scarce, a typo in the
script must not be what it finds.

- an unknown step is refused before anything runs (exit 2, the known steps listed);
- a step that fails (here ``tp`` on an empty vocab, which the head refuses; on a CPU bench_tp
  fails earlier still, without NCCL) is reported as FAILED in the summary with its log kept,
  the next step still runs, and the script exits 1;
- a step the whole-call budget cannot fit is skipped and said so.

The script's two host probes (the GPU count, the libraries' versions for host.txt) only describe
the machine and cost a torch and Megatron import each: a ``python3`` shim answers them, and runs
every other command (the steps) with this interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bash, torchrun and benchmark start-ups

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scripts" / "multi_gpu_suite.sh"


def _suite(tmp_path: Path, *steps: str, **env: str) -> subprocess.CompletedProcess:
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        "  *device_count*) echo 0 ;;\n"
        "  *megatron.core*) echo 'versions: not probed (test shim)' ;;\n"
        f'  *) exec "{sys.executable}" "$@" ;;\n'
        "esac\n"
    )
    shim.chmod(0o755)
    environ = dict(
        os.environ,
        PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        MGPU_NPROC="1",  # no GPU here: one rank, as MGPU_NPROC lets a user pick
        MGPU_SKIP_INSTALL="1",
        MGPU_WORK=str(tmp_path / "work"),
        OUT=str(tmp_path / "out"),
        **env,
    )
    return subprocess.run(
        ["bash", str(SUITE), *steps], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900
    )


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    proc = _suite(tmp_path, "tests", "bogus")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown step 'bogus'" in proc.stderr and "tp" in proc.stderr
    assert not (tmp_path / "work" / "host.txt").exists()


def test_failed_step_is_reported_and_the_next_still_runs(tmp_path):
    proc = _suite(tmp_path, "tp", MGPU_TP_SHAPES="64x0 32x0", MGPU_TIMEOUT_TP="120")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "multi_gpu_suite summary: 1 ranks" in summary, summary
    for name, log in (("tp1_h64", "bench_tp1_64x0.log"), ("tp1_h32", "bench_tp1_32x0.log")):
        line = next((row for row in summary.splitlines() if row.startswith(name)), "")
        assert "FAILED (exit" in line and log in line, summary
        assert (tmp_path / "work" / log).stat().st_size > 0
    assert (tmp_path / "out" / "mgpu_logs.tgz").exists()


def test_step_past_the_budget_is_skipped(tmp_path):
    proc = _suite(tmp_path, "ppo", MGPU_BUDGET_S="10")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert any(row.startswith("ppo") and "SKIPPED (budget)" in row for row in summary.splitlines()), summary
