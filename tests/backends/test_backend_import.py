"""Optional backends fail soft only when the missing module is the optional package itself.

Regression for a seed bug of the anchors: ``try: import x except ImportError: x = None`` also
swallows a *broken* install of ``x`` (one of x's own dependencies missing) and silently falls
back to a slower path. :func:`mcore_ppo.backends.import_optional` returns None only when
``ModuleNotFoundError.name`` is the package (or one of its parents) and re-raises otherwise.
Real packages are built in ``tmp_path`` and put on ``sys.path`` for each case.
"""

from __future__ import annotations

import itertools
import os
import sys
import types

import pytest
import torch

from mcore_ppo.backends import TorchBackend, import_optional, resolve_backend

_NAMES = itertools.count()


def unique(prefix: str) -> str:
    """A module name no other test (or installed package) uses."""
    return f"{prefix}_{os.getpid()}_{next(_NAMES)}"


@pytest.fixture
def make_package(tmp_path, monkeypatch):
    """Write a package ``name`` (``{relative path: source}``) under tmp_path and put it on sys.path."""
    created: list[str] = []

    def make(name: str, files: dict[str, str]) -> None:
        for rel, source in files.items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        created.append(name)
        monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches

    yield make
    for mod in [m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in created)]:
        del sys.modules[mod]


def test_absent_package_is_none():
    assert import_optional(unique("mcore_ppo_absent")) is None


def test_absent_parent_is_none():
    assert import_optional(unique("mcore_ppo_absent") + ".ops.kernels") is None


def test_absent_submodule_of_present_package_is_none(make_package):
    name = unique("mcore_ppo_present")
    make_package(name, {"__init__.py": ""})
    assert import_optional(f"{name}.not_there") is None


def test_present_package_is_returned(make_package):
    name = unique("mcore_ppo_present")
    make_package(name, {"__init__.py": "VALUE = 42\n", "ops.py": "OPS = 7\n"})
    assert import_optional(name).VALUE == 42
    assert import_optional(f"{name}.ops").OPS == 7


def test_missing_dependency_of_package_is_raised(make_package):
    """The package exists but its own import needs a module that is absent: re-raised."""
    name, dep = unique("mcore_ppo_broken"), unique("mcore_ppo_dep")
    make_package(name, {"__init__.py": f"import {dep}\n"})
    with pytest.raises(ModuleNotFoundError) as info:
        import_optional(name)
    assert info.value.name == dep


def test_missing_dependency_of_submodule_is_raised(make_package):
    name, dep = unique("mcore_ppo_broken"), unique("mcore_ppo_dep")
    make_package(name, {"__init__.py": "", "ops.py": f"from {dep}.kernels import fused\n"})
    with pytest.raises(ModuleNotFoundError) as info:
        import_optional(f"{name}.ops")
    assert info.value.name == dep


def test_missing_module_with_a_prefix_name_is_raised(make_package):
    """``foo`` missing while importing ``foo_extra`` is not ``foo_extra`` missing (no string prefix test)."""
    dep = unique("mcore_ppo_dep")
    name = dep + "_extra"
    make_package(name, {"__init__.py": f"import {dep}\n"})
    with pytest.raises(ModuleNotFoundError) as info:
        import_optional(name)
    assert info.value.name == dep


def test_other_import_errors_are_raised(make_package):
    """An ImportError that is not a missing module (a name missing from a present module) propagates."""
    name = unique("mcore_ppo_broken")
    make_package(name, {"__init__.py": "from os import no_such_name_in_os\n"})
    with pytest.raises(ImportError, match="no_such_name_in_os"):
        import_optional(name)


# --- the lazy backend registry -------------------------------------------------------------------


def fake_backend_module(available: bool, class_name: str) -> types.ModuleType:
    module = types.ModuleType("fake_backend")
    module.is_available = lambda: available
    module.environment_budget = lambda: None  # the triton module's reading of its environment variable
    setattr(module, class_name, type(class_name, (), {"name": class_name}))
    return module


@pytest.mark.parametrize(("backend", "class_name"), [("triton", "TritonBackend"), ("liger", "LigerBackend")])
def test_unavailable_backend(monkeypatch, backend, class_name):
    """A backend whose module says it is unavailable: named explicitly → RuntimeError; auto → torch."""
    module_name = f"mcore_ppo.backends.{backend}_backend"
    monkeypatch.setitem(sys.modules, module_name, fake_backend_module(False, class_name))
    with pytest.raises(RuntimeError, match=rf"backend='{backend}' is not available here"):
        resolve_backend(backend, torch.device("cpu"))
    assert isinstance(resolve_backend("auto", torch.device("cpu")), TorchBackend)


@pytest.mark.parametrize(("backend", "class_name"), [("triton", "TritonBackend"), ("liger", "LigerBackend")])
def test_absent_backend_module(monkeypatch, backend, class_name):
    """The backend module cannot be imported at all (None in sys.modules): explicit → RuntimeError."""
    monkeypatch.setitem(sys.modules, f"mcore_ppo.backends.{backend}_backend", None)
    with pytest.raises(RuntimeError, match=rf"backend='{backend}' is not available here"):
        resolve_backend(backend, torch.device("cpu"))


@pytest.mark.parametrize(("backend", "class_name"), [("triton", "TritonBackend"), ("liger", "LigerBackend")])
def test_available_backend_is_used(monkeypatch, backend, class_name):
    module = fake_backend_module(True, class_name)
    monkeypatch.setitem(sys.modules, f"mcore_ppo.backends.{backend}_backend", module)
    assert type(resolve_backend(backend, torch.device("cpu"))).__name__ == class_name


def test_auto_on_cpu_is_torch():
    assert isinstance(resolve_backend("auto", torch.device("cpu")), TorchBackend)
    assert isinstance(resolve_backend("torch", torch.device("cpu")), TorchBackend)
