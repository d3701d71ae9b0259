"""What the docs' examples need to run in one plain process (``python`` from a checkout's root).

A Megatron model needs ``torch.distributed`` initialised, which a launcher (``torchrun``, a
framework's workers) does in a real run: :func:`single_process_world` makes this process a world
of one rank, gloo on the CPU (with the CPU shims, :mod:`mcore_ppo_testing.cpu_shims`, since
Megatron's ``GPTModel`` assumes CUDA) or NCCL on a GPU. The examples then call
``parallel_state.initialize_model_parallel`` themselves, the caller's job in every run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_ppo_testing.cpu_shims import install_cpu_shims

__all__ = ["single_process_world"]


def single_process_world() -> torch.device:
    """This process as a ``torch.distributed`` world of one rank (nothing to do when one is
    initialised); on a machine without CUDA the CPU shims installed too. Returns the device the
    example's tensors go on."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not cuda:
        install_cpu_shims()
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
