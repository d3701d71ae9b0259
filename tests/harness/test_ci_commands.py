"""CI runs what the README tells a newcomer to run, and nothing more.

The README's two set-up commands (the main job and the tests) are what a user types on a fresh
machine; `.ci/run` must run exactly the test command's steps, plus the linters. An install step
of CI's own would let CI pass where the README's command fails.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What `.ci/run` may run besides the README's commands: the linters, and its own shell set-up.
LINTERS = (("ruff", "check", "."), ("lint-imports",))
SHELL_SETUP = ("set", "cd")


def _readme_commands() -> list[str]:
    """The README's shell commands: the lines of its indented code blocks that run a script."""
    text = (REPO / "README.md").read_text()
    return [line.strip() for line in text.splitlines() if re.match(r"^ {4}bash scripts/", line)]


def _ci_steps() -> list[tuple[str, ...]]:
    """`.ci/run`'s commands, one tuple of words per command (`&&` chains split)."""
    steps = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        for command in line.split("&&"):
            steps.append(tuple(shlex.split(command)))
    return steps


def _steps(command: str) -> list[tuple[str, ...]]:
    return [tuple(shlex.split(part)) for part in command.split("&&")]


def test_readme_has_exactly_the_two_setup_commands():
    commands = _readme_commands()
    assert commands == [
        "bash scripts/install.sh && bash scripts/launch.sh",
        "bash scripts/install.sh && bash scripts/test.sh",
    ], f"the README's set-up commands changed: {commands}"


def test_ci_runs_the_readme_test_command_and_the_linters_only():
    test_command = _readme_commands()[1]
    readme_steps = _steps(test_command)
    ci_steps = [step for step in _ci_steps() if step[0] not in SHELL_SETUP]
    extra = [step for step in ci_steps if step not in readme_steps and step not in LINTERS]
    assert not extra, f".ci/run runs commands the README does not: {[' '.join(s) for s in extra]}"
    # The README's steps, in its order (the linters may sit between them).
    in_order = [step for step in ci_steps if step in readme_steps]
    assert in_order == readme_steps, f".ci/run must run {test_command!r} as written, got {in_order}"


def test_the_scripts_the_readme_names_exist():
    for command in _readme_commands():
        for step in _steps(command):
            assert step[0] == "bash" and (REPO / step[1]).is_file(), f"{' '.join(step)}: no such script"
