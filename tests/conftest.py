"""Single-process suite setup.

Triton's interpreter must be chosen before ``mcore_ppo.kernels`` is first imported (Triton
decides at decoration time), and any test module may import it first (through the backend
registry), so on a machine without CUDA it is switched on here, before collection. Only the
``triton`` backend's kernels are affected: ``backend="auto"`` still picks the torch backend
for CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
