"""mcore_ppo: a vocab-parallel fused PPO output head for Megatron-Core.

Per token, ``log p(label)`` and the entropy of ``softmax(hidden @ W.T / T)`` with the vocab
sharded over tensor-parallel ranks, without ever holding the ``[tokens, V]`` logits.
"""

from mcore_ppo.api import fused_log_probs_and_entropy
from mcore_ppo.backends import BACKENDS
from mcore_ppo.head import VocabParallelFusedPPOHead
from mcore_ppo.model import build_gpt_model, gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo.verl_compat import linear_cross_entropy

__all__ = [
    "BACKENDS",
    "VocabParallelFusedPPOHead",
    "build_gpt_model",
    "fused_log_probs_and_entropy",
    "gpt_log_probs_and_entropy",
    "install_fused_head",
    "linear_cross_entropy",
]
__version__ = "0.1.0"
