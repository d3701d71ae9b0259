#!/usr/bin/env bash
# Packs nvidia-cutlass-dsl (what Liger-Kernel's Hopper kernels import) for a GPU machine with no
# network, into the git-ignored .cute/ (Python 3.12, x86-64, CUDA 12 libraries; run on any machine):
#   .cute/cutesite.tar.xz   nvidia-cutlass-dsl 4.8.1 + libs, cuda-bindings, cuda-pathfinder, protobuf,
#                           installed flat, xz with the x86 filter: 57 MiB (the wheels are 104 MB,
#                           over the device tool's 64 MiB carry)
#   .cute/liger_kernel-0.8.5-py3-none-any.whl
# Unused parts of cuda-bindings (NVML, cuFile, cuDLA, .pxd headers) are left out.
#
# On the GPU machine (docs/benchmarks/gpu_runs/h200_2026-12-01c/README.md):
#   python -m pip install --no-deps --no-index .cute/liger_kernel-*.whl
#   mkdir -p /tmp/cute && tar -xJf .cute/cutesite.tar.xz -C /tmp/cute
#   export PYTHONPATH=$PWD:/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work/wheels" nvidia-cutlass-dsl==4.8.1 protobuf
python3 -m pip install -q --no-deps --target "$work/site" --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --only-binary=:all: "$work"/wheels/nvidia_cutlass_dsl*.whl \
  "$work"/wheels/cuda_bindings*.whl "$work"/wheels/cuda_pathfinder*.whl "$work"/wheels/protobuf*.whl
(
  cd "$work/site"
  rm -rf bin nvidia_cutlass_dsl/cu12/lib/stubs
  cd cuda/bindings
  rm -f nvml*.so cufile*.so cudla*.so _internal/nvml*.so _internal/cufile*.so _internal/cudla*.so ./*.pxd _internal/*.pxd
)
mkdir -p .cute
tar -cf - -C "$work/site" . | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > .cute/cutesite.tar.xz
python3 -m pip download -q --no-deps --only-binary=:all: -d .cute liger-kernel==0.8.5
rm -rf "$work"
ls -l .cute
