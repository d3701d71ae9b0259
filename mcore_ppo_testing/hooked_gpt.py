"""A ``GPTModel`` with megatron-core >= 0.18's ``output_processor`` hook, for tests on older versions.

On megatron-core < 0.18 the fused forward takes the fallback path; this subclass exposes the
hook with the signature and call of megatron-core's ``GPTModel.forward``/``_postprocess`` (the
processor runs after the decoder on the last stage, with the still SP-scattered hidden states,
the output layer and, for tied models, the embedding weight), so the hook path of
:func:`mcore_ppo.gpt_log_probs_and_entropy` is exercised on every installed version. On
megatron-core >= 0.18 the real ``GPTModel`` is used instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel


class HookedGPTModel(GPTModel):
    """``GPTModel`` whose ``forward`` takes ``output_processor`` / ``output_processor_context``."""

    hook_calls = 0

    def forward(  # type: ignore[override]
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        labels=None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs=None,
        runtime_gather_output=None,
        *,
        inference_params=None,
        loss_mask=None,
        padding_mask=None,
        output_processor=None,
        output_processor_context=None,
    ) -> Any:
        kwargs = dict(
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs,
            runtime_gather_output=runtime_gather_output,
            inference_params=inference_params,
            loss_mask=loss_mask,
            padding_mask=padding_mask,
        )
        if output_processor is None or not self.post_process:
            return super().forward(input_ids, position_ids, attention_mask, **kwargs)
        preproc = self._preprocess(
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = preproc[:6]
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=preproc[6] if len(preproc) == 7 else None,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
            **(extra_block_kwargs or {}),
        )
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self.mtp_process:  # the MTP block, as GPTModel._postprocess calls it
            hidden_states = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                inference_params=None,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=self.embedding,
                **(extra_block_kwargs or {}),
            )
        if self.config.mtp_num_layers:  # megatron-core >= 0.18 runs the MTP loss before the processor
            hidden_states = process_mtp_loss(self, hidden_states, labels, loss_mask, output_weight, packed_seq_params)
        type(self).hook_calls += 1
        # The keywords megatron-core >= 0.18 passes (GPTModel._postprocess).
        return output_processor(
            hidden_states=hidden_states,
            output_layer=self.output_layer,
            output_weight=output_weight,
            labels=labels,
            loss_mask=loss_mask,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            runtime_gather_output=runtime_gather_output,
            context=output_processor_context,
            compute_language_model_loss=self.compute_language_model_loss,
            scale_logits=lambda logits: logits,
            config=self.config,
        )


def process_mtp_loss(
    model: GPTModel,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    output_weight: torch.Tensor | None,
    packed_seq_params: Any,
) -> torch.Tensor:
    """megatron-core >= 0.18's ``process_mtp_loss`` (``multi_token_prediction.py``, main at
    d98e8a64 and dev at d48bd6be), for labels given: split off each depth's hidden states, roll
    the labels and the loss mask once per depth, take that depth's cross entropy — from the
    output layer's logits and ``compute_language_model_loss`` (main), or from the output layer's
    fused loss (``output_layer(..., output_cross_entropy_loss=True, labels=...)``, dev with
    ``cross_entropy_fusion_impl="linear"``, emulated by ``model.fuse_linear_cross_entropy``) —
    mask it, and attach it to the main hidden states with ``MTPLossAutoScaler``. Left out: the
    loss tracker and acceptance counts (logging only), ``calculate_per_token_loss``, MuP.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    depths = model.config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = chunks[0]
    if labels is None:
        return hidden_states
    mtp_labels = labels.clone()
    loss_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    fused = getattr(model, "fuse_linear_cross_entropy", False)
    for depth in range(depths):
        roll = dict(shifts=-1, dims=-1, cp_group=model.cp_group, packed_seq_params=packed_seq_params)
        mtp_labels, _ = roll_tensor(mtp_labels, **roll)
        loss_mask, num_tokens = roll_tensor(loss_mask, **roll)
        if fused:
            mtp_loss = model.output_layer(
                chunks[depth + 1], weight=output_weight, output_cross_entropy_loss=True, labels=mtp_labels
            )
        else:
            logits, _ = model.output_layer(chunks[depth + 1], weight=output_weight)
            mtp_loss = model.compute_language_model_loss(mtp_labels, logits)
        scale = model.config.mtp_loss_scaling_factor / depths
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * loss_mask * mtp_loss / num_tokens.clamp(min=1))
    return hidden_states


def as_hooked(model: GPTModel) -> GPTModel:
    """Give ``model`` (an unwrapped ``GPTModel``) the hooked ``forward`` by switching its class.

    Parameters, buffers and state are untouched, so the same weights can be compared through
    the hook path and the fallback path.
    """
    if not isinstance(model, GPTModel):
        raise TypeError(f"as_hooked expects a GPTModel, got {type(model).__name__}")
    if type(model) is GPTModel:
        model.__class__ = HookedGPTModel
    return model


@contextlib.contextmanager
def forward_path(model: torch.nn.Module, path: str) -> Iterator[None]:
    """Make :func:`mcore_ppo.gpt_log_probs_and_entropy` take ``path`` for ``model`` inside the block.

    ``"hook"``: the ``output_processor`` hook — the model's own on megatron-core >= 0.18, else
    the class is switched to :class:`HookedGPTModel` (and back on exit). ``"fallback"``: the
    ``post_process`` path, even where the installed ``GPTModel`` has the hook. ``"auto"``: what
    the installed version takes.
    """
    from mcore_ppo import model as model_module

    gpt = model_module.unwrap_gpt_model(model)
    if path == "auto":
        yield
        return
    if path == "hook":
        switched = not model_module.supports_output_processor(gpt)
        if switched:
            as_hooked(gpt)
        try:
            yield
        finally:
            if switched:
                gpt.__class__ = GPTModel
        return
    if path == "fallback":
        cls = type(gpt)
        model_module.supports_output_processor(gpt)  # fill the cache entry replaced below
        saved = model_module._HOOK_SUPPORT[cls]
        model_module._HOOK_SUPPORT[cls] = False
        try:
            yield
        finally:
            model_module._HOOK_SUPPORT[cls] = saved
        return
    raise ValueError(f"path must be 'hook', 'fallback' or 'auto', got {path!r}")


@contextlib.contextmanager
def post_process_frozen(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, setting ``post_process`` on ``model`` (an unwrapped ``GPTModel``) raises
    AssertionError: a forward that must not clear it fails instead of passing unseen.

    The class is switched to a subclass whose ``post_process`` is a property (reads unchanged)
    and back on exit.
    """
    cls = type(model)

    def refuse(self: torch.nn.Module, value: object) -> None:
        raise AssertionError(f"post_process set to {value!r} on {cls.__name__} inside post_process_frozen")

    frozen = property(lambda self: self.__dict__["post_process"], refuse)
    model.__class__ = type(cls.__name__, (cls,), {"post_process": frozen})
    try:
        yield
    finally:
        model.__class__ = cls
