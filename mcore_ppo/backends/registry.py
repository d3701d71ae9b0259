"""Backend objects by key: the head's ops name their backend by a string (their signatures hold
no Python objects), and look the object up here.

A backend registers itself when it is built (:class:`~mcore_ppo.backends.torch_backend.TorchBackend`,
:class:`~mcore_ppo.backends.triton_backend.TritonBackend`), and a caller's own backend object
when its options are checked (:func:`mcore_ppo.backends.check_backend`): both outside any
compiled region, so a compiled head reads its key as a constant and the ops find the object.
The values are weak: a backend the caller drops is forgotten with it, and a new object never
inherits a live one's key (the key holds its id).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_BY_KEY: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


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


def registered(key: str) -> Any | None:
    """The backend registered under ``key``, or None."""
    return _BY_KEY.get(key)


def holds(backend: Any) -> bool:
    """``backend`` itself is registered under the key it carries (not a copy, not a forgery)."""
    key = getattr(backend, "op_key", None)
    return key is not None and _BY_KEY.get(key) is backend
