"""Test/CPU-only shims that let Megatron-Core's ``GPTModel`` run forward and backward on CPU.

Megatron-Core assumes CUDA in a few places that have nothing to do with the math. On the
CPU machines (CI, the CPU demo) these shims replace exactly those places; on a machine with
CUDA :func:`install_cpu_shims` refuses, so a GPU run never takes this path. The library
(``mcore_ppo`` outside ``mcore_ppo_testing``) never imports this module.

What is replaced (all process-global, idempotent, undone by :func:`uninstall_cpu_shims`):

- ``torch.cuda.current_device`` returns ``torch.device("cpu")``: Megatron allocates
  buffers with ``device=torch.cuda.current_device()`` (SP all-gathers in
  ``tensor_parallel.layers``/``mappings``, the global memory buffer, embeddings).
- ``CudaRNGStatesTracker.fork`` is a null context: it saves and restores CUDA RNG states
  around dropout and weight init. The models built here have dropout 0 and initialise on the
  CPU from the global torch RNG (``use_cpu_initialization``), so nothing is lost.
- ``device="cuda"`` literals become the CPU in the modules that hard-code them on paths a CPU
  run takes: ``megatron.core.transformer.utils`` (the default causal mask of the local
  attention's softmax), ``megatron.core.pipeline_parallel.schedules`` (the token counter
  of ``forward_backward_no_pipelining``), ``megatron.core.optimizer.optimizer`` (the
  overflow flag of the non-distributed optimizer), ``megatron.core.optimizer.clip_grads`` (the
  grad norm's accumulator) and ``megatron.core.utils`` (the result of the grad-norm fallback
  used without Apex). Only those modules' global name ``torch`` is
  replaced, by a proxy whose tensor factories map a CUDA ``device`` to the CPU.
- ``torch.cuda.current_stream()`` inside ``megatron.core.distributed.param_and_grad_buffer``
  (megatron-core >= 0.20 waits there on CUDA-graph events before every gradient reduction)
  returns a stream whose waits do nothing: the CPU runs one stream, in order.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

_ORIGINALS: dict[str, object] = {}

# Modules whose global ``torch`` is swapped for :class:`_CudaLiteralsOnCpu` (see the module doc).
_CUDA_LITERAL_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
)
_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint"})


def _cpu_if_cuda(device: object) -> object:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda:"):
        return torch.device("cpu")
    return device


class _InOrderStream:
    """The CPU's one stream: everything before a wait has already happened."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CudaOnCpu:
    """Stands for ``torch.cuda`` inside a shimmed module: ``current_stream`` is the CPU's one
    stream; every other attribute is ``torch.cuda``'s own."""

    def current_stream(self, device: object = None) -> _InOrderStream:
        return _IN_ORDER_STREAM

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


_IN_ORDER_STREAM = _InOrderStream()
_CUDA_ON_CPU = _CudaOnCpu()


class _CudaLiteralsOnCpu:
    """Stands for the ``torch`` module inside one Megatron module: factories given a CUDA device
    build on the CPU, ``torch.cuda.current_stream()`` is an in-order stream; every other
    attribute is torch's own."""

    def __getattr__(self, name: str) -> object:
        if name == "cuda":
            return _CUDA_ON_CPU
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_if_cuda(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _null_fork(self, name: str = "model-parallel-rng"):  # same signature as the original
    return contextlib.nullcontext()


def shims_installed() -> bool:
    """Whether :func:`install_cpu_shims` is in effect."""
    return bool(_ORIGINALS)


def install_cpu_shims() -> None:
    """Install the CPU shims (idempotent).

    Raises:
        RuntimeError: when CUDA is available: GPU runs must use Megatron unmodified.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "install_cpu_shims() is for CPU-only runs (tests, the CPU demo); CUDA is available, "
            "so run Megatron unmodified instead"
        )
    if _ORIGINALS:
        return
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    _ORIGINALS["current_device"] = torch.cuda.current_device
    _ORIGINALS["fork"] = CudaRNGStatesTracker.__dict__["fork"]
    torch.cuda.current_device = _cpu_current_device
    CudaRNGStatesTracker.fork = _null_fork
    for module_name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(module_name)
        _ORIGINALS[f"torch@{module_name}"] = module.torch
        module.torch = _CudaLiteralsOnCpu()


def uninstall_cpu_shims() -> None:
    """Restore what :func:`install_cpu_shims` replaced (no-op when not installed)."""
    if not _ORIGINALS:
        return
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.cuda.current_device = _ORIGINALS.pop("current_device")
    CudaRNGStatesTracker.fork = _ORIGINALS.pop("fork")
    for module_name in _CUDA_LITERAL_MODULES:
        importlib.import_module(module_name).torch = _ORIGINALS.pop(f"torch@{module_name}")


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Context manager: the CPU shims inside, the previous state after (nesting-safe)."""
    already = shims_installed()
    install_cpu_shims()
    try:
        yield
    finally:
        if not already:
            uninstall_cpu_shims()
