"""On CPU, Megatron-Core's ``jit_fuser`` functions stay plain functions.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and Megatron decorates some forty
fusion helpers with it at import time. Each decoration builds an inductor wrapper, so the first
one imports ``torch._inductor`` (about 3 s of a 5 s Megatron import on the CI machine), in every
process: pytest workers, every torchrun rank of the demo and the multi-rank suite. None of those
helpers runs on the CPU paths of the harness (the models here use no bias-activation or
bias-dropout fusion, and no compilation happens in a CPU run), and undecorated they compute the
same thing eagerly. :func:`skip_megatron_jit_on_cpu` makes Megatron call its own
``disable_jit_fuser()`` right after ``megatron.core.jit`` runs, before any helper is decorated.
On a machine with CUDA, or once Megatron is imported, it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

import torch

_MODULE = "megatron.core.jit"


class _DisableJitFuser(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as usual and runs its ``disable_jit_fuser()`` after it."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # once: the real finders locate the module
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if callable(disable):  # versions without it keep their own fuser
                disable()

        spec.loader.exec_module = exec_module
        return spec


def skip_megatron_jit_on_cpu() -> bool:
    """Install the hook (see the module doc) where no CUDA device is visible and Megatron is not
    yet imported; returns whether it was installed."""
    if _MODULE in sys.modules or torch.cuda.is_available():
        return False
    if not any(isinstance(finder, _DisableJitFuser) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DisableJitFuser())
    return True
