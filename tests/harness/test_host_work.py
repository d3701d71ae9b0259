"""``scripts/host_work.py --backend null`` and its :class:`~mcore_ppo_testing.null_backend.NullBackend`:
the head's host work above its backend, measured on the CPU (the report's fields, not its times)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends.base import Backend
from mcore_ppo_testing.null_backend import NullBackend

REPO = Path(__file__).resolve().parents[2]


def test_null_backend_is_a_backend_that_the_head_runs_forward_and_backward():
    """Shapes, dtypes and gradients come back as from a real backend; the values are not computed."""
    backend = NullBackend()
    assert isinstance(backend, Backend)
    hidden = torch.randn(6, 3, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (3, 6))
    out = fused_log_probs_and_entropy(hidden, weight, labels, backend=backend, return_sum_pi_squared=True)
    assert [t.shape for t in out] == [(3, 6)] * 3 and all(t.dtype == torch.float32 for t in out)
    (out[0].sum() + out[1].sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    ids = torch.randint(0, 20, (3, 6, 4))
    log_q, _ = fused_log_probs_and_entropy(hidden.detach(), weight.detach(), ids, backend=backend)
    assert log_q.shape == (3, 6, 4)


def test_host_work_above_the_backend_on_the_cpu(tmp_path):
    done = subprocess.run(
        # validate off: on the CPU the value checks read the labels (aten ops of their own).
        [sys.executable, str(REPO / "scripts" / "host_work.py"), "--backend", "null", "--reps", "3", "--no-validate",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # the CPU's shapes even on a GPU machine
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "host_work.json").read_text())
    for key in ("nograd_forward_host_ms_steady", "forward_host_ms_steady", "backward_host_ms_steady"):
        assert report[key] > 0, key
    # The node's own part is a difference of two timings (the backward less a no-op node's): with
    # a null backend it is near zero, of either sign on a loaded host. It is reported, and finite.
    assert math.isfinite(report["backward_node_host_ms_steady"])
    assert report["backward_node_host_ms_steady"] == pytest.approx(
        report["backward_host_ms_steady"] - report["autograd_noop_backward_ms_steady"]
    )
    # The head's op and nothing else: a null backend dispatches no aten op of its own but allocations.
    assert report["per_call_counts"]["nograd_forward"]["ops"] == {"head_forward.default": 1}
    assert "by own time" in (tmp_path / "host_profile.txt").read_text()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_call_files_lists_the_product_files_of_one_call(backend):
    """``scripts/call_files.py``: the files a call's forward and backward enter, the op boundary
    and the backend's own among them, the kernels' module left out; the first call of a
    signature takes the checks (the verdict), a later one does not."""
    if backend == "triton":
        pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "call_files.py"), "--backend", backend, "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = json.loads(done.stdout)
    own = f"backends/{backend}_backend.py"
    for phase in ("forward_first", "forward", "backward"):
        assert {"ops.py", "shard.py", own} <= set(files[phase]), (phase, files[phase])
        assert not any(name.startswith("kernels/") for name in files[phase]), files[phase]
    assert "head_call.py" in files["forward"] and "head_call.py" not in files["backward"]
    assert "check_call" in files["forward_first"]["head_call.py"]
    assert "check_call" not in files["forward"]["head_call.py"]
