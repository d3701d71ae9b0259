"""An import hook that patches named modules right after they execute, shared by the integrations.

verl and NeMo-RL bind the functions the integrations replace either at import time (``from ...
import name``) or as module attributes; either way a module imported after the integration is
switched on must be patched as soon as its own code has run. :class:`AfterImportHook` does that
without editing the framework: it lets the other finders find the module and wraps their loader,
so ``on_import(module)`` runs right after ``exec_module``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

__all__ = ["AfterImportHook", "backend_from_environment"]


def backend_from_environment(variable: str) -> str:
    """The head backend an integration's environment variable names (unset or empty: ``auto``).

    Raises:
        ValueError: the value is not a backend name (the message names ``variable``).
    """
    from mcore_ppo.backends import BACKENDS

    backend = os.environ.get(variable, "auto").strip() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{variable} must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def precision_from_environment(variable: str) -> str | None:
    """The head precision an integration's environment variable names (None: unset or empty).

    Raises:
        ValueError: the value is not one of :data:`mcore_ppo.numerics.PRECISIONS` (the message
            names ``variable``).
    """
    from mcore_ppo.numerics import PRECISIONS

    precision = os.environ.get(variable, "").strip()
    if not precision:
        return None
    if precision not in PRECISIONS:
        raise ValueError(f"{variable} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def head_backend_from_environment(backend_variable: str, precision_variable: str, weight: Any) -> Any:
    """What an integration passes as the head's ``backend``: the name ``backend_variable``
    names, or the backend of that name built with a precision other than ``auto`` on
    ``weight``'s device type (one object per process, cached). The precision is the one
    ``precision_variable`` names; unset, an fp32 ``weight`` (the framework's fp32 LM head:
    NeMo-RL's ``fp32_lm_head``, slime's fp32 output layer) takes ``fp32_faithful`` and any other
    ``auto``.

    Raises:
        ValueError: either variable holds something else than a name it may hold.
    """
    import torch

    from mcore_ppo.backends import resolve_backend

    backend = backend_from_environment(backend_variable)
    precision = precision_from_environment(precision_variable)
    if precision is None:
        precision = "fp32_faithful" if weight.dtype == torch.float32 else "auto"
    return backend if precision == "auto" else resolve_backend(backend, weight.device, precision)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the hook's callback on the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, hook: AfterImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if self._hook.installed:  # not removed meanwhile
            self._hook.on_import(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real loader
        return getattr(self._loader, name)


class AfterImportHook(importlib.abc.MetaPathFinder):
    """``on_import(module)`` right after any module named in ``names`` executes.

    :meth:`install` puts the hook first on ``sys.meta_path``; :meth:`remove` takes it off (a
    module whose import is under way when it is removed is not patched).
    """

    def __init__(self, names: Collection[str], on_import: Callable[[ModuleType], None]) -> None:
        self.names = frozenset(names)
        self.on_import = on_import
        self._installed = False
        self._searching = threading.local()  # names this hook is finding now, per thread

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` is in force (not yet :meth:`remove`-d)."""
        return self._installed

    def install(self) -> list[ModuleType]:
        """Put the hook first on ``sys.meta_path`` (idempotent) and run ``on_import`` on the named
        modules already imported; returns those."""
        if not self._installed:
            sys.meta_path.insert(0, self)
            self._installed = True
        loaded = [sys.modules[name] for name in sorted(self.names) if name in sys.modules]
        for module in loaded:
            self.on_import(module)
        return loaded

    def remove(self) -> None:
        """Take the hook off ``sys.meta_path`` (idempotent)."""
        self._installed = False
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in self.names:
            return None
        # Another finder asked below may be a hook watching the same module (the verl plugin and
        # a harness, two integrations): it asks the other finders too, this one included. Asked
        # again while asking, this hook answers None; the outer call still wraps the loader.
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:
            return None
        searching.add(fullname)
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _PatchingLoader(spec.loader, self)
                    return spec
            return None
        finally:
            searching.discard(fullname)
