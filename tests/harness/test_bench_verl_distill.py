"""``scripts/bench_verl_distill.py --smoke``: the GPU benchmark's logic on the CPU at a tiny shape
(its three routes, their KL against verl's logits path's, rank 0 of TP 8 with the ids spread over the
shards, the longest-sequence search, the report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mcore_ppo_testing.real_verl import RAY_STANDIN, require_verl

require_verl()

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_every_route(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(RAY_STANDIN), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_verl_distill.py"), "--smoke", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_verl_distill.json").read_text())
    assert [row["tp"] for row in report["step"]] == [1, 8]
    one_rank, of_eight = report["step"]
    for impl in ("fused", "verl_logits", "verl_chunked"):
        assert one_rank[impl]["kl_max_rel_vs_verl_logits"] < 1e-5
        assert one_rank[impl]["d_hidden_normwise_vs_verl_logits"] < 1e-5
    # At TP 8 the process is rank 0 of a fake group: its shard, global ids (about an eighth of the
    # 64 × 8 teacher ids in the shard, not all of them), no KL to compare, verl's FSDP-only chunked
    # loss left out.
    assert one_rank["teacher_ids_in_shard"] == 1.0 and 0.05 < of_eight["teacher_ids_in_shard"] < 0.25
    assert "verl_chunked" not in of_eight and of_eight["fused"]["kl_max_rel_vs_verl_logits"] is None
    for row in report["step"]:
        for impl in ("fused", "verl_logits", "verl_chunked")[: 3 if row["tp"] == 1 else 2]:
            assert row[impl]["ms"] > 0
            assert row[impl]["ratio_to_gemm4"] == row[impl]["ms"] / row["gemm4_ms"]
        assert row["gemm4_ms"] > 0 and row["student_topk_ms"] > 0
    assert [r["impl"] for r in report["longest"]] == ["fused", "verl_logits", "verl_chunked"]
    # On the CPU nothing runs out of memory: every route reaches the smoke run's cap.
    assert all(r["longest_fitting"] == 64 and r["first_not_fitting"] is None for r in report["longest"])
    assert "| fused |" in (tmp_path / "bench_verl_distill.md").read_text()
