"""The record of verl's own trainer with the plugin on and off: ``python -m mcore_ppo_testing.verl_cpu.record``.

Runs every configuration of :data:`MATRIX` (GRPO at TP 1 and TP 2 + SP, on and off; the inert
switch; on repeated; Σπ² and top-k distillation on and off) with one seed, one after another,
and writes to ``--out``: ``metrics.json`` (verl's per-step metrics of every run, the on/off
comparison rows, the bit-for-bit checks, wall times) and ``table.md`` (the per-step table),
plus each run's folder (its ``main_ppo.log`` and records).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mcore_ppo_testing.verl_cpu.assets import make_assets
from mcore_ppo_testing.verl_cpu.compare import STEP_METRICS, equal_runs, metrics_rows
from mcore_ppo_testing.verl_cpu.run import RunConfig, RunResult, load_result, run_main_ppo

__all__ = ["MATRIX", "main", "markdown_table"]

MATRIX = (
    RunConfig(tp=1, plugin="on"),
    RunConfig(tp=1, plugin="off"),
    RunConfig(tp=1, plugin="inert"),
    RunConfig(tp=1, plugin="on", tag="-repeat"),
    RunConfig(tp=2, plugin="on"),
    RunConfig(tp=2, plugin="off"),
    RunConfig(tp=2, plugin="on", tag="-repeat"),
    RunConfig(tp=1, variant="sum_pi", plugin="on"),
    RunConfig(tp=1, variant="sum_pi", plugin="off"),
    RunConfig(tp=1, variant="distill", plugin="on"),
    RunConfig(tp=1, variant="distill", plugin="off"),
)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The per-step rows as a Markdown table (metric columns on/off side by side)."""
    header = ["run", "step", *[f"{key} {side}" for key in STEP_METRICS for side in ("on", "off")]]
    header += ["old log-probs max |on-off|", "old log-probs mean |on-off|", "mean |on-fp32|", "mean |off-fp32|"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the matrix and write the record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--reuse", action="store_true", help="read the runs already under --out, run none")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    assets = None if args.reuse else make_assets(args.out / "assets", seed=args.seed)
    results: dict[str, RunResult] = {}
    walls = json.loads((args.out / "metrics.json").read_text())["runs"] if args.reuse else {}
    for config in MATRIX:
        config = RunConfig(**{**config.__dict__, "seed": args.seed})
        if args.reuse:
            result = load_result(config, args.out, wall_s=walls.get(config.label, {}).get("wall_s", 0.0))
        else:
            result = run_main_ppo(config, args.out, assets)
        results[config.label] = result
        print(f"{config.label}: exit {result.returncode}, {result.wall_s:.0f} s", flush=True)
        if result.returncode != 0:
            print(result.tail(60))
            return 1
    pairs = [("tp1-on", "tp1-off"), ("tp2+sp-on", "tp2+sp-off"), ("tp1-sum_pi-on", "tp1-sum_pi-off")]
    pairs.append(("tp1-distill-on", "tp1-distill-off"))
    rows = [row for on, off in pairs for row in metrics_rows(results[on], results[off])]
    identical = {
        "tp1-inert == tp1-off": equal_runs(results["tp1-inert"], results["tp1-off"]),
        "tp1-on == tp1-on-repeat": equal_runs(results["tp1-on"], results["tp1-on-repeat"]),
        "tp2+sp-on == tp2+sp-on-repeat": equal_runs(results["tp2+sp-on"], results["tp2+sp-on-repeat"]),
    }
    record = {
        "seed": args.seed,
        "runs": {
            label: {"wall_s": r.wall_s, "metrics": r.metrics, "head_calls": r.head_calls}
            for label, r in results.items()
        },
        "on_vs_off": rows,
        "bit_identical": {name: not diffs for name, diffs in identical.items()},
    }
    (args.out / "metrics.json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown_table(rows)
    (args.out / "table.md").write_text(table)
    print(table)
    print(json.dumps(record["bit_identical"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
