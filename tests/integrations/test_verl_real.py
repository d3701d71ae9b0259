"""verl's *real* package (the verl 0.9.1 wheel) loads the plugin, in a fresh process each time.

- ``VERL_USE_EXTERNAL_MODULES=mcore_ppo.integrations.verl`` (how verl <= 0.8 loads external
  code; verl 0.9 still honours it), with verl's entry-point loading turned off
  (``VERL_USE_EXTERNAL_PLUGINS=none``) so that only that list can load the plugin;
- the ``verl.plugins`` entry point (verl >= 0.9), where mcore_ppo is pip-installed, switched by
  ``MCORE_PPO_VERL``.

Switched on, every verl function the plugin replaces is replaced (the kernel binding and the call
sites of ``mcore_ppo.integrations.verl.engine``), with no "has no" warning. What verl then computes
is in ``tests/integrations/test_verl_live.py`` (its real engine ``forward_step``). Where Ray is not
installed a stand-in answers ``import ray`` (``mcore_ppo_testing.real_verl``).

Each process is forked from one that has imported verl's heavy dependencies, which take no part in
the plugin's loading (torch, Megatron, transformers, tensordict: ``mcore_ppo_testing.fork_server``),
and otherwise starts as a new interpreter with its environment would: verl, mcore_ppo and the
plugin are imported afresh in every one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import pytest

from mcore_ppo_testing.real_verl import RAY_STANDIN, ray_missing, require_verl

REPO = Path(__file__).resolve().parents[2]

require_verl()


def _child_env(**env: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "MCORE_PPO_VERL"))}
    paths = [str(REPO), environ.get("PYTHONPATH", "")]
    if ray_missing():
        paths.append(str(RAY_STANDIN))
    environ.update(env, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return environ


_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import verl
import verl.models.mcore.model_forward_fused as fused
import verl.models.mcore.registry as registry
import verl.workers.engine.megatron.transformer_impl as impl
from verl.utils.kernel import linear_cross_entropy as kernel
bound = fused.linear_cross_entropy
wrapped = [
    fused.fused_output_processor, fused._fused_GPTModel_forward, fused.fused_forward_model_engine,
    registry.fused_forward_model_engine, impl._resolve_fused_temperature,
    impl.MegatronEngine._maybe_enable_fused_kernels, impl.MegatronEngineWithLMHead.forward_step,
    impl.MegatronEngineWithValueHead.forward_step,
]
print(json.dumps({
    "version": getattr(verl, "__version__", "?"),
    "bound": "verl's kernel" if bound is kernel.linear_cross_entropy else bound.__module__,
    "wrapped": sum(hasattr(f, "__mcore_ppo_original__") for f in wrapped),
    "of": len(wrapped),
}))
"""


PRELOADED = tuple(m for m in ("torch", "megatron.core", "transformers", "tensordict") if importlib.util.find_spec(m))


@pytest.fixture
def import_real_verl_in_child(fork_server):
    """``import_real_verl_in_child(**env)``: the child's report (JSON) and its log."""

    def run(**env: str) -> tuple[dict, str]:
        done = fork_server(*PRELOADED).run(_CHILD, env=_child_env(**env), timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    return run


def _assert_switched(result: dict, log: str, on: bool) -> None:
    assert result["bound"] == ("mcore_ppo.integrations.verl" if on else "verl's kernel")
    assert result["wrapped"] == (result["of"] if on else 0)
    assert ("mcore_ppo verl plugin: installed" in log) == on
    assert "has no" not in log  # every function the plugin replaces is where it expects it


def test_real_verl_loads_the_plugin_through_verl_use_external_modules(import_real_verl_in_child):
    named = {"VERL_USE_EXTERNAL_MODULES": "mcore_ppo.integrations.verl", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    on, on_log = import_real_verl_in_child(**named)
    off, off_log = import_real_verl_in_child(**named, MCORE_PPO_VERL="0")
    print(f"verl {on['version']}: on -> {on['bound']} ({on['wrapped']}/{on['of']} wrapped), off -> {off['bound']}")
    _assert_switched(on, on_log, True)
    _assert_switched(off, off_log, False)


def test_real_verl_entry_point_switch(import_real_verl_in_child):
    points = importlib.metadata.entry_points(group="verl.plugins")
    if not any(p.value == "mcore_ppo.integrations.verl" for p in points):
        pytest.skip("mcore_ppo is not pip-installed here, so verl.plugins has no entry point for it")
    _assert_switched(*import_real_verl_in_child(), False)  # loaded, not asked
    _assert_switched(*import_real_verl_in_child(MCORE_PPO_VERL="1"), True)
