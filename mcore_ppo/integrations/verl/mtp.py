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
  models still turn the fused path off) and logs a WARNING saying so (this module);
- records each engine forward's MTP state, the loss mask and position ids laid out as verl's
  non-fused MTP path lays them out (:mod:`mcore_ppo.integrations.verl.mtp_step`);
- wraps verl's MTP ``_postprocess`` so that, given an ``output_processor``, it does what
  Megatron-Core >= 0.18's contract says, and on older megatron-core routes verl's patched
  ``GPTModel.forward`` through it (:mod:`mcore_ppo.integrations.verl.mtp_postprocess`);
- computes each MTP depth's loss with the head, no logits, as verl's MTP patch computes, scales,
  attaches and logs it (:mod:`mcore_ppo.integrations.verl.mtp_loss`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mcore_ppo.logs import log_once

__all__ = ["ENV_MTP", "enable_fused_with_mtp", "lift_applies", "mtp_config", "mtp_enabled"]

ENV_MTP = "MCORE_PPO_VERL_MTP"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


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


def mtp_config(engine: Any) -> Any:
    """verl's ``actor_rollout_ref.model.mtp`` settings of ``engine``, or None."""
    return getattr(getattr(engine, "model_config", None), "mtp", None)


def lift_applies(engine: Any) -> bool:
    """verl would turn the fused path off for ``engine`` because of MTP alone, and the plugin lifts that."""
    config = engine.engine_config
    return (
        bool(config.use_fused_kernels)
        and bool(getattr(config, "use_remove_padding", True))
        and not getattr(engine, "is_value_model", False)
        and bool(getattr(mtp_config(engine), "enable", False))
        and mtp_enabled()
    )


def enable_fused_with_mtp(engine: Any) -> None:
    """What verl's ``_maybe_enable_fused_kernels`` does when it keeps the fused path on."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    mtp = mtp_config(engine)
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
