"""The README's Python examples run as written (on this machine's CPU, in a fresh interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)


@pytest.mark.slow  # a fresh interpreter per block
def test_readme_python_examples_run():
    blocks = _python_blocks()
    assert len(blocks) >= 3  # the API, the head module, the CP labels
    # Each block in its own interpreter, as a reader would paste it; on the CPU whatever the host has.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""
    for number, code in enumerate(blocks, 1):
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        assert done.returncode == 0, f"README python block {number} failed:\n{code}\n{done.stderr[-3000:]}"
