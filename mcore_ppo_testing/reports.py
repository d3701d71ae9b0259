"""Plain-text reports of the multi-rank test suite (the error table printed by rank 0 and by the runner)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping


def _family(output: str) -> str:
    """Per-parameter outputs (names with a dot, e.g. ``Δdecoder.layers.0.mlp...``) share one row."""
    if "." not in output:
        return output
    prefix = output.split(" ", 1)[0] if " " in output else output[0] if output[0] in "Δ∆" else ""
    return f"{prefix} every parameter".strip()


def error_table(errors: Mapping[str, Mapping[str, float]], *, width: int = 100) -> list[str]:
    """One line per (comparison, output) with its largest normwise relative error, per-parameter
    outputs folded into one row (their maximum and count): narrow enough to read in a CI log."""
    name_width = width - 41  # + " " + 28 (output) + " " + 11 (error) = width
    lines = [f"{'comparison':<{name_width}} {'output':<28} {'max rel err':>11}"]
    for kind in sorted(errors):
        folded: dict[str, tuple[float, int]] = {}
        for output, err in errors[kind].items():
            worst, count = folded.get(_family(output), (0.0, 0))
            folded[_family(output)] = (max(worst, err), count + 1)
        for output, (worst, count) in sorted(folded.items()):
            label = output if count == 1 else f"{output} ({count})"
            label = label if len(label) <= 28 else label[:25] + "..."
            name = kind if len(kind) <= name_width else kind[: name_width - 3] + "..."
            lines.append(f"{name:<{name_width}} {label:<28} {worst:>11.2e}")
    return lines


def merge_errors(reports: list[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """The largest error of each (comparison, output) over several reports."""
    merged: dict[str, dict[str, float]] = {}
    for report in reports:
        for kind, outputs in report.items():
            into = merged.setdefault(kind, {})
            for output, err in outputs.items():
                into[output] = max(into.get(output, 0.0), err)
    return merged


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The benchmark scripts' ``--help``: every option's default shown, except where there is
    none to show (None, a flag's False, an empty list) or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, False, []) or "default:" in help_text or "%(default)" in help_text:
            return help_text
        return super()._get_help_string(action)
