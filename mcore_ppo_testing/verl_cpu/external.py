"""verl's external module for its trainer on the CPU: what importing it installs, in every process.

verl imports it itself in every process it starts, with
``VERL_USE_EXTERNAL_MODULES=mcore_ppo_testing.verl_cpu.external`` (read by ``import verl``,
before its ``verl.plugins`` entry points, so before the mcore_ppo plugin). Only verl's processes
import it: its effects are process-wide (the package's other modules have none). Importing it:

- registers the CPU platform (:mod:`.platform`; selected with ``VERL_PLATFORM=cpu``);
- adds the ``hf_cpu`` rollout (:mod:`.rollout`) to verl's two rollout registries when verl
  imports them, and, where SGLang is not installed, serves verl's ``sglang`` replicas with it
  (verl's distillation accepts only vLLM and SGLang teachers);
- when verl's Megatron engine is imported (the actor workers), installs the CPU shims for
  Megatron, mbridge and the optimizer (:mod:`.megatron`);
- with ``MCORE_PPO_VERL_RECORD_DIR`` set, counts the head's passes per process and saves each
  step's log-probs (:mod:`.records`).

"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from mcore_ppo.integrations.import_hook import AfterImportHook
from mcore_ppo_testing.verl_cpu.platform import register_cpu_platform

__all__ = ["install"]

_ROLLOUT_BASE = "verl.workers.rollout.base"
_ROLLOUT_REPLICA = "verl.workers.rollout.replica"
_ENGINE = "verl.workers.engine.megatron.transformer_impl"
_TRAINER = "verl.trainer.ppo.ray_trainer"
_HEAD = "mcore_ppo.shard"
_HOOK: AfterImportHook | None = None


def _on_import(module: ModuleType) -> None:
    from mcore_ppo_testing.verl_cpu import records, rollout

    name = module.__name__
    if name == _ROLLOUT_BASE:
        module._ROLLOUT_REGISTRY[(rollout.ROLLOUT_NAME, "async")] = f"{rollout.__name__}.HFServerAdapter"
    elif name == _ROLLOUT_REPLICA:
        module.RolloutReplicaRegistry.register(rollout.ROLLOUT_NAME, lambda: rollout.HFReplica)
        if importlib.util.find_spec("sglang") is None:
            # verl's distillation config takes vLLM and SGLang teachers only (its top-k check);
            # where SGLang is not installed, an "sglang" teacher is served by hf_cpu.
            module.RolloutReplicaRegistry.register("sglang", lambda: rollout.HFReplica)
    elif name == _ENGINE:
        from mcore_ppo_testing.verl_cpu.megatron import install_engine_shims

        install_engine_shims()
    elif name == _TRAINER:
        records.record_old_log_probs(module)
    elif name == _HEAD:
        records.count_head_passes(module)


def install() -> None:
    """Register the platform and hook the modules above (idempotent); verl's import calls it."""
    global _HOOK
    register_cpu_platform()
    if _HOOK is None:
        _HOOK = AfterImportHook((_ROLLOUT_BASE, _ROLLOUT_REPLICA, _ENGINE, _TRAINER, _HEAD), _on_import)
        _HOOK.install()


install()
