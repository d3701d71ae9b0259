"""verl's fused path with multi-token prediction (MTP): opt-in, ``MCORE_PPO_VERL_MTP=1``.

verl 0.9.1 turns its fused path off whenever ``actor_rollout_ref.model.mtp.enable`` is set
(``MegatronEngine._maybe_enable_fused_kernels``): its MTP patch of ``GPTModel._postprocess``
(``verl.models.mcore.mtp_patch._megatron_gptmodel_postprocess``) takes ``output_processor`` but
never calls it, so the fused forward would get logits back. With MTP the non-fused path computes
the main head's ``[s, b, V/tp]`` logits, and with ``mtp.enable_train`` one more such tensor per
MTP depth for the MTP loss.

With the plugin on and ``MCORE_PPO_VERL_MTP=1`` (read at each engine set-up and forward; off by
default) the plugin:

- lifts only the MTP condition of ``_maybe_enable_fused_kernels`` (remove-padding and value
  models still turn the fused path off) and logs a WARNING saying so;
- wraps verl's MTP ``_postprocess`` so that, given an ``output_processor``, it does what
  Megatron-Core >= 0.18's contract says: the MTP block and MTP loss first, then the processor
  (verl's ``fused_output_processor``, i.e. the head) instead of the output layer's logits;
- on megatron-core < 0.18 (no hook), routes verl's patched ``GPTModel.forward`` through
  Megatron's own ``forward`` and that postprocess, with verl's processor handed over by a
  context variable, when MTP is trained; otherwise verl's fused forward runs as it is;
- computes each MTP depth's cross entropy with the head (``-log p`` at temperature 1, no
  logits), with the labels, loss mask, rolls, scaling and logging of verl's MTP patch: labels
  rolled once more per depth and the loss mask with them (Megatron's ``roll_tensor``, packed
  sequences and CP respected), ``loss_mask * CE`` scaled by ``mtp_loss_scaling_factor / D``
  and divided by the depth's token count (or, with ``calculate_per_token_loss``, times
  ``original / depth`` token counts), attached to the main hidden states with
  ``MTPLossAutoScaler``, and saved to ``MTPLossLoggingHelper``'s tracker (which verl's
  ``get_megatron_mtp_loss`` reads). verl's two branches are followed: without megatron-core's
  ``process_mtp_loss`` the output layer's weight is detached for the MTP loss (it does not
  update the LM head); with it, the weight gets the MTP loss's gradient. Where the tracker's API
  takes acceptance counts they come from the top-1 id of :func:`mcore_ppo.fused_topk` (again
  no logits).

The loss mask is the batch's (``prepare_model_inputs``), laid out as verl's non-fused MTP path
lays it out (``_build_mtp_loss_mask_nested``, then packed and rolled by
``preprocess_thd_engine``); position ids likewise. Without ``mtp.enable_train`` no MTP layer
runs, as in verl's non-fused path (it passes no labels then).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo.logs import log_once

__all__ = ["ENV_MTP", "mtp_enabled"]

ENV_MTP = "MCORE_PPO_VERL_MTP"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")
# Set on the plugin's replacement of verl's MTP postprocess (models bound to it are checked by it).
_POSTPROCESS_MARK = "__mcore_ppo_mtp_postprocess__"


def mtp_enabled() -> bool:
    """Whether ``MCORE_PPO_VERL_MTP`` asks for verl's fused path with MTP (unset: no).

    Raises:
        ValueError: the value is not one of ``1/true/on/yes`` or ``0/false/off/no`` (the message
            names the variable).
    """
    value = os.environ.get(ENV_MTP, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{ENV_MTP} must be one of {', '.join(_ON + _OFF[1:])}, got {value!r}")
    return value in _ON


@dataclasses.dataclass(frozen=True)
class MtpStep:
    """One engine forward with MTP on the fused path (set by the ``forward_step`` wrapper).

    Attributes:
        train: verl's ``mtp.enable_train``: the MTP layers run and their loss is attached.
        loss_mask: the micro-batch's loss mask (nested ``[b, j]``, bool), as verl's engine reads it.
        normalization_factor: verl's ``mtp_loss_normalization_factor`` (``calculate_per_token_loss``
            with routed-token counts), or None.
        loss_mask_thd, position_ids_thd: the loss mask and position ids packed (and the mask
            rolled) as verl's non-fused MTP path packs them; set by the fused engine's wrapper.
    """

    train: bool
    loss_mask: torch.Tensor | None = None
    normalization_factor: float | None = None
    loss_mask_thd: torch.Tensor | None = None
    position_ids_thd: torch.Tensor | None = None


_STEP: ContextVar[MtpStep | None] = ContextVar("mcore_ppo_verl_mtp_step", default=None)
# megatron-core < 0.18: the processor and its context verl's fused forward would have given the
# hook, for the postprocess below (Megatron's forward there does not pass one).
_LEGACY_PROCESSOR: ContextVar[tuple[Callable[..., Any], Any] | None] = ContextVar(
    "mcore_ppo_verl_mtp_processor", default=None
)


def current_step() -> MtpStep | None:
    """The MTP state of the engine forward in progress, or None."""
    return _STEP.get()


def _mtp_config(engine: Any) -> Any:
    return getattr(getattr(engine, "model_config", None), "mtp", None)


def lift_applies(engine: Any) -> bool:
    """verl would turn the fused path off for ``engine`` because of MTP alone, and the plugin lifts that."""
    config = engine.engine_config
    return (
        bool(config.use_fused_kernels)
        and bool(getattr(config, "use_remove_padding", True))
        and not getattr(engine, "is_value_model", False)
        and bool(getattr(_mtp_config(engine), "enable", False))
        and mtp_enabled()
    )


def enable_fused_with_mtp(engine: Any) -> None:
    """What verl's ``_maybe_enable_fused_kernels`` does when it keeps the fused path on."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    mtp = _mtp_config(engine)
    log_once(
        logging.WARNING,
        ("verl-mtp-lift", bool(getattr(mtp, "enable_train", False))),
        "mcore_ppo verl plugin: %s=1: verl's fused path stays on with MTP (verl turns it off for MTP); the main "
        "head's log-probs/entropy%s run on the fused head, no logits",
        ENV_MTP,
        " and each MTP depth's loss (mtp.enable_train)" if getattr(mtp, "enable_train", False) else "",
    )
    for model in engine.module:
        patch_fused_forward(model)


@contextlib.contextmanager
def engine_step(engine: Any, batch: Any) -> Iterator[None]:
    """The MTP state of one ``forward_step`` of ``engine`` on ``batch`` (nothing unless MTP runs fused)."""
    mtp = _mtp_config(engine)
    if not (bool(engine.engine_config.use_fused_kernels) and getattr(mtp, "enable", False) and mtp_enabled()):
        yield
        return
    train = bool(getattr(mtp, "enable_train", False))
    loss_mask = factor = None
    if train:
        loss_mask = engine.prepare_model_inputs(batch)["loss_mask"]
        if getattr(engine.tf_config, "calculate_per_token_loss", False):
            from verl.utils import tensordict_utils as tu

            batch_tokens = tu.get_non_tensor_data(batch, key="batch_num_tokens", default=0)
            routed_tokens = tu.get_non_tensor_data(batch, key="routed_num_tokens", default=0)
            if batch_tokens > 0:  # verl's forward_step, non-fused branch
                factor = routed_tokens / batch_tokens
    token = _STEP.set(MtpStep(train, loss_mask, factor))
    try:
        yield
    finally:
        _STEP.reset(token)


@contextlib.contextmanager
def fused_engine_inputs(arguments: dict[str, Any]) -> Iterator[None]:
    """Inside verl's ``fused_forward_model_engine``: the MTP loss mask and position ids packed as
    verl's non-fused path packs them for the model (``gptmodel_forward_model_engine``)."""
    step = _STEP.get()
    if step is None or not step.train or step.loss_mask is None:
        yield
        return
    from verl.models.mcore import model_forward
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron_utils import unwrap_model

    input_ids = arguments["input_ids"]
    config = unwrap_model(arguments["model"]).config
    packing = dict(
        use_fp8_padding=getattr(config, "fp8", None) in ("e4m3", "hybrid"),
        min_local_rows=config.csa_window_size
        if getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid"
        else None,
        pad_to_length_bucket=arguments.get("pad_to_length_bucket"),
        cp_layout=arguments.get("cp_layout", "zigzag"),
        local_cp_size=arguments.get("local_cp_size"),
    )
    lengths = input_ids.offsets().diff().tolist()
    mask = model_forward._build_mtp_loss_mask_nested(step.loss_mask.to(input_ids.device), lengths, None)
    mask_thd = preprocess_thd_engine(mask, pre_process=True, need_roll=True, **packing)[0]
    _, _, position_ids = preprocess_thd_engine(input_ids, pre_process=True, **packing)
    token = _STEP.set(dataclasses.replace(step, loss_mask_thd=mask_thd.contiguous(), position_ids_thd=position_ids))
    try:
        yield
    finally:
        _STEP.reset(token)


# ---------------------------------------------------------------------------------------------
# megatron-core < 0.18: verl's patched GPTModel.forward
# ---------------------------------------------------------------------------------------------


def reroutes_legacy_forward(model: Any) -> bool:
    """verl's fused ``GPTModel.forward`` (no hook) must go through the MTP postprocess: MTP trains."""
    step = _STEP.get()
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
    step = _STEP.get()
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
        hidden_states = _attach_mtp_losses(model, hidden_states, labels, loss_mask, output_weight, a, step)
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


def _attach_mtp_losses(
    model: Any,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    output_weight: torch.Tensor | None,
    a: dict[str, Any],
    step: MtpStep,
) -> torch.Tensor:
    """verl's MTP loss (both of its branches, see the module doc) with each depth's CE from the head."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor
    from verl.models.mcore import mtp_patch

    from mcore_ppo.api import fused_log_probs_and_entropy
    from mcore_ppo.integrations.import_hook import backend_from_environment

    packed_seq_params = a.get("packed_seq_params")
    with_process_mtp_loss = bool(getattr(mtp_patch, "_HAS_PROCESS_MTP_LOSS", False))
    if with_process_mtp_loss:
        if step.normalization_factor is not None and packed_seq_params is not None:
            # verl's non-fused path hangs the factor on the packed-sequence params for this helper.
            setattr(packed_seq_params, mtp_patch._MTP_LOSS_NORMALIZATION_FACTOR_ATTR, step.normalization_factor)
        config = mtp_patch._get_mtp_loss_config(model.config, packed_seq_params)
        cp_group = mtp_patch._resolve_cp_group(model, packed_seq_params)
        if getattr(config, "use_mup", False):
            raise NotImplementedError("mcore_ppo verl plugin: MTP with MuP logit scaling (config.use_mup)")
    else:
        config = model.config
        cp_group = getattr(model, "cp_group", None)
    depths = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = chunks[0]
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    original_num_tokens = loss_mask.sum()
    weight = output_weight if output_weight is not None else model.output_layer.weight
    if not with_process_mtp_loss:
        weight = weight.detach()  # verl: "Detach output-layer params so MTP loss does not update lm_head."
    tp_group = parallel_state.get_tensor_model_parallel_group()
    backend = backend_from_environment("MCORE_PPO_VERL_BACKEND")
    roll = dict(shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    for depth in range(depths):
        mtp_labels, _ = roll_tensor(mtp_labels, **roll)
        loss_mask, num_tokens = roll_tensor(loss_mask, **roll)
        log_probs, _ = fused_log_probs_and_entropy(
            chunks[depth + 1],
            weight,
            mtp_labels,
            temperature=1.0,
            tp_group=tp_group,
            sequence_parallel=bool(config.sequence_parallel),
            backend=backend,
            return_entropy=False,
        )
        mtp_loss = loss_mask * -log_probs.reshape(mtp_labels.shape)
        if model.training:
            _save_to_tracker(
                mtp_loss.sum(), num_tokens, chunks[depth + 1], weight, mtp_labels, loss_mask, depth, depths, config
            )
        scale = config.mtp_loss_scaling_factor / depths
        safe_num_tokens = num_tokens.clamp(min=1)
        if config.calculate_per_token_loss:
            scaled = scale * mtp_loss * (original_num_tokens / safe_num_tokens)
        else:
            scaled = scale * mtp_loss / safe_num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scaled)
    return hidden_states


def _save_to_tracker(
    loss_sum: torch.Tensor,
    num_tokens: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    depths: int,
    config: Any,
) -> None:
    """The depth's loss into Megatron's MTP tracker (what verl's ``get_megatron_mtp_loss`` reads),
    by whichever of its APIs this megatron-core has, as its MTP loss calls it:

    - ``save_loss_to_tracker(loss_sum, num_tokens, layer_number, num_layers, correct, total, ...,
      calculate_per_token_loss)`` (raw sums; newest);
    - ``save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, ...)``;
    - ``save_loss_to_tracker(loss, layer_number, num_layers, ...)`` (0.16).

    ``correct`` / ``total`` are Megatron's acceptance counts: the top-1 id
    (:func:`mcore_ppo.fused_topk`, no logits) against the label where the mask counts.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    mean = loss_sum / num_tokens.clamp(min=1)

    def acceptance() -> tuple[torch.Tensor, torch.Tensor]:
        from mcore_ppo import fused_topk

        top = fused_topk(
            hidden.detach(),
            weight.detach(),
            1,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            sequence_parallel=bool(config.sequence_parallel),
        )
        valid = loss_mask.bool()
        correct = ((top.ids[..., 0].reshape(labels.shape) == labels) & valid).sum().float()
        return correct, valid.sum().float()

    def parameters(name: str) -> list[str]:
        function = getattr(MTPLossLoggingHelper, name, None)
        return [] if function is None else list(inspect.signature(function).parameters)

    save_loss, save_metrics = parameters("save_loss_to_tracker"), parameters("save_metrics_to_tracker")
    if save_loss[:2] == ["loss_sum", "num_tokens"]:
        extra: dict[str, Any] = {"avg_group": avg_group}
        if "correct" in save_loss and "total" in save_loss:
            extra["correct"], extra["total"] = acceptance()
        if "calculate_per_token_loss" in save_loss:
            extra["calculate_per_token_loss"] = bool(config.calculate_per_token_loss)
        MTPLossLoggingHelper.save_loss_to_tracker(loss_sum, num_tokens, depth, depths, **extra)
    elif save_metrics[:3] == ["loss", "correct", "total"]:
        correct, total = acceptance()
        MTPLossLoggingHelper.save_metrics_to_tracker(mean, correct, total, depth, depths, avg_group=avg_group)
    elif save_loss[:1] == ["loss"]:
        MTPLossLoggingHelper.save_loss_to_tracker(mean, depth, depths, avg_group=avg_group)
    else:
        log_once(
            logging.WARNING,
            ("verl-mtp-tracker",),
            "mcore_ppo verl plugin: this megatron-core's MTPLossLoggingHelper has none of the tracker APIs the "
            "plugin knows (save_loss_to_tracker, save_metrics_to_tracker); the MTP losses are trained, not logged",
        )
