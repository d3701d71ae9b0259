"""Building a small Megatron-Core ``GPTModel`` for tests, benchmarks and the demo.

:func:`build_gpt_model` gives a ``GPTModel`` with the local (non-TransformerEngine) layer spec on
the current ``parallel_state``, initialised on the CPU from ``seed`` so every TP layout holds
the same *global* weights (Megatron's CPU init draws each layer's full master weight and keeps
this rank's slice). Re-exported by :mod:`mcore_ppo.model` and ``mcore_ppo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

__all__ = ["build_gpt_model"]


# GPTModel's position embeddings that need nothing beyond the config (mrope needs a multimodal section).
_POSITION_EMBEDDINGS = frozenset({"learned_absolute", "rope", "none"})


def build_gpt_model(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    vocab_size: int,
    max_sequence_length: int,
    ffn_hidden_size: int | None = None,
    tie_embeddings: bool = False,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 1234,
    transformer_layer_spec: Any | Callable[[Any], Any] | None = None,
    mtp_block_spec: Any | Callable[[Any, Any], Any] | None = None,
    device: torch.device | str | None = None,
    position_embedding_type: str = "learned_absolute",
    **config_overrides: Any,
) -> GPTModel:
    """A ``GPTModel`` with Megatron's local layer spec on the current ``parallel_state``.

    ``initialize_model_parallel`` is the caller's job (TP/CP/PP sizes are read from it).
    Dropout is 0 and weights are initialised on the CPU (``use_cpu_initialization``) from
    ``seed``, with the global torch RNG forked so the caller's RNG stream is untouched: every
    TP layout then holds the same global weights, the basis of layout-parity tests.

    Args:
        num_layers, hidden_size, num_attention_heads, ffn_hidden_size: transformer shape
            (``ffn_hidden_size`` defaults to ``4 * hidden_size``).
        vocab_size: global vocab size; must divide by the TP size (Megatron's output layer).
        max_sequence_length: size of the learned absolute position table.
        tie_embeddings: share the input embedding and the output layer weight.
        sequence_parallel: Megatron SP (needs TP > 1).
        params_dtype: parameter dtype (fp32 or fp64 for tight comparisons; bf16 with a
            ``Float16Module`` wrapper as in Megatron training).
        pre_process, post_process: pipeline-stage flags (first / last stage).
        seed: seed of the CPU initialisation.
        transformer_layer_spec: a layer or block spec to use instead of
            ``get_gpt_layer_local_spec()``, or a function of the ``TransformerConfig`` returning
            one (as Megatron's ``get_gpt_decoder_block_spec(config, ...)`` needs the config), for
            example :func:`mcore_ppo_testing.layer_specs.local_gpt_spec`.
        mtp_block_spec: multi-token prediction (with ``mtp_num_layers=D`` among the overrides):
            Megatron's MTP block spec, or a function of ``(config, layer spec)`` returning one,
            e.g. ``lambda config, spec: get_gpt_mtp_block_spec(config, spec, False)``.
        device: where the parameters end up; default CUDA's current device when CUDA is
            available, else the CPU.
        position_embedding_type: GPTModel's ``"learned_absolute"`` (a table of
            ``max_sequence_length`` positions, read from ``position_ids``) or ``"rope"`` (rotary,
            positions from the sequence or the packed ``cu_seqlens``, as Llama/Qwen models).
        **config_overrides: any other ``TransformerConfig`` field.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_gpt_model needs megatron.core.parallel_state: call initialize_model_parallel(...) first"
        )
    if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
        raise TypeError(f"params_dtype must be a floating torch.dtype, got {params_dtype!r}")
    if not isinstance(position_embedding_type, str):
        raise TypeError(f"position_embedding_type must be a str, got {type(position_embedding_type).__name__}")
    if position_embedding_type not in _POSITION_EMBEDDINGS:
        raise ValueError(
            f"position_embedding_type must be one of {sorted(_POSITION_EMBEDDINGS)}, got {position_embedding_type!r}"
        )
    config_kwargs: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "ffn_hidden_size": ffn_hidden_size,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "sequence_parallel": sequence_parallel,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # The fused path needs no gradient-accumulation fusion kernel; without CUDA it does not exist.
        "gradient_accumulation_fusion": False,
    }
    config_kwargs.update(config_overrides)
    config = TransformerConfig(**config_kwargs)
    spec = transformer_layer_spec if transformer_layer_spec is not None else get_gpt_layer_local_spec()
    # A spec factory of the config. Specs are dataclasses, but a ModuleSpec is callable too (it
    # builds its module), so it is told apart by type, not by callable().
    if callable(spec) and not isinstance(spec, ModuleSpec):
        spec = spec(config)
    if callable(mtp_block_spec) and not isinstance(mtp_block_spec, ModuleSpec):
        mtp_block_spec = mtp_block_spec(config, spec)

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not _rng_tracker_seeded():
        # Megatron's dropout/init contexts fork this tracker; it must hold a state on CUDA.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie_embeddings,
            mtp_block_spec=mtp_block_spec,
            position_embedding_type=position_embedding_type,
        )
    # Plain torch modules inside the local spec (the position table; the norms when Apex is
    # absent) are built in torch's default dtype whatever params_dtype says. Keep one dtype
    # throughout, as Megatron's Float16Module does for bf16 (Parameters are converted in place).
    for module in model.modules():
        if isinstance(module, _PLAIN_TORCH_MODULES):
            module.to(params_dtype)
    return model.to(device)


_PLAIN_TORCH_MODULES = (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm)


def _rng_tracker_seeded() -> bool:
    from megatron.core import tensor_parallel

    return bool(tensor_parallel.get_cuda_rng_tracker().get_states())
