"""Megatron-Core GPT integration: install the fused head, run the PPO forward.

Two entry points:

- :func:`install_fused_head` (from :mod:`mcore_ppo.install`) — replaces ``model.output_layer`` by a
  :class:`~mcore_ppo.head.VocabParallelFusedPPOHead` that owns the *same* ``weight`` Parameter
  object (untied) or none at all (tied: the embedding's weight is passed at call time, as
  ``GPTModel`` does), so state-dict keys, checkpoints, optimizer state and Megatron DDP's
  parameter hooks are unchanged.
- :func:`gpt_log_probs_and_entropy` — runs the model and returns ``(log_probs, entropy)`` (with
  ``return_sum_pi_squared``: ``(log_probs, entropy, sum_pi_squared)``) on the last pipeline
  stage, without ever materialising the logits.

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

from mcore_ppo.head import VocabParallelFusedPPOHead
from mcore_ppo.head_call import attempt, share_refusal
from mcore_ppo.install import install_fused_head, unwrap_gpt_model
from mcore_ppo.logs import log_once
from mcore_ppo.parallel.groups import ProcessGroup, resolve_tp_group
from mcore_ppo.validation import VALIDATE_DEFAULT, check_temperature, check_tensor

__all__ = [
    "check_supported_config",
    "gpt_log_probs_and_entropy",
    "hidden_states_without_postprocess",
    "install_fused_head",
    "supports_output_processor",
    "unwrap_gpt_model",
]


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
        temperature: the per-call temperature, a float or a per-token tensor (None: the head's default).
        return_entropy: the per-call entropy switch (None: the head's ``return_entropy``).
        return_sum_pi_squared: the per-call Σπ² switch (None: the head's ``return_sum_pi_squared``).
        labels: the head's labels when the model was given others (multi-token prediction:
            Megatron's MTP loss gets the labels with ignored tokens replaced and a loss mask,
            :func:`_mtp_labels_and_mask`); None: the labels Megatron passes.
    """

    temperature: float | torch.Tensor | None = None
    labels: torch.Tensor | None = None
    return_entropy: bool | None = None
    return_sum_pi_squared: bool | None = None


def fused_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    context: FusedHeadContext | None = None,
    config: Any = None,
    **_unused: Any,
) -> tuple[torch.Tensor, ...]:
    """megatron-core's ``output_processor`` hook: ``(log_probs, entropy)`` from the fused head
    (``(log_probs, entropy, sum_pi_squared)`` when Σπ² is on for the call).

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
    check_supported_config(config)
    context = _NO_CONTEXT if context is None else context
    labels = labels if context.labels is None else context.labels
    return output_layer(
        hidden_states,
        labels,
        weight=output_weight,
        temperature=context.temperature,
        return_entropy=context.return_entropy,
        return_sum_pi_squared=context.return_sum_pi_squared,
    )


_NO_CONTEXT = FusedHeadContext()


def check_supported_config(config: Any) -> None:
    """Refuse a model config whose output the fused head (or top-k) would compute differently
    (MuP's logit scaling, which megatron-core applies in its own output path): NotImplementedError."""
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
    temperature: float | torch.Tensor | None = None,
    packed_seq_params: Any | None = None,
    return_entropy: bool | None = None,
    return_sum_pi_squared: bool | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor | None, ...] | torch.Tensor:
    """Run a GPT model whose output layer is the fused head (see :func:`install_fused_head`).

    Args:
        model: a ``GPTModel``, possibly wrapped (DDP, ``Float16Module``).
        input_ids, position_ids, attention_mask: as for ``GPTModel.forward`` (``[b, s]``;
            packed THD: ``[1, t]`` with ``packed_seq_params``).
        labels: global next-token ids ``[b, s]`` (``[1, t]`` packed), already rolled; under CP
            this rank's part from :func:`mcore_ppo.parallel.roll_and_split_labels`; ``ignore_index``
            marks tokens to skip. None returns what ``GPTModel`` returns (logits on the last
            stage).
        temperature: overrides the head's temperature for this call: a float, or a per-token
            floating-point tensor shaped like ``labels`` or broadcastable to them (``[b, 1]``
            per sequence); under CP this rank's part, split like the labels
            (:func:`mcore_ppo.parallel.split_temperature_for_cp`). The tensor gets no gradient.
        packed_seq_params: Megatron ``PackedSeqParams`` for THD batches.
        return_entropy: False returns ``(log_probs, None)`` and skips the entropy work
            (None: the head's ``return_entropy``, True unless it was built otherwise).
        return_sum_pi_squared: True returns ``(log_probs, entropy, sum_pi_squared)``, the third
            per token ``Σ_v π_v²`` of the same tempered softmax (fp32, no gradient, 0 for ignored
            tokens); False the 2-tuple (None: the head's ``return_sum_pi_squared``, False unless it
            was built otherwise, e.g. ``install_fused_head(model, return_sum_pi_squared=True)``).
        **model_kwargs: other ``GPTModel.forward`` keywords (``decoder_input``,
            ``extra_block_kwargs``, ``padding_mask``, ...).

    Returns:
        Last pipeline stage: ``(log_probs, entropy)``, fp32, shaped like ``labels``, identical
        on every TP rank (``entropy`` None when it is off); ``(log_probs, entropy,
        sum_pi_squared)`` when Σπ² is on for the call. Other stages: the hidden states
        ``GPTModel`` returns there. ``labels=None``: the model's own output (``[b, s, V/tp]``
        logits on the last stage).

    Raises:
        TypeError, ValueError: a bad ``temperature``, ``return_entropy`` or
            ``return_sum_pi_squared``, or ``input_ids`` / ``position_ids`` that are not integer
            tensors, on every rank of the model's TP group before the model runs (the refusing
            rank its own error, the others a ValueError saying a peer refused, shared as the
            head's verdict is: ``docs/design.md`` §5); the head's checks of the labels and a
            temperature tensor after the model, before the head's first collective.
    """
    temperature, error = attempt(
        lambda: _checked_arguments(temperature, return_entropy, return_sum_pi_squared, input_ids, position_ids),
        temperature,
    )
    switches = {"return_entropy": return_entropy, "return_sum_pi_squared": return_sum_pi_squared}
    gpt = unwrap_gpt_model(model)
    # The model's forward runs TP collectives before the head's own verdict: a refusal on one
    # rank reaches the others here, before the model runs.
    _share_refusal(gpt, error, (type(temperature), return_entropy, return_sum_pi_squared))
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
    check_supported_config(gpt.config)
    if supports_output_processor(gpt):
        context = FusedHeadContext(temperature, **switches)
        model_labels = labels
        if getattr(gpt.config, "mtp_num_layers", None):
            model_labels, forward_kwargs["loss_mask"] = _mtp_labels_and_mask(
                gpt, head, labels, forward_kwargs.get("loss_mask")
            )
            context = FusedHeadContext(temperature, labels, **switches)
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
        gpt, head, input_ids, position_ids, attention_mask, labels, temperature, forward_kwargs, switches
    )


def _checked_arguments(
    temperature: object, return_entropy: object, return_sum_pi_squared: object, input_ids: object, position_ids: object
) -> float | torch.Tensor | None:
    """:func:`gpt_log_probs_and_entropy`'s own checks (a tensor temperature is the head's to
    check); the temperature, a number checked. The token and position ids' dtypes are checked
    here (the model's embedding would raise deep inside Megatron); their values are the model's
    (reading them would cost a host sync)."""
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids)):
        if ids is not None:
            check_tensor(name, ids, "index")
    if temperature is not None and not isinstance(temperature, torch.Tensor):
        temperature = check_temperature(temperature)
    for name, value in (("return_entropy", return_entropy), ("return_sum_pi_squared", return_sum_pi_squared)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
    return temperature


def _share_refusal(gpt: torch.nn.Module, error: Exception | None, signature: tuple) -> None:
    """``error`` (this rank's refusal of its arguments, or None) shared over the model's TP group
    as the head's own verdict is (every call over a CPU group, once per signature over an
    accelerator's: no host sync in a steady loop)."""
    head = getattr(gpt, "output_layer", None) if gpt.post_process else None
    signature = ("gpt_log_probs_and_entropy", *signature)
    if isinstance(head, VocabParallelFusedPPOHead):
        rows = head.output_size_per_partition
        share_refusal(head.tp_group, error, validate=head.validate, signature=signature, weight_rows=rows)
    else:
        share_refusal(_model_tp_group(gpt), error, validate=VALIDATE_DEFAULT, signature=signature)


def _model_tp_group(gpt: torch.nn.Module) -> ProcessGroup | None:
    """The TP group the model's layers run over (megatron-core's ``pg_collection``, else its
    ``parallel_state``)."""
    group = getattr(getattr(gpt, "pg_collection", None), "tp", None)
    return group if group is not None else resolve_tp_group(None)


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
    temperature: float | torch.Tensor | None,
    forward_kwargs: dict[str, Any],
    switches: dict[str, bool | None],
) -> tuple[torch.Tensor | None, ...]:
    """megatron-core < 0.18: the model with ``post_process`` cleared, then the head module
    (``switches``: the call's ``return_entropy`` and ``return_sum_pi_squared``, None: the head's)."""
    if getattr(gpt.config, "fine_grained_activation_offloading", False):
        # GPTModel marks the output layer's parameters only while post_process is set.
        _mark_not_offloadable(head)
    hidden_states, output_weight = hidden_states_without_postprocess(
        gpt, input_ids, position_ids, attention_mask, forward_kwargs
    )
    return head(hidden_states, labels, weight=output_weight, temperature=temperature, **switches)


def hidden_states_without_postprocess(
    gpt: torch.nn.Module,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    forward_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the ``output_processor`` hook hands a processor, for models without it: the unwrapped
    ``gpt`` run with ``post_process`` cleared (restored in a ``finally``) gives the decoder's
    final hidden states (normed, still SP-scattered); with them the output weight the hook
    passes (the embedding's for tied models, else None).

    Multi-token prediction raises NotImplementedError: without ``post_process`` the model
    returns the MTP depths' hidden states concatenated to the main ones.
    """
    if getattr(gpt.config, "mtp_num_layers", None):
        raise NotImplementedError(
            "multi-token prediction needs megatron-core >= 0.18 (the output_processor hook) for the fused head"
        )
    output_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    gpt.post_process = False
    try:
        hidden_states = gpt(input_ids, position_ids, attention_mask, **forward_kwargs)
    finally:
        gpt.post_process = True
    return hidden_states, output_weight


def _mark_not_offloadable(module: torch.nn.Module) -> None:
    from megatron.core.models.gpt import gpt_model

    mark: Callable[[torch.Tensor], None] | None = getattr(
        getattr(gpt_model, "off_interface", None), "mark_not_offloadable", None
    )
    if mark is not None:
        for param in module.parameters():
            mark(param)
