"""mcore_ppo: a vocab-parallel fused PPO output head for Megatron-Core.

Per token, ``log p(label)`` and the entropy of ``softmax(hidden @ W.T / T)`` with the vocab
sharded over tensor-parallel ranks, without ever holding the ``[tokens, V]`` logits.

The public names are loaded on first use (PEP 562), so ``import mcore_ppo.kernels``,
``mcore_ppo.backends`` or ``mcore_ppo.function`` needs torch (and triton) only; the Megatron
integration (the head module, the model helpers) imports megatron-core when it is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_ppo.api import fused_log_probs_and_entropy, fused_log_probs_at
    from mcore_ppo.backends import BACKENDS, TorchBackend, TorchConfig, TritonBackend, TritonConfig
    from mcore_ppo.distill.topk import TopKConfig, fused_topk
    from mcore_ppo.head import VocabParallelFusedPPOHead
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
    from mcore_ppo.liger import liger_log_probs_and_entropy
    from mcore_ppo.model import gpt_log_probs_and_entropy, install_fused_head
    from mcore_ppo.options import HeadOptions

# public name -> the module that defines it
_EXPORTS = {
    "BACKENDS": "mcore_ppo.backends",
    "HeadOptions": "mcore_ppo.options",
    "TopKConfig": "mcore_ppo.distill.topk",
    "TorchBackend": "mcore_ppo.backends",
    "TorchConfig": "mcore_ppo.backends",
    "TritonBackend": "mcore_ppo.backends",
    "TritonConfig": "mcore_ppo.backends",
    "VocabParallelFusedPPOHead": "mcore_ppo.head",
    "fused_log_probs_and_entropy": "mcore_ppo.api",
    "fused_log_probs_at": "mcore_ppo.api",
    "fused_topk": "mcore_ppo.distill.topk",
    "gpt_log_probs_and_entropy": "mcore_ppo.model",
    "install_fused_head": "mcore_ppo.model",
    "liger_log_probs_and_entropy": "mcore_ppo.liger",
    "linear_cross_entropy": "mcore_ppo.integrations.verl.kernel",
}

__all__ = [
    "BACKENDS",
    "HeadOptions",
    "TopKConfig",
    "TorchBackend",
    "TorchConfig",
    "TritonBackend",
    "TritonConfig",
    "VocabParallelFusedPPOHead",
    "fused_log_probs_and_entropy",
    "fused_log_probs_at",
    "fused_topk",
    "gpt_log_probs_and_entropy",
    "install_fused_head",
    "liger_log_probs_and_entropy",
    "linear_cross_entropy",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcore_ppo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
