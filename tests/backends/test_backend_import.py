"""Optional packages fail soft only when the missing module is the optional package itself.

``try: import x except ImportError: x = None`` also swallows a *broken* install of ``x`` (one of
x's own dependencies missing) and silently falls back to a slower path.
:func:`mcore_ppo.backends.import_optional` returns None only when ``ModuleNotFoundError.name`` is
the package (or one of its parents) and re-raises otherwise. Real packages are built in
``tmp_path`` and put on ``sys.path`` for each case.

Also: the backend registry with the triton module absent, unavailable or present, and Liger-Kernel,
which is no backend name but an entry point of its own (:func:`mcore_ppo.liger_log_probs_and_entropy`):
``backend="liger"`` is refused by name, and a missing liger-kernel is a ValueError of that entry
point, a broken one the ModuleNotFoundError of its missing dependency.
"""

from __future__ import annotations

import itertools
import os
import sys
import types

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy, liger
from mcore_ppo.backends import BACKENDS, TorchBackend, check_backend, import_optional, resolve_backend
from mcore_ppo.backends.base import Backend
from mcore_ppo.liger import liger_log_probs_and_entropy

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


def fake_triton_module(available: bool) -> types.ModuleType:
    """Stands in for ``mcore_ppo.backends.triton_backend``: its availability, and a backend built
    from the config the registry reads from the environment."""
    module = types.ModuleType("fake_triton_backend")
    module.is_available = lambda: available

    class TritonConfig:
        def __init__(self, precision: str = "auto"):
            self.precision = precision

        @classmethod
        def from_environment(cls, **fields):
            return cls(**fields)

    class TritonBackend:
        name = "triton"

        def __init__(self, config):
            self.config = config

    module.TritonConfig, module.TritonBackend = TritonConfig, TritonBackend
    return module


def test_unavailable_backend(monkeypatch):
    """A backend whose module says it is unavailable: named explicitly -> ValueError; auto -> torch."""
    monkeypatch.setitem(sys.modules, "mcore_ppo.backends.triton_backend", fake_triton_module(False))
    with pytest.raises(ValueError, match=r"backend='triton' is not available here"):
        resolve_backend("triton", torch.device("cpu"))
    assert isinstance(resolve_backend("auto", torch.device("cpu")), TorchBackend)


def test_absent_backend_module(monkeypatch):
    """The backend module cannot be imported at all (None in sys.modules): explicit -> ValueError."""
    monkeypatch.setitem(sys.modules, "mcore_ppo.backends.triton_backend", None)
    with pytest.raises(ValueError, match=r"backend='triton' is not available here"):
        resolve_backend("triton", torch.device("cpu"))


def test_available_backend_is_used(monkeypatch):
    """An available module's backend is built with the config read from the environment."""
    module = fake_triton_module(True)
    monkeypatch.setitem(sys.modules, "mcore_ppo.backends.triton_backend", module)
    backend = resolve_backend("triton", torch.device("cpu"))
    assert type(backend) is module.TritonBackend and type(backend.config) is module.TritonConfig


def test_auto_on_cpu_is_torch():
    assert isinstance(resolve_backend("auto", torch.device("cpu")), TorchBackend)
    assert isinstance(resolve_backend("torch", torch.device("cpu")), TorchBackend)


# --- Liger-Kernel: an entry point of its own, not a backend name ---------------------------------


def test_liger_is_not_a_backend_name():
    """``backend="liger"`` is refused (ValueError naming the Liger entry point), by the registry
    and by the head before any work."""
    assert "liger" not in BACKENDS
    for refuse in (check_backend, lambda name: resolve_backend(name, torch.device("cpu"))):
        with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
            refuse("liger")
    hidden, weight, labels = torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        fused_log_probs_and_entropy(hidden, weight, labels, backend="liger")


def test_absent_liger_kernel_is_a_value_error(monkeypatch):
    """Without liger-kernel the Liger entry point refuses the call with a ValueError that says
    so, before Liger is touched (no ImportError from deep inside)."""
    for name in ("liger_kernel", "liger_kernel.ops", liger.LIGER_MODULE):
        monkeypatch.setitem(sys.modules, name, None)
    assert liger._liger() is None and not liger.is_available()
    hidden, weight, labels = torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"liger-kernel .*is not installed"):
        liger_log_probs_and_entropy(hidden, weight, labels)


def test_broken_liger_install_is_raised(monkeypatch, make_package):
    """liger-kernel present but one of its own dependencies missing: the ModuleNotFoundError
    naming that dependency reaches the caller (it is not taken for "not installed")."""
    name, dep = unique("mcore_ppo_liger"), unique("mcore_ppo_dep")
    make_package(name, {"__init__.py": "", "ops.py": f"import {dep}\n"})
    monkeypatch.setattr(liger, "LIGER_MODULE", f"{name}.ops")
    hidden, weight, labels = torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ModuleNotFoundError) as info:
        liger_log_probs_and_entropy(hidden, weight, labels)
    assert info.value.name == dep


# --- backend objects: checked against the protocol once ------------------------------------------


def test_a_backend_object_is_checked_once_and_a_forged_key_is_not_trusted(monkeypatch):
    """A backend object passes the protocol's check the first time it is met (it is then
    registered under its key); later checks return at once (a runtime Protocol ``isinstance``
    costs tens of microseconds per call, and the API checks its options every call). An object
    that carries a registered backend's key without being that backend is checked, and refused."""
    protocol_checks: list[object] = []
    protocol_meta = type(Backend)
    instancecheck = protocol_meta.__instancecheck__

    def counted(cls, instance):
        if cls is Backend:
            protocol_checks.append(instance)
        return instancecheck(cls, instance)

    monkeypatch.setattr(protocol_meta, "__instancecheck__", counted)

    class Wrapped:  # the protocol by delegation, as a user's backend object may be
        name = "wrapped"

        def __init__(self, inner):
            self._inner = inner
            self.capabilities = inner.capabilities

    # Members the class defines (Python 3.12's Protocol check reads them statically, past any
    # ``__getattr__``), each calling the wrapped backend's.
    for member in dir(Backend):
        if not member.startswith("_") and callable(getattr(Backend, member)):
            setattr(Wrapped, member, lambda self, *a, _m=member, **k: getattr(self._inner, _m)(*a, **k))

    wrapped = Wrapped(TorchBackend())
    check_backend(wrapped)
    assert protocol_checks == [wrapped]
    protocol_checks.clear()
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (5,))
    for _ in range(2):
        check_backend(wrapped)
        assert resolve_backend(wrapped, hidden.device) is wrapped
        fused_log_probs_and_entropy(hidden, weight, labels, backend=wrapped)
    assert wrapped not in protocol_checks  # registered: never checked against the protocol again

    class Forged:
        name = "forged"
        op_key = wrapped.op_key

    with pytest.raises(TypeError, match="backend must be a str"):
        check_backend(Forged())
