"""Each MTP depth's loss on the head, as verl's MTP patch computes it (``MCORE_PPO_VERL_MTP=1``).

Each depth's cross entropy comes from the head (``-log p`` at temperature 1, no logits), with the
labels, loss mask, rolls, scaling and logging of verl's MTP patch: labels rolled once more per
depth and the loss mask with them (Megatron's ``roll_tensor``, packed sequences and CP
respected), ``loss_mask * CE`` scaled by ``mtp_loss_scaling_factor / D`` and divided by the
depth's token count (or, with ``calculate_per_token_loss``, times ``original / depth`` token
counts), attached to the main hidden states with ``MTPLossAutoScaler``, and saved to
``MTPLossLoggingHelper``'s tracker (which verl's ``get_megatron_mtp_loss`` reads).

verl's two branches are followed: without megatron-core's ``process_mtp_loss`` the output
layer's weight is detached for the MTP loss (it does not update the LM head); with it, the weight
gets the MTP loss's gradient. Where the tracker's API takes acceptance counts they come from the
top-1 id of :func:`mcore_ppo.fused_topk` (again no logits).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from mcore_ppo.integrations.verl.mtp_step import MtpStep
from mcore_ppo.logs import log_once

__all__ = ["attach_mtp_losses"]


def attach_mtp_losses(
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
    from mcore_ppo.integrations.verl import ENV_BACKEND

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
    backend = backend_from_environment(ENV_BACKEND)
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
