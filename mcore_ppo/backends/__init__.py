"""Backend registry: ``torch`` (chunked reference), ``triton`` (fused kernels), ``liger``.

Optional backends are imported lazily with :func:`import_optional`, which fails soft only
when the missing module *is* the optional package itself: a broken install of that package
(one of *its* dependencies missing) still raises, instead of silently degrading to a slower
backend.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from mcore_ppo.backends.base import Backend
from mcore_ppo.backends.torch_backend import TorchBackend
from mcore_ppo.logs import log_once

BACKENDS = ("auto", "torch", "triton", "liger")


def import_optional(package: str) -> ModuleType | None:
    """Import ``package``; None if the package itself is not installed, else re-raise.

    ``ModuleNotFoundError.name`` names the module that was missing: when it is ``package`` or
    one of its parents (``liger_kernel`` for ``liger_kernel.ops``) the package is absent and
    we return None; any other missing module is a broken install and propagates.
    """
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        parts = package.split(".")
        if any(missing == ".".join(parts[: i + 1]) for i in range(len(parts))):
            return None
        raise


def _triton_backend(buffer_budget_bytes: int | None = None) -> Backend | None:
    module = import_optional("mcore_ppo.backends.triton_backend")
    if module is None or not module.is_available():
        return None
    if buffer_budget_bytes is None:  # the backend's own default: the environment, else its module default
        return module.TritonBackend()
    return module.TritonBackend(buffer_budget_bytes=buffer_budget_bytes)


def _torch_backend(buffer_budget_bytes: int | None = None) -> Backend:
    return TorchBackend()  # recomputes in chunks; keeps no buffer between forward and backward


def _liger_backend(buffer_budget_bytes: int | None = None) -> Backend | None:
    module = import_optional("mcore_ppo.backends.liger_backend")
    if module is None or not module.is_available():
        return None
    return module.LigerBackend()


_FACTORIES = {"torch": _torch_backend, "triton": _triton_backend, "liger": _liger_backend}


def is_backend_object(backend: object) -> bool:
    """``backend`` is a backend instance rather than a name: it implements the per-shard
    :class:`Backend` protocol, or computes whole outputs itself (``computes_outputs``)."""
    if getattr(backend, "computes_outputs", False):
        return callable(getattr(backend, "log_probs_and_entropy", None))
    return callable(getattr(backend, "shard_statistics", None)) and callable(getattr(backend, "shard_gradients", None))


def check_backend(backend: object) -> None:
    """``backend`` is one of :data:`BACKENDS` or a backend object; TypeError / ValueError otherwise."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return
    if not is_backend_object(backend):
        raise TypeError(
            f"backend must be a str, one of {BACKENDS}, or a backend object (mcore_ppo.backends.base.Backend), "
            f"got {type(backend).__name__}"
        )


def resolve_backend(name: str | Backend, device: torch.device, *, buffer_budget_bytes: int | None = None) -> Backend:
    """The backend object for ``name`` on ``device`` (a backend object is returned as it is).

    ``auto`` picks the fused Triton kernels on CUDA when they are available and the chunked
    torch reference elsewhere: in the benchmark (docs/benchmarks) ``triton`` is the fastest
    backend that meets the head's accuracy contract at every shape. Liger's CuTe kernel is
    about as fast, but its log-prob error is above that contract and its entropy is computed
    in bf16 (docs/benchmarks), so ``auto`` never picks it (ask for ``"liger"``). An explicitly
    named backend that is not available raises.

    ``buffer_budget_bytes`` (see :class:`mcore_ppo.pipeline.HeadOptions`) goes to the
    ``triton`` backend, also when ``auto`` picks it; None leaves the backend's default.
    """
    check_backend(name)
    if not isinstance(name, str):
        return name
    if name == "auto":
        backend = _triton_backend(buffer_budget_bytes) if device.type == "cuda" else None
        if backend is None:
            why = "not a CUDA device" if device.type != "cuda" else "triton is not installed or cannot run"
            log_once(
                logging.INFO,
                ("backend", "auto", device.type, "torch"),
                "mcore_ppo: backend='auto' on %s -> 'torch' (the chunked reference): %s",
                device.type,
                why,
            )
            return TorchBackend()
        _log_resolved(name, device, backend)
        return backend
    backend = _FACTORIES[name](buffer_budget_bytes)
    if backend is None:
        raise RuntimeError(
            f"backend={name!r} is not available here (its package is not installed or it needs "
            "a CUDA device); use backend='torch' or 'auto'"
        )
    _log_resolved(name, device, backend)
    return backend


def _log_resolved(name: str, device: torch.device, backend: Backend) -> None:
    """One INFO line per (requested name, device type, budget): the backend a configuration runs."""
    budget = getattr(backend, "buffer_budget_bytes", None)
    log_once(
        logging.INFO,
        ("backend", name, device.type, type(backend).__name__, budget),
        "mcore_ppo: backend=%r on %s -> %r%s",
        name,
        device.type,
        getattr(backend, "name", type(backend).__name__),
        "" if budget is None else f" (probability-buffer budget {budget} bytes per call)",
    )


__all__ = [
    "BACKENDS",
    "Backend",
    "TorchBackend",
    "check_backend",
    "import_optional",
    "is_backend_object",
    "resolve_backend",
]
