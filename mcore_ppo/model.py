"""Megatron-Core GPT integration: build a small GPT, install the fused head, run the PPO forward.

Entry points (and :func:`build_gpt_model`, re-exported from :mod:`mcore_ppo.gpt_builder`):

- :func:`install_fused_head` — replaces ``model.output_layer`` by a
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo.backends.base import Backend
from mcore_ppo.gpt_builder import build_gpt_model
from mcore_ppo.head import VocabParallelFusedPPOHead
from mcore_ppo.pipeline import HeadOptions
from mcore_ppo.validation import check_temperature

__all__ = [
    "build_gpt_model",
    "gpt_log_probs_and_entropy",
    "install_fused_head",
    "supports_output_processor",
    "unwrap_gpt_model",
]


# ---------------------------------------------------------------------------------------------
# Installing the head
# ---------------------------------------------------------------------------------------------


def unwrap_gpt_model(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost language model under DDP / FSDP / ``Float16Module`` wrappers (anything with
    a ``.module`` that is not itself a language module)."""
    inner = model
    while not hasattr(inner, "post_process") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    if not hasattr(inner, "post_process"):
        raise TypeError(f"expected a Megatron GPTModel (possibly wrapped), got {type(model).__name__}")
    return inner


# Forward/backward hook registries of an nn.Module. The head takes over the replaced layer's
# dicts (the same objects), so hooks registered before the swap (Megatron DDP's forward
# pre-hook that waits for the parameter all-gather) fire on the head and their handles still
# remove them. State-dict hooks stay the head's own (ColumnParallelLinear registers its own).
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _take_over_hooks(model: torch.nn.Module, old: torch.nn.Module, head: torch.nn.Module) -> None:
    for name in _HOOK_DICTS:
        if not hasattr(old, name) or not hasattr(head, name):
            continue
        shared = getattr(old, name)
        shared.update(getattr(head, name))
        setattr(head, name, shared)
    # Megatron DDP keys its forward-pre-hook handles by module (disable_forward_pre_hook looks
    # every current submodule up): re-key the old layer's handle to the head.
    wrapper = model
    while wrapper is not None:
        handles = getattr(wrapper, "remove_forward_pre_hook_handles", None)
        if isinstance(handles, dict) and old in handles:
            handles[head] = handles.pop(old)
        wrapper = getattr(wrapper, "module", None) if wrapper is not old else None


def install_fused_head(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    backend: str | Backend = "auto",
    ignore_index: int = -100,
    buffer_budget_bytes: int | None = None,
) -> VocabParallelFusedPPOHead | None:
    """Make ``model``'s output layer a :class:`VocabParallelFusedPPOHead` (idempotent).

    Untied: the head registers the *same* ``weight`` Parameter object as the layer it replaces,
    so ``state_dict`` keys, loaded checkpoints, optimizer state, DDP buffers and gradient hooks
    are unchanged. Tied: the head allocates no weight and receives the embedding's at call
    time, exactly as ``GPTModel`` passes it to ``ColumnParallelLinear``. Hooks registered on
    the old layer (Megatron DDP's forward pre-hook) are carried over, so the head may be
    installed before or after wrapping in DDP; before is the usual order.

    ``temperature``, ``backend``, ``ignore_index`` and ``buffer_budget_bytes`` are the head's
    options (:class:`mcore_ppo.pipeline.HeadOptions`), checked before the model is looked at.

    Called again on a model that has the head, it updates ``temperature``, ``backend``,
    ``ignore_index`` and ``buffer_budget_bytes`` and returns the same head.

    Returns:
        The head on the last pipeline stage; None on other stages (they have no output layer).

    Raises:
        TypeError: the model's output layer is not a ``ColumnParallelLinear`` (e.g. a
            TransformerEngine MXFP8 LM head), or it has a bias.
        NotImplementedError: ``config.defer_embedding_wgrad_compute`` is set.
    """
    options = HeadOptions(temperature, ignore_index, backend, buffer_budget_bytes)
    gpt = unwrap_gpt_model(model)
    if not gpt.post_process:
        return None
    old = gpt.output_layer
    if isinstance(old, VocabParallelFusedPPOHead):
        old.temperature, old.backend, old.ignore_index = options.temperature, options.backend, options.ignore_index
        old.buffer_budget_bytes = options.buffer_budget_bytes
        return old
    if type(old) is not ColumnParallelLinear:
        raise TypeError(
            f"install_fused_head supports Megatron's ColumnParallelLinear output layer, got {type(old).__name__}"
        )
    if old.bias is not None:
        raise TypeError("install_fused_head: the output layer has a bias; the fused head has none")
    if getattr(old.config, "defer_embedding_wgrad_compute", False):
        # Megatron would compute the output weight's gradient at the pipeline flush from buffers
        # the fused path never fills; the fused path computes it in its own backward.
        raise NotImplementedError("install_fused_head does not support config.defer_embedding_wgrad_compute")

    head = VocabParallelFusedPPOHead(
        old.input_size,
        old.output_size,
        config=old.config,
        init_method=_no_init,
        temperature=options.temperature,
        ignore_index=options.ignore_index,
        backend=options.backend,
        buffer_budget_bytes=options.buffer_budget_bytes,
        gather_output=old.gather_output,
        # Never allocate (or initialise, drawing from the RNG) a weight that is replaced below.
        skip_weight_param_allocation=True,
        embedding_activation_buffer=old.embedding_activation_buffer,
        grad_output_buffer=old.grad_output_buffer,
        tp_group=old.tp_group,
        disable_grad_reduce=old.disable_grad_reduce,
    )
    head.skip_bias_add = old.skip_bias_add
    if old.weight is not None:
        head.weight = old.weight  # the same Parameter object: registered under the same key
    head.train(old.training)
    _take_over_hooks(model, old, head)
    gpt.output_layer = head
    return head


def _no_init(weight: torch.Tensor) -> None:  # the init_method signature
    """The head never initialises a weight: it shares the replaced layer's (or the embedding's)."""


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
    """``output_processor_context`` of the fused path: the per-call temperature (None = head default)."""

    temperature: float | None = None


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
        return model(
            input_ids,
            position_ids,
            attention_mask,
            labels=labels,
            output_processor=fused_output_processor,
            output_processor_context=FusedHeadContext(temperature),
            **forward_kwargs,
        )
    return _forward_without_hook(
        gpt, head, input_ids, position_ids, attention_mask, labels, temperature, forward_kwargs
    )


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
