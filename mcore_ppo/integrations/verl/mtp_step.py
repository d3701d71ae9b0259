"""The MTP state of one engine forward on verl's fused path (``MCORE_PPO_VERL_MTP=1``).

verl hands the micro-batch's loss mask only to its non-fused path, and its fused forward passes
the model no position ids; the MTP postprocess needs both. The engine wrappers of
:mod:`mcore_ppo.integrations.verl.engine` set them here for the duration of the call: the loss
mask is the batch's (``prepare_model_inputs``), laid out as verl's non-fused MTP path lays it out
(``_build_mtp_loss_mask_nested``, then packed and rolled by ``preprocess_thd_engine``); position
ids likewise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo.integrations.verl.mtp import mtp_config, mtp_enabled

__all__ = ["MtpStep", "current_step", "engine_step", "fused_engine_inputs"]


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


def current_step() -> MtpStep | None:
    """The MTP state of the engine forward in progress, or None."""
    return _STEP.get()


@contextlib.contextmanager
def engine_step(engine: Any, batch: Any) -> Iterator[None]:
    """The MTP state of one ``forward_step`` of ``engine`` on ``batch`` (nothing unless MTP runs fused)."""
    mtp = mtp_config(engine)
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
