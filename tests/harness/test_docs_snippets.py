"""Every ```python block of the README and ``docs/*.md`` runs as written, from a checkout's root.

Each block runs in a process of its own, as a reader pasting it into ``python`` at the root would
(``python -c``, the root on ``sys.path``), with a timeout, on the CPU: torch's and Megatron's
imports are not what is checked, so on a CPU host the blocks are forks of a server that made
them once (:mod:`mcore_ppo_testing.fork_server`), the blocks' own imports fresh in each; on a CUDA
host each block gets a new interpreter, as a reader's would. A block that cannot run on a CPU
starts with ``# needs: CUDA ...``: it runs here where a GPU is visible (the GPU suite) and is
skipped, saying so, elsewhere. Quoted upstream code belongs in a ```text block, not a Python one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mcore_ppo_testing.fork_server import ForkServer

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A fenced block, possibly indented (a list item's): its fence's indentation, then its lines.
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", flags=re.DOTALL | re.MULTILINE)
NEEDS = re.compile(r"# needs: (\S+)")


def _blocks() -> list[tuple[str, str]]:
    """``(page#number, code)`` of every Python block, numbered from 0 per page."""
    found = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text())):
            found.append((f"{page.relative_to(REPO)}#{number}", textwrap.dedent(match.group(2))))
    return found


BLOCKS = _blocks()


def _needs(code: str) -> str | None:
    """What a block's first line says it needs (``# needs: CUDA ...``), or None."""
    found = NEEDS.match(code.lstrip().splitlines()[0]) if code.strip() else None
    return found.group(1).rstrip(";,") if found else None


@pytest.fixture(scope="module")
def server():
    with ForkServer(("torch", "megatron.core"), fork=not torch.cuda.is_available()) as forks:
        yield forks


def test_every_page_with_examples_is_covered():
    """The README's three blocks and the docs' are all collected (a fence the pattern misses would
    leave a block unchecked)."""
    pages = {name.split("#")[0] for name, _ in BLOCKS}
    assert sum(name.startswith("README.md#") for name, _ in BLOCKS) >= 3  # the API, the options, the module
    for page in PAGES:
        fences = page.read_text().count("```python")
        assert fences == sum(name.startswith(f"{page.relative_to(REPO)}#") for name, _ in BLOCKS), page
        assert fences == 0 or str(page.relative_to(REPO)) in pages


@pytest.mark.slow  # a fresh process per block
@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs_as_written(name, code, server):
    needs = _needs(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if needs is None:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, whatever the host has
        done = server.run(code, env=env, cwd=REPO, timeout=900)
    else:
        assert needs == "CUDA", f"{name}: '# needs: {needs}' is not something this test provides (CUDA)"
        if not torch.cuda.is_available():
            pytest.skip(f"{name} needs CUDA; it runs in the GPU suite")
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
        )
    assert done.returncode == 0, f"{name} failed:\n{code}\n{done.stderr[-3000:]}"
