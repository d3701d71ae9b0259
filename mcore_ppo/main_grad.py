"""Megatron's convention for a weight gradient accumulated into ``main_grad``.

With gradient-accumulation fusion (``ColumnParallelLinear``'s ``main_grad`` mode) the backward
adds ``d_W`` into ``weight.main_grad`` itself; autograd still expects a gradient for the weight,
so Megatron hands it one dummy tensor reused by every backward and marks the weight so its DDP
hook does not add the gradient twice.
"""

from __future__ import annotations

import torch


def _transformer_engine_dummy_wgrad():
    try:
        from transformer_engine.pytorch.module.base import get_dummy_wgrad
    except ImportError:
        return None
    return get_dummy_wgrad


_TE_DUMMY_WGRAD = _transformer_engine_dummy_wgrad()


def dummy_weight_grad(weight: torch.Tensor) -> torch.Tensor:
    """What autograd gets for the weight when its gradient went into ``main_grad``: Megatron's
    convention (``ColumnParallelLinear`` with gradient-accumulation fusion) sets
    ``grad_added_to_main_grad`` so DDP's hook does not add it twice, and hands autograd one
    dummy tensor reused by every backward: TransformerEngine's where it is installed (shared
    with Megatron's layers), else one kept on the weight; zeroed only for a weight marked
    ``zero_out_wgrad``. Returned detached: autograd takes it as the gradient without a copy."""
    weight.grad_added_to_main_grad = True
    zero = getattr(weight, "zero_out_wgrad", False)
    if weight.is_cuda and _TE_DUMMY_WGRAD is not None:
        return _TE_DUMMY_WGRAD(list(weight.shape), weight.dtype, zero=zero)
    dummy = getattr(weight, "_mcore_ppo_dummy_grad", None)
    if dummy is None or dummy.shape != weight.shape or dummy.dtype != weight.dtype:
        dummy = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        weight._mcore_ppo_dummy_grad = dummy
    if zero:
        dummy.zero_()
    return dummy.detach()


__all__ = ["dummy_weight_grad"]
