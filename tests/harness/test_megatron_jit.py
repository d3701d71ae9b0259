"""The harness leaves Megatron's ``jit_fuser`` helpers undecorated on CPU (mcore_ppo_testing.megatron_jit)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# A new interpreter that imports Megatron without the harness.
PROBE = """
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu
print(jit.jit_fuser.__name__, "compiled" if hasattr(fused_bias_gelu.bias_gelu, "__wrapped__") else "plain")
"""


def _fresh() -> str:
    """What :data:`PROBE` reports."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _state(jit: object, fusions: object) -> str:
    return f"{jit.jit_fuser.__name__} {'compiled' if hasattr(fusions.bias_gelu, '__wrapped__') else 'plain'}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the hook is for machines without CUDA")
def test_harness_import_leaves_megatron_fusions_plain_on_cpu():
    """Here (the suite's conftest imports the harness before Megatron) Megatron's fuser is its own
    no-op decorator and a fused helper a plain function; a new interpreter importing Megatron
    without the harness gets them wrapped by ``torch.compile`` (so the check tells the two apart)."""
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_gelu

    assert _state(jit, fused_bias_gelu) == "noop_decorator plain"
    assert _fresh() == "compile compiled"


def test_no_hook_once_megatron_is_imported():
    """Imported after Megatron, the hook installs nothing (the fusions are decorated already)."""
    import megatron.core  # noqa: F401

    from mcore_ppo_testing.megatron_jit import skip_megatron_jit_on_cpu

    assert skip_megatron_jit_on_cpu() is False
