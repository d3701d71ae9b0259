"""verl's MTP postprocess with the head as its output processor (``MCORE_PPO_VERL_MTP=1``).

verl's MTP patch of ``GPTModel._postprocess``
(``verl.models.mcore.mtp_patch._megatron_gptmodel_postprocess``) takes ``output_processor`` but
never calls it. The plugin wraps it so that, given an ``output_processor``, it does what
Megatron-Core >= 0.18's contract says: the MTP block and MTP loss first, then the processor
(verl's ``fused_output_processor``, i.e. the head) instead of the output layer's logits.

On megatron-core < 0.18 (no hook) verl's patched ``GPTModel.forward`` is routed through
Megatron's own ``forward`` and that postprocess, with verl's processor handed over by a context
variable, when MTP is trained; otherwise verl's fused forward runs as it is. Without
``mtp.enable_train`` no MTP layer runs, as in verl's non-fused path (it passes no labels then).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo.integrations.verl.mtp import mtp_enabled
from mcore_ppo.integrations.verl.mtp_loss import attach_mtp_losses
from mcore_ppo.integrations.verl.mtp_step import MtpStep, current_step
from mcore_ppo.logs import log_once

__all__ = ["legacy_forward_through_postprocess", "reroutes_legacy_forward", "wrap_mtp_postprocess"]

# Set on the plugin's replacement of verl's MTP postprocess (models bound to it are checked by it).
_POSTPROCESS_MARK = "__mcore_ppo_mtp_postprocess__"
# megatron-core < 0.18: the processor and its context verl's fused forward would have given the
# hook, for the postprocess below (Megatron's forward there does not pass one).
_LEGACY_PROCESSOR: ContextVar[tuple[Callable[..., Any], Any] | None] = ContextVar(
    "mcore_ppo_verl_mtp_processor", default=None
)


# ---------------------------------------------------------------------------------------------
# megatron-core < 0.18: verl's patched GPTModel.forward
# ---------------------------------------------------------------------------------------------


def reroutes_legacy_forward(model: Any) -> bool:
    """verl's fused ``GPTModel.forward`` (no hook) must go through the MTP postprocess: MTP trains."""
    step = current_step()
    if step is None or not step.train or not getattr(model.config, "mtp_num_layers", None):
        return False
    if not getattr(getattr(model._postprocess, "__func__", None), _POSTPROCESS_MARK, False):
        raise RuntimeError(
            "mcore_ppo verl plugin: MTP training on verl's fused path needs verl's MTP patch of "
            "GPTModel._postprocess (verl's engine applies it with actor_rollout_ref.model.mtp.enable) installed "
            "after the plugin; this model's _postprocess is another one"
        )
    return True


def legacy_forward_through_postprocess(model: Any, fused_forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """verl's ``_fused_GPTModel_forward(model, ...)`` as Megatron's ``forward`` plus the MTP postprocess:
    the processor verl's fused forward stands for is handed to the postprocess."""
    import verl.models.mcore.model_forward_fused as fused

    bound = inspect.signature(fused_forward).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("model", None)
    extra = arguments.pop("kwargs", {}) or {}
    if extra:
        raise TypeError(f"mcore_ppo verl plugin: verl's fused forward got keywords Megatron's forward lacks: {extra}")
    temperature = arguments.pop("temperature", 1.0)
    forward = getattr(model, "forward_backup", None) or functools.partial(type(model).forward, model)
    accepted = inspect.signature(forward).parameters
    if arguments.get("padding_mask") is None and "padding_mask" not in accepted:
        arguments.pop("padding_mask", None)
    context = fused.FusedOutputProcessorContext(temperature=temperature)
    token = _LEGACY_PROCESSOR.set((fused.fused_output_processor, context))
    try:
        return forward(**arguments)
    finally:
        _LEGACY_PROCESSOR.reset(token)


# ---------------------------------------------------------------------------------------------
# verl.models.mcore.mtp_patch._megatron_gptmodel_postprocess
# ---------------------------------------------------------------------------------------------


def wrap_mtp_postprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's MTP postprocess, honouring ``output_processor`` when ``MCORE_PPO_VERL_MTP`` is on."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _megatron_gptmodel_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = kwargs.get("output_processor")
        context = kwargs.get("output_processor_context")
        if processor is None and _LEGACY_PROCESSOR.get() is not None:
            processor, context = _LEGACY_PROCESSOR.get()
        if processor is None or not mtp_enabled():
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return _postprocess_with_processor(self, dict(bound.arguments), processor, context)

    setattr(_megatron_gptmodel_postprocess, _POSTPROCESS_MARK, True)
    return _megatron_gptmodel_postprocess


def _postprocess_with_processor(model: Any, a: dict[str, Any], processor: Callable[..., Any], context: Any) -> Any:
    """verl's MTP postprocess with the processor in place of the output layer's logits."""
    hidden_states = a["hidden_states"]
    labels = a["labels"]
    step = current_step()
    if step is None:
        log_once(
            logging.WARNING,
            ("verl-mtp-no-step",),
            "mcore_ppo verl plugin: verl's MTP postprocess ran with an output processor outside verl's engine "
            "forward_step; whether MTP trains is unknown there, so the MTP layers do not run",
        )
    train = step is not None and step.train
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if a.get("mtp_in_postprocess") and labels is not None and train:
        hidden_states = _run_mtp_block(model, a, hidden_states, step)
    if not model.post_process:
        return hidden_states
    if model.config.mtp_num_layers and labels is not None and train:
        loss_mask = a.get("loss_mask")
        if loss_mask is None:
            loss_mask = step.loss_mask_thd
        hidden_states = attach_mtp_losses(model, hidden_states, labels, loss_mask, output_weight, a, step)
    log_once(
        logging.INFO,
        ("verl-mtp-on", train, model.config.mtp_num_layers),
        "mcore_ppo verl plugin: verl's MTP postprocess called the output processor (fused head): %s",
        f"{model.config.mtp_num_layers} MTP depth(s), each depth's loss on the head"
        if train
        else "MTP not trained (mtp.enable_train off), the MTP layers do not run",
    )
    # The keywords megatron-core >= 0.18's GPTModel._postprocess passes its processor.
    return processor(
        hidden_states=hidden_states,
        output_layer=model.output_layer,
        output_weight=output_weight,
        labels=labels,
        loss_mask=a.get("loss_mask"),
        input_ids=a.get("input_ids"),
        position_ids=a.get("position_ids"),
        attention_mask=a.get("attention_mask"),
        decoder_input=a.get("decoder_input"),
        inference_context=a.get("inference_context"),
        packed_seq_params=a.get("packed_seq_params"),
        runtime_gather_output=a.get("runtime_gather_output"),
        context=context,
        compute_language_model_loss=model.compute_language_model_loss,
        config=model.config,
    )


def _run_mtp_block(model: Any, a: dict[str, Any], hidden_states: torch.Tensor, step: MtpStep) -> torch.Tensor:
    """The MTP block, called as verl's MTP postprocess calls it."""
    position_ids = a.get("position_ids")
    if position_ids is None:  # verl's fused forward passes none; its non-fused MTP path passes these
        position_ids = step.position_ids_thd
    if position_ids is None:
        raise RuntimeError(
            "mcore_ppo verl plugin: the MTP layers need position ids and verl's fused forward passed none "
            "(the plugin computes them inside verl's fused_forward_model_engine)"
        )
    mtp_kwargs = dict(a.get("extra_block_kwargs") or {})
    if "padding_mask" in inspect.signature(model.mtp.forward).parameters:
        mtp_kwargs["padding_mask"] = a.get("padding_mask")
    if a.get("mhc_multistream") is not None:
        mtp_kwargs["mhc_multistream"] = a["mhc_multistream"]
    return model.mtp(
        input_ids=a.get("input_ids"),
        position_ids=position_ids,
        hidden_states=hidden_states,
        attention_mask=a.get("attention_mask"),
        inference_params=a.get("inference_params"),
        rotary_pos_emb=a.get("rotary_pos_emb"),
        rotary_pos_cos=a.get("rotary_pos_cos"),
        rotary_pos_sin=a.get("rotary_pos_sin"),
        packed_seq_params=a.get("packed_seq_params"),
        sequence_len_offset=a.get("sequence_len_offset"),
        embedding=model.embedding,
        **mtp_kwargs,
    )
