"""Megatron-Core GPT integration: build a small GPT, install the fused head, run the PPO forward.

Three entry points:

- :func:`build_gpt_model` — a ``GPTModel`` with the local (non-TransformerEngine) layer spec on
  the current ``parallel_state``, initialised on the CPU from ``seed`` so every TP layout holds
  the same *global* weights (Megatron's CPU init draws each layer's full master weight and
  keeps this rank's slice).
- :func:`install_fused_head` (from :mod:`mcore_ppo.install`) — replaces ``model.output_layer`` by a
  :class:`~mcore_ppo.head.VocabParallelFusedPPOHead` that owns the *same* ``weight`` Parameter
  object (untied) or none at all (tied: the embedding's weight is passed at call time, as
  ``GPTModel`` does), so state-dict keys, checkpoints, optimizer state and Megatron DDP's
  parameter hooks are unchanged.
- :func:`gpt_log_probs_and_entropy` — runs the model and returns ``(log_probs, entropy)`` on
  the last pipeline stage, without ever materialising the logits.

How the forward reaches the head (decision recorded in ``docs/megatron.md``):

- megatron-core >= 0.18: ``GPTModel.forward(..., output_processor=, output_processor_context=)``
  (feature-detected with :func:`inspect.signature`). The processor receives the decoder's final
  hidden states (still SP-scattered), the output layer and, for tied models, the embedding
  weight; it calls the head *module* (so forward pre-hooks fire) with that weight.
- older versions (0.16.1 here): no monkey-patching of ``GPTModel.forward``. The model runs with
  its ``post_process`` flag cleared for the duration of the call; ``GPTModel._postprocess``
  then returns the decoder's hidden states (the decoder's final norm belongs to the
  ``TransformerBlock``, whose own flag is untouched), and the head module is called on them
  with the weight ``GPTModel`` would have used. This is the path verl/SkyRL use for models
  without the hook. The flag is restored in a ``finally``. The unwrapped ``GPTModel`` is
  called: Megatron's DDP forward only passes through and its hooks live on the inner modules,
  while ``Float16Module`` would upcast the returned hidden states to fp32 on the last stage.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from mcore_ppo.head import VocabParallelFusedPPOHead
from mcore_ppo.install import install_fused_head, unwrap_gpt_model
from mcore_ppo.logs import log_once
from mcore_ppo.validation import check_temperature

__all__ = [
    "build_gpt_model",
    "gpt_log_probs_and_entropy",
    "install_fused_head",
    "supports_output_processor",
    "unwrap_gpt_model",
]


# ---------------------------------------------------------------------------------------------
# Building a small GPT
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------------------------

_HOOK_SUPPORT: dict[type, bool] = {}


def supports_output_processor(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` (unwrapped) takes megatron-core >= 0.18's ``output_processor``."""
    gpt = unwrap_gpt_model(model)
    cls = type(gpt)
    if cls not in _HOOK_SUPPORT:
        try:
            params = inspect.signature(gpt.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _HOOK_SUPPORT[cls] = "output_processor" in params and "output_processor_context" in params
    return _HOOK_SUPPORT[cls]


@dataclass(frozen=True)
class FusedHeadContext:
    """``output_processor_context`` of the fused path.

    Attributes:
        temperature: the per-call temperature (None: the head's default).
        labels: the head's labels when the model was given others (multi-token prediction:
            Megatron's MTP loss gets the labels with ignored tokens replaced and a loss mask,
            :func:`_mtp_labels_and_mask`); None: the labels Megatron passes.
    """

    temperature: float | None = None
    labels: torch.Tensor | None = None


def fused_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    context: FusedHeadContext | None = None,
    config: Any = None,
    **_unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``output_processor`` hook: ``(log_probs, entropy)`` from the fused head.

    ``hidden_states`` arrive as the decoder left them (``[s/tp, b, h]`` under SP); the head
    gathers them. ``output_weight`` is the embedding's weight for tied models, else None.
    The head is called as a module so forward pre-hooks (DDP parameter all-gather) fire.
    """
    if not isinstance(output_layer, VocabParallelFusedPPOHead):
        raise TypeError(
            f"fused_output_processor needs the fused head as output layer (call install_fused_head), "
            f"got {type(output_layer).__name__}"
        )
    if labels is None:
        raise ValueError("fused_output_processor needs labels; call the model without the processor for logits")
    _check_supported_config(config)
    temperature = None if context is None else context.temperature
    if context is not None and context.labels is not None:
        labels = context.labels
    return output_layer(hidden_states, labels, weight=output_weight, temperature=temperature)


def _check_supported_config(config: Any) -> None:
    if config is None:
        return
    if getattr(config, "use_mup", False):
        raise NotImplementedError("the fused head does not apply MuP logit scaling (config.use_mup)")


def gpt_log_probs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    *,
    temperature: float | None = None,
    packed_seq_params: Any | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Run a GPT model whose output layer is the fused head (see :func:`install_fused_head`).

    Args:
        model: a ``GPTModel``, possibly wrapped (DDP, ``Float16Module``).
        input_ids, position_ids, attention_mask: as for ``GPTModel.forward`` (``[b, s]``;
            packed THD: ``[1, t]`` with ``packed_seq_params``).
        labels: global next-token ids ``[b, s]`` (``[1, t]`` packed), already rolled; under CP
            this rank's part from :func:`parallel.roll_and_split_labels`; ``ignore_index``
            marks tokens to skip. None returns what ``GPTModel`` returns (logits on the last
            stage).
        temperature: overrides the head's temperature for this call.
        packed_seq_params: Megatron ``PackedSeqParams`` for THD batches.
        **model_kwargs: other ``GPTModel.forward`` keywords (``decoder_input``,
            ``extra_block_kwargs``, ``padding_mask``, ...).

    Returns:
        Last pipeline stage: ``(log_probs, entropy)``, fp32, shaped like ``labels``, identical
        on every TP rank. Other stages: the hidden states ``GPTModel`` returns there.
        ``labels=None``: the model's own output (``[b, s, V/tp]`` logits on the last stage).
    """
    if temperature is not None:
        temperature = check_temperature(temperature)
    gpt = unwrap_gpt_model(model)
    forward_kwargs = dict(model_kwargs)
    forward_kwargs["packed_seq_params"] = packed_seq_params
    if labels is None or not gpt.post_process:
        return model(input_ids, position_ids, attention_mask, **forward_kwargs)
    head = gpt.output_layer
    if not isinstance(head, VocabParallelFusedPPOHead):
        raise TypeError(
            "gpt_log_probs_and_entropy needs the fused head as the model's output layer: call "
            f"install_fused_head(model) first (found {type(head).__name__})"
        )
    _check_supported_config(gpt.config)
    if supports_output_processor(gpt):
        context = FusedHeadContext(temperature)
        model_labels = labels
        if getattr(gpt.config, "mtp_num_layers", None):
            model_labels, forward_kwargs["loss_mask"] = _mtp_labels_and_mask(
                gpt, head, labels, forward_kwargs.get("loss_mask")
            )
            context = FusedHeadContext(temperature, labels)
        return model(
            input_ids,
            position_ids,
            attention_mask,
            labels=model_labels,
            output_processor=fused_output_processor,
            output_processor_context=context,
            **forward_kwargs,
        )
    return _forward_without_hook(
        gpt, head, input_ids, position_ids, attention_mask, labels, temperature, forward_kwargs
    )


def _mtp_labels_and_mask(
    gpt: torch.nn.Module, head: VocabParallelFusedPPOHead, labels: torch.Tensor, loss_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss mask for Megatron's multi-token prediction loss, which runs before the processor.

    Megatron's MTP loss (``process_mtp_loss``, megatron-core >= 0.18) rolls the labels and the loss
    mask once per depth and multiplies each depth's cross entropy by the mask; its vocab-parallel
    cross entropy has no ignore index (a label of -100 gives a finite, wrong loss). So the tokens
    the head ignores get label 0 and mask 0 here (times the caller's ``loss_mask``), and the
    head gets its own labels through :class:`FusedHeadContext`.
    """
    ignored = labels == head.ignore_index
    keep = (~ignored).to(torch.float32)
    if loss_mask is not None:
        keep = keep * loss_mask.to(torch.float32)
    fused_depths = bool(getattr(gpt, "fuse_linear_cross_entropy", False))
    log_once(
        logging.INFO,
        ("mtp", fused_depths),
        "mcore_ppo: multi-token prediction: %d depth(s), loss mask carried (ignored tokens masked); %s",
        gpt.config.mtp_num_layers,
        "each depth's cross entropy through the fused head (LinearCrossEntropyModule contract, no logits)"
        if fused_depths
        else "each depth's cross entropy from Megatron's logits [s, b, V/tp] (its process_mtp_loss has no "
        "hook for a fused loss; cross_entropy_fusion_impl='linear' on Megatron's dev branch avoids them)",
    )
    return labels.masked_fill(ignored, 0), keep


def _forward_without_hook(
    gpt: torch.nn.Module,
    head: VocabParallelFusedPPOHead,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float | None,
    forward_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core < 0.18: the model with ``post_process`` cleared, then the head module."""
    if getattr(gpt.config, "mtp_num_layers", None):
        raise NotImplementedError(
            "multi-token prediction needs megatron-core >= 0.18 (the output_processor hook) for the fused head"
        )
    if getattr(gpt.config, "fine_grained_activation_offloading", False):
        # GPTModel marks the output layer's parameters only while post_process is set.
        _mark_not_offloadable(head)
    output_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    gpt.post_process = False
    try:
        hidden_states = gpt(input_ids, position_ids, attention_mask, **forward_kwargs)
    finally:
        gpt.post_process = True
    return head(hidden_states, labels, weight=output_weight, temperature=temperature)


def _mark_not_offloadable(module: torch.nn.Module) -> None:
    from megatron.core.models.gpt import gpt_model

    mark: Callable[[torch.Tensor], None] | None = getattr(
        getattr(gpt_model, "off_interface", None), "mark_not_offloadable", None
    )
    if mark is not None:
        for param in module.parameters():
            mark(param)
