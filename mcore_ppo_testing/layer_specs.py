"""GPT specs for runs without TransformerEngine: Megatron's local spec with SP norms and THD/CP attention.

:func:`local_gpt_spec` is what ``build_gpt_model(transformer_layer_spec=...)`` takes for the
tests, the CPU demo and the GPU benchmarks: a function of the ``TransformerConfig`` (like
Megatron's own ``get_gpt_decoder_block_spec(config, ...)``) returning the decoder block of this
pipeline stage, whose layers are Megatron's local layer spec with

- a core attention that runs packed THD batches and, for ``"sdpa"``, context parallelism
  (:mod:`mcore_ppo_testing.attention`);
- norms that run under sequence parallelism (:class:`~mcore_ppo_testing.norms.SequenceParallelTorchNorm`),
  in the layers *and* as the block's final norm (a layer spec alone would leave the final norm
  to Megatron's module default, ``WrappedTorchNorm``, which refuses SP).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from mcore_ppo_testing.attention import SdpaAttention, ThdDotProductAttention
from mcore_ppo_testing.norms import SequenceParallelTorchNorm

__all__ = ["ATTENTIONS", "local_gpt_spec", "local_layer_spec"]

# Core attentions by name: "reference" is Megatron's unfused softmax over a packed causal mask
# (O(t²), CP 1; the oracle), "sdpa" is torch SDPA / flash varlen with context parallelism, and
# "megatron" is Megatron's DotProductAttention itself (padded batches and explicit masks only).
ATTENTIONS = {"reference": ThdDotProductAttention, "sdpa": SdpaAttention, "megatron": DotProductAttention}


def local_layer_spec(*, attention: str = "reference", **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec(**kwargs)`` with the named core attention and SP-capable norms.

    Args:
        attention: ``"reference"``, ``"sdpa"`` or ``"megatron"`` (see :data:`ATTENTIONS`).
        **kwargs: passed to Megatron's ``get_gpt_layer_local_spec``.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, got {attention!r}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(**kwargs))
    spec.submodules.self_attention.submodules.core_attention = ATTENTIONS[attention]
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return spec


def local_gpt_spec(*, attention: str = "reference", **kwargs: Any) -> Callable[[Any], TransformerBlockSubmodules]:
    """The decoder block spec as a function of the config: this pipeline stage's layers
    (:func:`local_layer_spec`) and an SP-capable final norm. Pass it to
    :func:`mcore_ppo_testing.gpt_builder.build_gpt_model` as ``transformer_layer_spec``."""
    layer = local_layer_spec(attention=attention, **kwargs)

    def block_spec(config: Any) -> TransformerBlockSubmodules:
        return TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=SequenceParallelTorchNorm
        )

    return block_spec
