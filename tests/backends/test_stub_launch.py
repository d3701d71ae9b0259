"""Every launch site of the triton backend reaches its kept compiled kernel, checked on a CPU.

On a GPU the launcher keeps, per call site, the compiled kernel Triton's dispatch chose and
launches it directly from then on; a site whose arguments do not map onto the compiled kernel's
parameters silently stays on Triton's per-call dispatch (more host work, the same results), which
only a GPU run would show (``tests/gpu/test_gpu_fast_launch.py``). With the launcher's kernels
stubbed (:mod:`mcore_ppo_testing.stub_launch`: the host code runs, no kernel does), a head call
on CPU tensors takes the same launch path. In a process of its own (the suite's kernels are the
interpreter's, which keeps no site), each mode of the head (the probability buffer or the
recompute, a per-token temperature, the statistics' options, fp32 inputs' fp16 parts, ignored
tokens, misaligned rows, ``k`` ids per token, the forward's TP branch) runs a forward with its
backward and a no-grad forward twice: every site of every
launched kernel must be kept (``compiled``), the second step must launch as many kernels as
the first and meet no new site, and the launches made without a site (Triton's dispatch on every
call) must be the mode's known ones (:data:`~mcore_ppo_testing.stub_launch.DISPATCHED`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mcore_ppo_testing.seeds import next_seed
from mcore_ppo_testing.stub_launch import DISPATCHED, MODES

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU checks its real launches")


@pytest.fixture(scope="module")
def levels() -> dict:
    seed = next_seed()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "mcore_ppo_testing.stub_launch", str(seed)],
        capture_output=True, text=True, env=env, cwd=root, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-4000:]}"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_launch_site_is_kept(levels, mode):
    found = levels[mode]
    first, second = found["launches"]
    assert first > 0 and second == first, found
    after_first, after_second = found["levels"]
    assert after_second == after_first, f"the second step met launch sites the first did not: {found}"
    normal = {name: level for name, level in after_second.items() if level != ["compiled"]}
    assert not normal, f"launch sites left on Triton's per-call dispatch: {normal}"
    assert "stats_kernel" in after_second
    assert found["dispatched"] == DISPATCHED[mode], "launches without a site (Triton's dispatch on every call)"
