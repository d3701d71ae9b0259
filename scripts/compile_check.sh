#!/usr/bin/env bash
# Compiles the kernels for Hopper (sm_90) on a CPU machine with the Triton of the GPU machines,
# before a device call spends GPU time on a kernel that does not compile there:
#
#   bash scripts/compile_check.sh [PYTEST ARGS]
#
# tests/backends/test_kernel_resources.py compiles every GEMM kernel at its default configs and
# every launch of the teacher's top-k for sm_90 through a stand-in driver (no GPU needed), with
# whatever Triton is installed. The CPU machines install the Triton that torch's CPU build pins
# (scripts/install.sh); the lent GPUs run another (3.6.0 with torch 2.11), whose compiler can
# fail where the installed one does not (a tl.cumsum lowering assertion did, 2026-12-07). This
# script makes a venv beside the repository (COMPILE_CHECK_VENV, default /tmp/mcore_ppo_triton_<version>)
# with torch's CPU build and that Triton (COMPILE_CHECK_TRITON, default 3.6.0), and runs those
# tests in it with this tree on the path. The venv is kept for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
triton_version=${COMPILE_CHECK_TRITON:-3.6.0}
venv=${COMPILE_CHECK_VENV:-/tmp/mcore_ppo_triton_$triton_version}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # torch's CPU build as scripts/install.sh picks it; Triton on its own (it does not need torch's CUDA).
  "$venv/bin/python" -m pip install -q "torch==2.13.0" --index-url "${MCORE_PPO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    || "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q "triton==$triton_version" numpy pytest
fi
"$venv/bin/python" -c "import triton; print(f'compile_check: Triton {triton.__version__} ($0)')"
PYTHONPATH="$PWD" TRITON_INTERPRET=0 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/backends/test_kernel_resources.py "$@"
