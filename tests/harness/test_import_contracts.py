"""The installed namespace and the import walls of pyproject.toml stay whole as modules are added."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import tomllib

import mcore_ppo

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_parallel_contract_forbids_every_other_product_module():
    contract = next(
        c
        for c in _pyproject()["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["mcore_ppo.parallel"]
    )
    siblings = {f"mcore_ppo.{m.name}" for m in pkgutil.iter_modules(mcore_ppo.__path__)} - {"mcore_ppo.parallel"}
    assert siblings, "no product modules found"
    missing = siblings - set(contract["forbidden_modules"])
    assert not missing, f"add {sorted(missing)} to the mcore_ppo.parallel contract's forbidden_modules"


def test_the_triton_backend_layers_name_every_triton_module():
    """The one-way order of the triton backend's modules covers each of them (a new module gets a layer)."""
    import mcore_ppo.backends

    contract = next(c for c in _pyproject()["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    layered = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    modules = {
        f"mcore_ppo.backends.{m.name}"
        for m in pkgutil.iter_modules(mcore_ppo.backends.__path__)
        if m.name.startswith("triton_")
    }
    assert modules and modules == layered, sorted(modules ^ layered)


def test_the_wheel_installs_the_project_namespace_only():
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(name == "mcore_ppo" or name.startswith("mcore_ppo.") for name in include), include
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    # mcore_ppo_testing is the harness, used from a checkout (never in the wheel).
    assert top_level == {"mcore_ppo", "mcore_ppo_testing"}, top_level
