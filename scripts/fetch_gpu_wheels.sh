#!/usr/bin/env bash
# Fills the git-ignored wheel folders that scripts/gpu_suite.sh carries to a GPU machine with no
# network (Python 3.12, x86-64), the versions scripts/install.sh gives the CPU machines:
#   .whl/   what the single-process suite imports beyond torch and triton: verl 0.9.1 (--no-deps, as
#           install.sh installs it; Ray stays behind: mcore_ppo_testing/real_verl.py), what `import verl`
#           and its engine package import (transformers, tensordict, omegaconf, codetiming, orjson, peft,
#           datasets, pillow), mbridge and einops (the Hugging Face model tests), liger-kernel,
#           hypothesis and pyyaml (the property and config tests), and every package those require, but
#           for torch's own stack (torch, triton, nvidia-*, sympy, networkx, jinja2) and numpy, pandas and
#           pyarrow: their ~80 MB of wheels do not fit the device tool's 64 MiB carry, and the GPU image
#           has them (megatron-core needs numpy; `import datasets` pyarrow and pandas).
#           scripts/gpu_suite.sh imports every one of these modules before the tests and stops, naming
#           the missing ones, if one does not import.
#   .carry/ megatron-core 0.19.0 from PyPI, and 0.20.0 built from a Megatron-LM checkout when one is
#           given (not on PyPI yet): a pure wheel, without the optional C++ dataset helper.
# Together about 45 MB (`du -sh .whl .carry`, printed at the end); with the working tree they stay
# under the 64 MiB a device call carries.
#
#   scripts/fetch_gpu_wheels.sh [MEGATRON_LM_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .carry
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
# The packages the tests import, as scripts/install.sh pins them.
direct=(verl==0.9.1 mbridge==0.15.1 liger-kernel==0.8.5 transformers==5.10.4 tensordict==0.15.3 omegaconf==2.4.0
  codetiming==1.4.0 orjson==3.13.0 peft==0.21.2 datasets==5.2.0 pillow==13.0.0 einops==0.8.2 hypothesis==6.170.17
  pyyaml==6.0.4)
# What they require (numpy, pandas, pyarrow and torch's stack excepted, above), at the CPU machines' versions.
required=(tokenizers==0.22.2 huggingface_hub==1.33.0 hf-xet==1.8.0 safetensors==0.8.0 regex==2026.11.19
  tqdm==4.70.1 packaging==26.4 filelock==4.3.2 fsspec==2026.9.0 typing_extensions==4.16.0 httpx==0.29.0
  httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 click==8.5.1 typer==0.29.2
  shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 annotated-doc==0.0.7
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pyvers==0.2.3
  cloudpickle==3.1.3 antlr4-python3-runtime==4.13.2 accelerate==1.16.0 psutil==7.2.2 dill==0.4.1
  multiprocess==0.70.19 xxhash==4.1.0 sortedcontainers==2.4.0
  setuptools==84.2.1)  # gpu_suite.sh builds mcore_ppo with it (verl finds the plugin by its entry point)
download -d .whl "${direct[@]}" "${required[@]}"
download -d .carry megatron-core==0.19.0
if [ $# -ge 1 ]; then
  src=$(mktemp -d)
  cp -r "$1"/. "$src"
  # The optional helper extension would tie the wheel to this machine's Python; the suite does not use it.
  printf 'from setuptools import setup\n\nsetup()\n' > "$src/setup.py"
  sed -i 's/requires-python = ">=3.12"/requires-python = ">=3.10"/' "$src/pyproject.toml"
  python3 -m pip wheel -q --no-deps "$src" -w .carry
  rm -rf "$src"
fi
ls -l .whl .carry
du -sh .whl .carry
