#!/usr/bin/env bash
# GPU suite for the lent H200 (Python 3.12, torch, triton, pytest there; no megatron-core):
# the single-process suite (model, head, kernel, verl tests) on CUDA, once per carried megatron-core wheel,
# so megatron-core >= 0.18 runs the real `output_processor` hook path (and the tests force the
# fallback path on it too) and an older one runs the fallback path (and the emulated hook).
#
# Wheels (Python 3.12, x86-64), both folders git-ignored, filled by
# `scripts/fetch_gpu_wheels.sh [MEGATRON_LM_DIR]` (that script lists them and says why):
#   .whl/   verl 0.9.1 and every other package the suite imports beyond torch, triton, numpy, pandas
#           and pyarrow (the GPU image's), with what they require, and setuptools to build mcore_ppo
#           (for its verl.plugins entry point): installed in every round
#   .carry/ megatron_core-*.whl: 0.19.0 from PyPI, and 0.20.0 (not on PyPI yet) built from a
#           Megatron-LM main checkout (d98e8a64 here) as a pure wheel, one round each
# Before the tests each round imports every module the suite needs and stops, naming the missing
# ones, if one does not import: no test fails or skips for a package left behind.
# One command through the device tool:
#   run(command="bash scripts/gpu_suite.sh", carry=[".whl", ".carry"])
# Extra arguments go to pytest. Each round's log is written to $OUT (or /tmp) as gpu_suite_<version>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_suite: CUDA is not available on this machine" >&2
  exit 2
fi
shopt -s nullglob
# Folders of carried wheels (override with GPU_SUITE_WHEEL_DIRS="dir1 dir2").
read -r -a wheel_dirs <<< "${GPU_SUITE_WHEEL_DIRS:-.whl .carry}"
mcore_wheels=() all_wheels=()
for dir in "${wheel_dirs[@]}"; do
  mcore_wheels+=("$dir"/megatron_core-*.whl)
  all_wheels+=("$dir"/*.whl)
done
other_wheels=()
for wheel in "${all_wheels[@]}"; do
  case "$(basename "$wheel")" in megatron_core-*) ;; *) other_wheels+=("$wheel") ;; esac
done
if [ ${#mcore_wheels[@]} -eq 0 ]; then
  echo "gpu_suite: no megatron_core-*.whl in ${wheel_dirs[*]} (carry them with the run)" >&2
  exit 2
fi
# The whole single-process suite, as the README's one-GPU section runs it; GPU_SUITE_TESTS narrows
# it (e.g. the files that differ between megatron-core versions: "tests/test_model_integration.py
# tests/test_mtp.py tests/test_verl_*.py tests/test_megatron_versions.py").
read -r -a tests <<< "${GPU_SUITE_TESTS:-tests --ignore=tests/distributed}"
logs=${OUT:-/tmp}
status=0
for wheel in "${mcore_wheels[@]}"; do
  version=$(basename "$wheel" | cut -d- -f2)
  # GPU_SUITE_MCORE_VERSIONS="0.20.0 ...": only these rounds (default: every carried wheel).
  if [ -n "${GPU_SUITE_MCORE_VERSIONS:-}" ] && [[ " $GPU_SUITE_MCORE_VERSIONS " != *" $version "* ]]; then
    continue
  fi
  site=/tmp/gpu_suite_site_$version
  echo "== megatron-core $version ($wheel) + ${other_wheels[*]:-no other wheels}"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheel" "${other_wheels[@]}"; then
    echo "gpu_suite: installing $wheel failed" >&2
    status=1
    continue
  fi
  # mcore_ppo itself, built from this tree with the carried setuptools (the same code as on the
  # path), so that verl finds its verl.plugins entry point (tests/integrations/test_verl_real.py).
  if ! PYTHONPATH="$site" python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --upgrade --target "$site" .; then
    echo "gpu_suite: installing mcore_ppo from this tree failed" >&2
    status=1
    continue
  fi
  PYTHONPATH="$site:$PWD" python3 - <<'EOF'
import inspect

import megatron.core
import torch
from megatron.core.models.gpt import GPTModel

hook = "output_processor" in inspect.signature(GPTModel.forward).parameters
print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
      f"GPTModel.forward has output_processor: {hook} -> default path: {'hook' if hook else 'fallback'}")
import importlib
import importlib.metadata as md
import importlib.util
import sys

for name in ("triton", "verl", "transformers", "tensordict", "liger-kernel", "peft", "datasets", "hypothesis"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: not installed")
# What the suite imports (verl is imported by the tests with a Ray stand-in: found is enough).
needed = ("transformers", "tensordict", "omegaconf", "codetiming", "orjson", "peft", "datasets", "PIL", "einops",
          "mbridge", "liger_kernel", "hypothesis", "yaml", "numpy", "pandas", "pyarrow")
missing = [] if importlib.util.find_spec("verl") else ["verl"]
for module in needed:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:  # a package left behind
        missing.append(f"{module} (no module {err.name})")
    except Exception as err:  # not a missing package: the tests that import it say more
        print(f"gpu_suite: importing {module} raises {type(err).__name__}: {err}", file=sys.stderr)
if missing:
    print("gpu_suite: not importable here: " + "; ".join(missing) + " (scripts/fetch_gpu_wheels.sh)", file=sys.stderr)
    sys.exit(3)
EOF
  [ "$?" -eq 0 ] || { status=1; continue; }
  PYTHONPATH="$site:$PWD" python3 -m pytest -q -p no:cacheprovider -rs --durations=10 "${tests[@]}" "$@" \
    2>&1 | tee "$logs/gpu_suite_$version.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
