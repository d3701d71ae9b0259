"""Importing verl's real source where Ray is absent (the GPU box: Ray's 79 MB wheel does not travel).

``import verl`` imports Ray at module level (``verl/protocol.py``, ``verl/single_controller``),
but the Megatron fused forward and the kernel the tests run never call it. Where Ray is not
installed, :func:`use_ray_standin` puts ``ray_standin/`` (a placeholder ``ray`` whose every
call raises) on ``sys.path``; :data:`RAY_STANDIN` is that folder, for a child's ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RAY_STANDIN = Path(__file__).resolve().parent / "ray_standin"


def loaded_modules(*packages: str) -> list[str]:
    """Names in ``sys.modules`` of ``packages`` and their submodules (to set aside or drop)."""
    prefixes = tuple(f"{package}." for package in packages)
    return [name for name in sys.modules if name in packages or name.startswith(prefixes)]


def ray_missing() -> bool:
    """Ray is not importable here (the stand-in, if already on ``sys.path``, does not count)."""
    spec = importlib.util.find_spec("ray")
    return spec is None or (spec.origin or "").startswith(str(RAY_STANDIN))


def use_ray_standin() -> bool:
    """Put the stand-in on ``sys.path`` where Ray is missing; True if this call added it."""
    if not ray_missing() or str(RAY_STANDIN) in sys.path:
        return False
    sys.path.append(str(RAY_STANDIN))
    return True


def require_verl() -> None:
    """Raise where verl's source is not installed: the tests against verl's real code are the
    project's main promise, so a missing verl fails them (a collection error naming the fix)
    instead of skipping them."""
    if importlib.util.find_spec("verl") is None:
        raise ImportError("verl is not installed: bash scripts/install.sh installs verl 0.9.1 for these tests")
