"""A stand-in for ``ray``, put on ``sys.path`` only where the real one is not installed.

``import verl`` imports Ray at module level (``verl/protocol.py``,
``verl/single_controller/base/worker.py``), but the Megatron fused forward that
``tests/test_verl_real.py`` runs never calls it. Ray's wheel (79 MB) is larger than what a
device run may carry, so on the GPU box this module answers the import instead: any attribute is
a callable placeholder, and calling one raises, so a code path that does use Ray fails loudly.
"""

from __future__ import annotations

from typing import Any

STANDIN = True


class _Placeholder:
    """An attribute of the stand-in: usable as a base class, annotation or decorator argument,
    never as Ray itself."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"ray.{self._name} called, but only a stand-in for ray is installed")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __or__(self, other: Any) -> Any:  # ``ray.ObjectRef | None`` in annotations
        return Any

    __ror__ = __or__


def __getattr__(name: str) -> _Placeholder:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)
