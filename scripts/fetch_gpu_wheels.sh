#!/usr/bin/env bash
# Fills the git-ignored wheel folders that scripts/gpu_suite.sh carries to a GPU machine with no
# network (Python 3.12, x86-64):
#   .whl/   verl 0.9.1, what `import verl` and its Megatron engine need that the GPU image lacks (Ray
#           excepted: tests/integrations/test_verl_real.py), liger-kernel, mbridge
#   .carry/ megatron-core 0.19.0 from PyPI, and 0.20.0 built from a Megatron-LM checkout when one is
#           given (not on PyPI yet): a pure wheel, without the optional C++ dataset helper.
#
#   scripts/fetch_gpu_wheels.sh [MEGATRON_LM_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .carry
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
download -d .whl verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 huggingface_hub==1.33.0 \
  tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 codetiming==1.4.0 \
  orjson==3.13.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 mbridge==0.15.1
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
