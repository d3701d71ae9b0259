"""Backend registry: ``torch`` (chunked reference) and ``triton`` (fused kernels).

Liger-Kernel computes whole outputs with its own autograd and fits no per-shard protocol: it is
an entry point of its own, :func:`mcore_ppo.liger.liger_log_probs_and_entropy`.

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

from mcore_ppo.backends import registry
from mcore_ppo.backends.base import Backend, Capabilities
from mcore_ppo.backends.torch_backend import TorchBackend, TorchConfig
from mcore_ppo.logs import log_once
from mcore_ppo.numerics import check_precision

BACKENDS = ("auto", "torch", "triton")


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


def _triton_backend(precision: str) -> Backend | None:
    module = import_optional("mcore_ppo.backends.triton_backend")
    if module is None or not module.is_available():
        return None
    # The process's default budget: MCORE_PPO_BUFFER_BUDGET_BYTES, read here, once per cached backend.
    return module.TritonBackend(module.TritonConfig.from_environment(precision=precision))


def _torch_backend(precision: str) -> Backend:
    # Recomputes in chunks; keeps no buffer between forward and backward.
    return TorchBackend(TorchConfig(precision=precision))


_FACTORIES = {"torch": _torch_backend, "triton": _triton_backend}


def check_backend(backend: object) -> None:
    """``backend`` is one of :data:`BACKENDS` or a :class:`Backend` object; TypeError / ValueError otherwise.

    A backend object is registered under its :func:`backend_key` here, where the caller builds
    its options (outside any compiled region), so the head's ops can find it by that key; one
    registered already (checked before, or one of this package's, registered when built) is not
    checked again: a runtime Protocol ``isinstance`` costs tens of microseconds per call."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            hint = " (Liger-Kernel: mcore_ppo.liger_log_probs_and_entropy)" if backend == "liger" else ""
            raise ValueError(f"backend must be one of {BACKENDS} or a backend object, got {backend!r}{hint}")
        return
    # (Not while a compiled region is traced: the registry is a weak mapping, no graph's constant.)
    if not torch.compiler.is_compiling() and registry.holds(backend):
        return
    if not isinstance(backend, Backend) or not isinstance(backend.capabilities, Capabilities):
        raise TypeError(
            f"backend must be a str, one of {BACKENDS}, or a backend object (mcore_ppo.backends.base.Backend), "
            f"got {type(backend).__name__}"
        )
    registry.register(backend)


def backend_precision(backend: Backend) -> str:
    """The ``precision`` a backend object runs with (its config's; ``"auto"`` for one without)."""
    return getattr(getattr(backend, "config", None), "precision", "auto")


def backend_key(backend: str | Backend, device: torch.device, precision: str = "auto") -> str:
    """The string the head's ops name ``backend`` by: ``"<name>:<device type>"`` for a name
    (``":<precision>"`` appended unless it is ``"auto"``; :func:`backend_from_key` resolves it,
    once per device type and precision, as :func:`resolve_backend` does), else the key a backend
    object was registered under when its options were checked."""
    if isinstance(backend, str):
        return registry.name_key(backend, device.type, precision)
    key = getattr(backend, "op_key", None)
    return key if key is not None else registry.register(backend)


#: The backend :func:`backend_key` named (:func:`mcore_ppo.backends.registry.backend_from_key`).
backend_from_key = registry.backend_from_key


def resolve_key(key: str) -> Backend:
    """The backend a name key (:func:`backend_key` of a name) resolves to, as
    :func:`resolve_backend` resolves it; ValueError for a key of no registered object."""
    name, _, rest = key.partition(":")
    device_type, _, precision = rest.partition(":")
    if device_type and "@" not in key:
        return resolve_backend(name, torch.device(device_type), precision or "auto")
    raise ValueError(
        f"backend {key!r} is not registered: build a backend object outside a compiled region and pass it "
        "through HeadOptions or the backend= argument"
    )


def clear_backend_cache() -> None:
    """Forget the backends :func:`resolve_backend` built, so the next call builds them again
    from the current module defaults and environment (tests that patch those defaults)."""
    registry.forget_resolved()


def resolve_backend(name: str | Backend, device: torch.device, precision: str = "auto") -> Backend:
    """The backend object for ``name`` on ``device``, its fp32 dots as ``precision`` says
    (:data:`mcore_ppo.numerics.PRECISIONS`); a backend object is returned as it is.

    ``auto`` picks the fused Triton kernels on CUDA when they are available and the chunked
    torch reference elsewhere: in the benchmark (docs/benchmarks) ``triton`` is the fastest
    backend that meets the head's accuracy contract at every shape. Liger's CuTe kernel is
    1.1-1.4x slower in the forward, its log-prob error is above that contract and its entropy is
    computed in bf16 (docs/benchmarks); it is its own entry point. An explicitly named backend
    that is not available raises ValueError.

    A name resolves once per device type and precision and the object is reused for every later call
    (:func:`clear_backend_cache` forgets them). The ``triton`` backend built for a name takes
    the default :class:`~mcore_ppo.backends.triton_backend.TritonConfig`, with the
    probability-buffer budget from ``MCORE_PPO_BUFFER_BUDGET_BYTES`` when set (read then,
    once); other settings need a backend object:
    ``backend=TritonBackend(TritonConfig(buffer_budget_bytes=...))``.
    """
    if not isinstance(name, str):
        check_backend(name)
        return name
    # Backends are stateless between calls, so one object serves every call of a name; building
    # one per call costs host time (the triton backend reads its settings and the environment).
    key = registry.name_key(name, device.type, precision)
    backend = registry.resolved(key)
    if backend is None:
        check_backend(name)
        check_precision(precision)
        backend = _build(name, device, precision)
        registry.keep_resolved(key, backend)
    return backend


def _build(name: str, device: torch.device, precision: str) -> Backend:
    if name == "auto":
        backend = _triton_backend(precision) if device.type == "cuda" else None
        if backend is None:
            why = "not a CUDA device" if device.type != "cuda" else "triton is not installed or cannot run"
            log_once(
                logging.INFO,
                ("backend", "auto", device.type, "torch"),
                "mcore_ppo: backend='auto' on %s -> 'torch' (the chunked reference): %s",
                device.type,
                why,
            )
            return _torch_backend(precision)
        _log_resolved(name, device, backend)
        return backend
    backend = _FACTORIES[name](precision)
    if backend is None:
        raise ValueError(
            f"backend={name!r} is not available here (its package is not installed or it needs "
            "a CUDA device or TRITON_INTERPRET=1); use backend='torch' or 'auto'"
        )
    _log_resolved(name, device, backend)
    return backend


def __getattr__(name: str):
    # The triton backend's names are exported without importing its module (and triton) with the package.
    if name in ("TritonBackend", "TritonConfig"):
        from mcore_ppo.backends import triton_backend

        return getattr(triton_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _log_resolved(name: str, device: torch.device, backend: Backend) -> None:
    """One INFO line per (requested name, device type, budget): the backend a configuration runs."""
    config = getattr(backend, "config", None)
    budget = getattr(config, "buffer_budget_bytes", None)
    log_once(
        logging.INFO,
        ("backend", name, device.type, type(backend).__name__, budget),
        "mcore_ppo: backend=%r on %s -> %r%s",
        name,
        device.type,
        backend.name,
        "" if budget is None else f" (probability-buffer budget {budget} bytes per call)",
    )


__all__ = [
    "BACKENDS",
    "Backend",
    "Capabilities",
    "TorchBackend",
    "TorchConfig",
    "TritonBackend",
    "TritonConfig",
    "backend_from_key",
    "backend_key",
    "backend_precision",
    "check_backend",
    "clear_backend_cache",
    "import_optional",
    "resolve_backend",
    "resolve_key",
]
