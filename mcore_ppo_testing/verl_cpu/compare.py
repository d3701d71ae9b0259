"""Comparisons of two ``main_ppo`` runs (plugin on against off), shared by the test and the record.

Log-probs are compared token by token on the response tokens (``response_mask``) of the rows
whose sampled responses are equal in both runs (with equal seeds and weights every row is;
after an update the two actors differ by rounding, which may, rarely, flip a draw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore_ppo_testing.verl_cpu.run import RunResult

__all__ = ["STEP_METRICS", "LogProbGap", "equal_runs", "log_prob_gap", "metrics_rows", "relative_gap"]

# verl's per-step metrics the record's table shows.
STEP_METRICS = ("actor/grad_norm", "actor/entropy", "actor/pg_loss", "actor/ppo_kl")


@dataclass(frozen=True)
class LogProbGap:
    """One step's per-token comparison of two runs' log-probs (and each against the fp32 rollout)."""

    rows_equal: float
    max_abs: float
    mean_abs: float
    a_vs_fp32_mean: float
    b_vs_fp32_mean: float


def relative_gap(a: float, b: float) -> float:
    """``|a − b| / max(|a|, |b|)`` (0 when both are 0)."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def log_prob_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], key: str = "old_log_probs") -> LogProbGap:
    """``a``'s and ``b``'s ``key`` (one step's records) on the response tokens of equal rows."""
    same = (a["responses"] == b["responses"]).all(dim=-1)
    mask = a["response_mask"].bool() & same[:, None]
    diff = (a[key] - b[key]).abs()[mask]
    ref = a["rollout_log_probs"]
    return LogProbGap(
        rows_equal=float(same.float().mean()),
        max_abs=float(diff.max()),
        mean_abs=float(diff.mean()),
        a_vs_fp32_mean=float((a["old_log_probs"] - ref).abs()[mask].mean()),
        b_vs_fp32_mean=float((b["old_log_probs"] - b["rollout_log_probs"]).abs()[mask].mean()),
    )


def equal_runs(a: RunResult, b: RunResult) -> list[str]:
    """What differs between two runs bit for bit: metrics (timings and memory left out) and records."""
    found = []
    for step in sorted(set(a.metrics) | set(b.metrics)):
        ma, mb = a.metrics.get(step, {}), b.metrics.get(step, {})
        for key in sorted(set(ma) | set(mb)):
            if key.startswith(("timing", "perf/")) or "memory" in key:
                continue
            va, vb = ma.get(key), mb.get(key)
            if va != vb and not (_nan(va) and _nan(vb)):
                found.append(f"step {step} {key}: {va} != {vb}")
    for step in sorted(set(a.log_probs) | set(b.log_probs)):
        ra, rb = a.log_probs.get(step, {}), b.log_probs.get(step, {})
        for key in sorted(set(ra) | set(rb)):
            if key not in ra or key not in rb or not torch.equal(ra[key], rb[key]):
                found.append(f"step {step} {key} differs")
    return found


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def metrics_rows(on: RunResult, off: RunResult) -> list[dict[str, Any]]:
    """Per step: each metric of :data:`STEP_METRICS` on and off, and the log-prob comparison."""
    rows = []
    for step in sorted(on.metrics):
        gap = log_prob_gap(on.log_probs[step], off.log_probs[step])
        row: dict[str, Any] = {"run": on.config.label.rsplit("-", 1)[0], "step": step}
        for key in STEP_METRICS:
            row[f"{key} on"] = on.metrics[step].get(key)
            row[f"{key} off"] = off.metrics[step].get(key)
        row.update(
            {
                "old log-probs max |on-off|": gap.max_abs,
                "old log-probs mean |on-off|": gap.mean_abs,
                "mean |on-fp32|": gap.a_vs_fp32_mean,
                "mean |off-fp32|": gap.b_vs_fp32_mean,
                "rows with equal samples": gap.rows_equal,
            }
        )
        if "sum_pi_squared" in on.log_probs[step]:
            row["sum_pi_squared max |on-off|"] = log_prob_gap(
                on.log_probs[step], off.log_probs[step], "sum_pi_squared"
            ).max_abs
        for key in sorted(k for k in off.metrics[step] if k.startswith("actor/distillation/")):
            row[f"{key} on"], row[f"{key} off"] = on.metrics[step].get(key), off.metrics[step][key]
        rows.append(row)
    return rows
