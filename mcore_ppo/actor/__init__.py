"""A Megatron PPO actor worker: log-prob pass and clipped-surrogate policy update over micro-batches.

The actor runs a Megatron ``GPTModel`` whose output layer is the fused head
(:func:`mcore_ppo.model.install_fused_head`) through Megatron's own forward-backward schedule
(``get_forward_backward_func()``), on packed THD micro-batches built from a
:class:`~mcore_ppo.actor.batching.PackedRollout`. It follows verl's Megatron actor
(``compute_log_prob`` / ``update_policy``), with three differences that make the numbers the
same under every TP/CP/DP layout and micro-batch split:

- Loss aggregation uses *global* counts (response tokens / sequences over every micro-batch,
  DP rank and CP shard, one all-reduce each) and returns to the schedule the factor that
  undoes its ``× cp / num_microbatches`` and the DP×CP gradient averaging (:mod:`.loss`).
- Labels are rolled on the global sequence before the CP split
  (:func:`mcore_ppo.parallel.roll_and_split_labels`), never after.
- Context parallelism at the head, for models that cannot run CP themselves (:mod:`.layout`).

Modules, one concern each: :mod:`.worker` (:class:`MegatronPPOActor`: batching, the schedule,
``compute_log_prob``, ``update_policy``), :mod:`.config` (:class:`PPOActorConfig`),
:mod:`.layout` (:class:`ActorParallel`, CP at the head), :mod:`.loss` (weights, the loss
function, metrics), :mod:`.grads` (Megatron's gradient finalisation, norm and clipping).

The names load on first use (PEP 562), so ``PPOActorConfig`` imports without Megatron: the demo
launcher checks a config with it before it starts torchrun.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_ppo.actor.config import PPOActorConfig
    from mcore_ppo.actor.layout import ActorParallel
    from mcore_ppo.actor.worker import MegatronPPOActor

# public name -> the module that defines it
_EXPORTS = {
    "ActorParallel": "mcore_ppo.actor.layout",
    "MegatronPPOActor": "mcore_ppo.actor.worker",
    "PPOActorConfig": "mcore_ppo.actor.config",
}

__all__ = ["ActorParallel", "MegatronPPOActor", "PPOActorConfig"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcore_ppo.actor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
