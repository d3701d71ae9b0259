"""Backend objects by key: the head's ops name their backend by a string (their signatures hold
no Python objects), and look the object up here (:func:`backend_from_key`).

A backend registers itself when it is built (:class:`~mcore_ppo.backends.torch_backend.TorchBackend`,
:class:`~mcore_ppo.backends.triton_backend.TritonBackend`), and a caller's own backend object
when its options are checked (:func:`mcore_ppo.backends.check_backend`): both outside any
compiled region, so a compiled head reads its key as a constant and the ops find the object.
The values are weak: a backend the caller drops is forgotten with it, and a new object never
inherits a live one's key (the key holds its id).

A backend named by a string (``"auto"``, ``"triton"``, ``"torch"``) has a key of its name, device
type and precision (:func:`name_key`); what each such key resolved to
(:func:`mcore_ppo.backends.resolve_backend`) is kept here too, for the process (backends keep no
state between calls), so a call finds it in one lookup.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_BY_KEY: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
# Name key -> the backend that name resolved to there (a memo: dropping it costs a resolution).
_BY_NAME: dict[str, Any] = {}


def name_key(name: str, device_type: str, precision: str = "auto") -> str:
    """The key of the backend ``name`` resolves to on ``device_type`` with ``precision``:
    ``"<name>:<device type>"``, ``":<precision>"`` appended unless it is ``"auto"``."""
    return f"{name}:{device_type}" + ("" if precision == "auto" else f":{precision}")


def resolved(key: str) -> Any | None:
    """The backend the name key ``key`` resolved to, or None (not resolved yet)."""
    return _BY_NAME.get(key)


def keep_resolved(key: str, backend: Any) -> None:
    """Keep ``backend`` as what the name key ``key`` resolves to."""
    _BY_NAME[key] = backend


def forget_resolved() -> None:
    """Forget every name's backend (the next call resolves and builds it again)."""
    _BY_NAME.clear()


def backend_from_key(key: str) -> Any:
    """The backend ``key`` names (inside the ops, and in their shape functions): a name's
    resolved backend or a registered object, one lookup each; a name not resolved yet is
    resolved now (:func:`mcore_ppo.backends.resolve_key`), an unknown object key refused there."""
    backend = _BY_NAME.get(key)
    if backend is None:
        backend = _BY_KEY.get(key)
    if backend is None:
        from mcore_ppo.backends import resolve_key  # (the package imports this module)

        backend = resolve_key(key)
    return backend


def register(backend: Any) -> str:
    """``backend``'s key (``"<name>@<id>"``), registered; kept on it as ``op_key``."""
    key = getattr(backend, "op_key", None)
    # In a compiled region the key is read as it is (a traced registry lookup would be guarded on):
    # an object is registered when built, before any compiled region meets it.
    if key is not None and (torch.compiler.is_compiling() or holds(backend)):
        return key
    key = f"{backend.name}@{id(backend):x}"  # a copy of another backend carries its key: a new one
    _BY_KEY[key] = backend
    backend.op_key = key
    return key


def holds(backend: Any) -> bool:
    """``backend`` itself is registered under the key it carries (not a copy, not a forgery)."""
    key = getattr(backend, "op_key", None)
    return key is not None and _BY_KEY.get(key) is backend
