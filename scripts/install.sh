#!/usr/bin/env bash
# Installs mcore_ppo and what its demo and tests need on a CPU machine (Python 3.11).
# torch is named first with its exact version so nothing floats it to a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q triton==3.7.1 megatron-core==0.16.1 liger-kernel==0.8.5 pytest hypothesis ruff import-linter pyyaml
python -m pip install -q --no-deps -e .
