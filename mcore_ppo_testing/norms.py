"""A torch LayerNorm / RMSNorm that runs under Megatron's sequence parallelism.

Megatron's local layer spec builds its norms with ``WrappedTorchNorm`` when Apex is absent, and
that wrapper refuses ``config.sequence_parallel``: under SP each TP rank normalises only its
sequence shard, so the norm's weight and bias gradients are *partial* sums that must be
all-reduced over TP, and Megatron finds the parameters to reduce by their
``sequence_parallel`` attribute (set by TransformerEngine's and Apex's norms). A plain torch
norm lacks it, so ``WrappedTorchNorm`` asserts rather than train silently wrong.

:class:`SequenceParallelTorchNorm` is ``WrappedTorchNorm`` with that attribute set, so
Megatron's own gradient reduction (``finalize_model_grads`` → ``_allreduce_non_tensor_model_parallel_grads``
/ ``_allreduce_layernorm_grads``, or the actor's equivalent for a bare model) sums the partials
exactly as it does for TransformerEngine's norms. It is built in ``config.params_dtype`` (the
original uses torch's default dtype), on the current device. Nothing is patched: it is a layer
spec entry (:func:`mcore_ppo_testing.layer_specs.local_gpt_spec`), on CPU and GPU alike.
"""

from __future__ import annotations

import torch


class SequenceParallelTorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature: ``torch.nn.LayerNorm`` or ``RMSNorm`` whose
    parameters carry ``sequence_parallel = config.sequence_parallel``."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or getattr(config, "memory_efficient_layer_norm", False):
            raise NotImplementedError(
                "SequenceParallelTorchNorm: zero-centred gamma and memory-efficient LayerNorm need "
                "TransformerEngine or Apex"
            )
        classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in classes:
            raise ValueError(
                f"SequenceParallelTorchNorm: config.normalization must be one of {sorted(classes)}, "
                f"got {config.normalization!r}"
            )
        norm = classes[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
