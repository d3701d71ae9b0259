#!/usr/bin/env bash
# Installs mcore_ppo and everything its demo and tests need (Python 3.11 on a CPU machine; on a
# GPU machine it keeps the GPU stack it finds). The README's two commands and CI run this and
# nothing else: a test (tests/harness/test_ci_commands.py) keeps `.ci/run` to those commands.
#
# torch comes first, as a CPU build of exactly 2.13.0, so nothing later floats it to a CUDA build:
#   - a GPU build of torch already installed (CUDA or ROCm, any version) is kept, with the triton
#     it came with, and so is an installed megatron-core the package supports (0.16.1 – 0.20.x):
#     a GPU machine keeps its stack (README, "On GPUs"); only what is missing is added;
#   - a torch 2.13.0 already installed is kept;
#   - else, when pip's configured sources (a wheel folder, a CPU index set up on the machine) offer
#     a CPU build of 2.13.0 ("+cpu", or no nvidia-* requirements), that one;
#   - else PyTorch's CPU wheel index (PyPI's Linux torch wheels are CUDA builds, ~GBs):
#     https://download.pytorch.org/whl/cpu, or MCORE_PPO_TORCH_INDEX if set.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=2.13.0
# The CPU pins (CI reproducibility); a GPU machine's own stack replaces them below.
stack=(triton==3.7.1 megatron-core==0.16.1)
if python -c "import sys, torch; sys.exit(not (torch.version.cuda or torch.version.hip))" 2>/dev/null; then
  echo "install.sh: keeping the GPU build torch $(python -c 'import torch; print(torch.__version__)') and its triton"
  # triton 3.7.1 is the CPU torch 2.13.0's; a GPU torch requires its own (kept, or added unpinned).
  stack=("megatron-core>=0.16.1,<0.21")
  python -c "import triton" 2>/dev/null || stack+=(triton)
elif python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  echo "install.sh: keeping torch $(python -c 'import torch; print(torch.__version__)')"
else
  report=$(mktemp)
  # A CPU build: "+cpu" in its file name (URL-quoted in the report), or no nvidia-* requirement.
  if python -m pip install -q --dry-run --no-deps --ignore-installed --report "$report" "torch==$torch_version" 2>/dev/null &&
    python -c "
import json, sys, urllib.parse
item = json.load(open(sys.argv[1]))['install'][0]
cpu_name = '+cpu' in urllib.parse.unquote(item['download_info']['url'])
cuda_deps = any(r.startswith('nvidia-') for r in item['metadata'].get('requires_dist', []))
sys.exit(0 if cpu_name or not cuda_deps else 1)
" "$report"; then
    python -m pip install -q "torch==$torch_version"
  else
    python -m pip install -q "torch==$torch_version" --index-url "${MCORE_PPO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
  rm -f "$report"
fi
python -m pip install -q "${stack[@]}" liger-kernel==0.8.5 pytest pytest-xdist hypothesis ruff import-linter pyyaml

# verl 0.9.1's own source, for the integration tests against verl's real code (its fused path,
# its Megatron engine's forward_step, MTP). verl goes in with --no-deps: its full requirements
# pull vLLM-era pins and wandb that nothing here uses (where Ray is absent, as on the GPU box,
# the tests that import verl put a stand-in on the path: mcore_ppo_testing.real_verl). Beside it, what
# `import verl` and verl.workers.engine.megatron.transformer_impl import: transformers (>= 5.5.3,
# < 5.11, verl 0.9.1's range), tensordict, omegaconf, codetiming, orjson, and for the engine
# package peft, datasets and pillow (verl.workers.engine imports its FSDP engines first).
# tensordict 0.15 is newer than verl's pin (<= 0.10), which predates torch 2.13; verl's imports
# of it work. mbridge (verl's Hugging Face -> Megatron bridge, pure Python; --no-deps: its
# get_model needs TransformerEngine and CUDA) lets the HF model tests check this project's
# conversion against mbridge's own.
python -m pip install -q "transformers>=5.5.3,<5.11" "tensordict==0.15.3" "omegaconf==2.4.0" "codetiming==1.4.0" \
  orjson "peft==0.21.2" "datasets==5.2.0" pillow "einops==0.8.2"
python -m pip install -q --no-deps "verl==0.9.1" "mbridge==0.15.1"
# verl's own trainer end to end (tests/integrations/test_verl_main_ppo.py: python -m
# verl.trainer.main_ppo on the CPU, mcore_ppo_testing.verl_cpu): Ray, and what main_ppo, its agent
# and reward loops and its data loader import beyond the above.
python -m pip install -q "ray==2.60.0" "hydra-core==1.3.8" "torchdata==0.11.0" "cachetools==8.0.2" \
  "uvicorn==0.55.0" "fastapi==0.165.0" "aiohttp==3.14.5" "pylatexenc==2.11" "pybind11==3.1.0"
python -m pip install -q --no-deps -e .
