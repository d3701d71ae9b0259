"""The README's Python examples run as written (on this machine's CPU, each in a fresh process)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from mcore_ppo_testing.fork_server import ForkServer

REPO = Path(__file__).resolve().parents[2]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)


@pytest.mark.slow  # a fresh process per block
def test_readme_python_examples_run():
    blocks = _python_blocks()
    assert len(blocks) >= 3  # the API, the options, the head module
    # Each block in a process of its own, as a reader would paste it; on the CPU whatever the host
    # has. torch's and Megatron's imports are not what is checked: the blocks are forks of a server
    # that made them once, the blocks' own imports (mcore_ppo, parallel) fresh in each. On a CUDA
    # host every block gets a new interpreter instead, as a reader's would.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""
    with ForkServer(("torch", "megatron.core"), fork=not torch.cuda.is_available()) as server:
        for number, code in enumerate(blocks, 1):
            done = server.run(code, env=env, cwd=REPO, timeout=900)
            assert done.returncode == 0, f"README python block {number} failed:\n{code}\n{done.stderr[-3000:]}"
