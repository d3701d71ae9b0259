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
