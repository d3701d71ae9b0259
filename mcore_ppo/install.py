"""Put the fused head into a Megatron-Core ``GPTModel``: :func:`install_fused_head`.

The head takes the output layer's place and owns the *same* ``weight`` Parameter object
(untied) or none (tied: the embedding's weight is passed at call time, as ``GPTModel`` does),
so state-dict keys, checkpoints, optimizer state and Megatron DDP's parameter hooks are
unchanged. :mod:`mcore_ppo.model` re-exports both public names.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo.backends.base import Backend
from mcore_ppo.head import VocabParallelFusedPPOHead
from mcore_ppo.logs import log_once
from mcore_ppo.options import HeadOptions, call_options
from mcore_ppo.validation import check_temperature

__all__ = ["install_fused_head", "unwrap_gpt_model"]


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


def _replaceable_output_layer(layer: torch.nn.Module) -> bool:
    """Whether the head can take ``layer``'s place: Megatron's ``ColumnParallelLinear`` itself, or
    the dev branch's ``LinearCrossEntropyModule`` (a ``ColumnParallelLinear`` subclass with the same
    constructor and weight, adding only a fused-loss forward that the head also keeps). Any other
    subclass (TransformerEngine's MXFP8 LM head) computes something the head does not."""
    if type(layer) is ColumnParallelLinear:
        return True
    cls = type(layer)
    return (
        cls.__name__ == "LinearCrossEntropyModule"
        and cls.__module__ == "megatron.core.transformer.linear_cross_entropy"
        and isinstance(layer, ColumnParallelLinear)
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
    options: HeadOptions | None = None,
    backend: str | Backend | None = None,
    ignore_index: int | None = None,
    return_entropy: bool | None = None,
    validate: bool | None = None,
    return_sum_pi_squared: bool | None = None,
    precision: str | None = None,
) -> VocabParallelFusedPPOHead | None:
    """Make ``model``'s output layer a :class:`VocabParallelFusedPPOHead` (idempotent).

    Untied: the head registers the *same* ``weight`` Parameter object as the layer it replaces,
    so ``state_dict`` keys, loaded checkpoints, optimizer state, DDP buffers and gradient hooks
    are unchanged. Tied: the head allocates no weight and receives the embedding's at call
    time, exactly as ``GPTModel`` passes it to ``ColumnParallelLinear``. Hooks registered on
    the old layer (Megatron DDP's forward pre-hook) are carried over, so the head may be
    installed before or after wrapping in DDP; before is the usual order.

    ``temperature`` is the head's default temperature; ``options`` (a
    :class:`mcore_ppo.options.HeadOptions`) and ``backend``, ``ignore_index``,
    ``return_entropy``, ``validate``, ``return_sum_pi_squared`` and ``precision`` (given: they
    replace its fields) are the head's options, checked before the model is looked at. With
    ``return_sum_pi_squared=True`` :func:`mcore_ppo.model.gpt_log_probs_and_entropy` returns
    ``(log_probs, entropy, sum_pi_squared)`` unless a call turns it off. Backend settings
    travel with a backend object: ``backend=TritonBackend(TritonConfig(buffer_budget_bytes=...))``.

    Called again on a model that has the head, it replaces the head's options and temperature
    with these and returns the same head.

    Returns:
        The head on the last pipeline stage; None on other stages (they have no output layer).

    Raises:
        TypeError: the model's output layer is neither a ``ColumnParallelLinear`` nor the dev
            branch's ``LinearCrossEntropyModule`` (e.g. a TransformerEngine MXFP8 LM head), or
            it has a bias.
        NotImplementedError: ``config.defer_embedding_wgrad_compute`` is set.
    """
    options = call_options(
        options, ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate,
        return_sum_pi_squared=return_sum_pi_squared, precision=precision,
    )  # fmt: skip
    temperature = check_temperature(temperature)
    gpt = unwrap_gpt_model(model)
    if not gpt.post_process:
        return None
    old = gpt.output_layer
    if isinstance(old, VocabParallelFusedPPOHead):
        old.options = options
        old.temperature = temperature
        return old
    if not _replaceable_output_layer(old):
        raise TypeError(
            "install_fused_head supports Megatron's ColumnParallelLinear output layer (and the dev branch's "
            f"LinearCrossEntropyModule), got {type(old).__name__}; for TransformerEngine's MXFP8 LM head "
            "(TELMHeadColumnParallelLinear) set config.fp8_output_proj=False"
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
        temperature=temperature,
        options=options,
        gather_output=old.gather_output,
        # Never allocate (or initialise, drawing from the RNG) a weight that is replaced below.
        skip_weight_param_allocation=True,
        embedding_activation_buffer=old.embedding_activation_buffer,
        grad_output_buffer=old.grad_output_buffer,
        tp_group=old.tp_group,
        disable_grad_reduce=old.disable_grad_reduce,
        output_dtype=getattr(old, "output_dtype", None),  # megatron-core >= 0.20 (GPTModel's logit_dtype)
    )
    head.skip_bias_add = old.skip_bias_add
    if old.weight is not None:
        head.weight = old.weight  # the same Parameter object: registered under the same key
    head.train(old.training)
    _take_over_hooks(model, old, head)
    gpt.output_layer = head
    log_once(
        logging.INFO,
        ("install", type(old).__name__, old.weight is None),
        "mcore_ppo: fused head installed in place of the %s output layer (%s weight)",
        type(old).__name__,
        "tied, embedding's" if old.weight is None else "same Parameter",
    )
    return head


def _no_init(weight: torch.Tensor) -> None:  # the init_method signature
    """The head never initialises a weight: it shares the replaced layer's (or the embedding's)."""
