"""Host side of the triton backend's ``k`` ids per token (:mod:`mcore_ppo.kernels.gather`).

Forward: the logits at the ids (:func:`gather_logits`). Backward: the slots' one-hot gradients
merged once per token (:func:`merged_onehot`, a duplicate id's slots summed, times ``1/T`` as
``dz_kernel`` scales its label term) and added to each ``dz`` buffer or vocab chunk after the
kernel that writes it and before the GEMMs that read it (:func:`add_onehot`). Each function that
launches takes the call's bound launcher (``launch``,
:class:`~mcore_ppo.backends.triton_launch.BoundLauncher`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_ppo.backends.base import SparseGradient
from mcore_ppo.backends.triton_config import TritonConfig
from mcore_ppo.numerics import cdiv, inverse_temperature, next_power_of_two, rowmajor


def gather_logits(
    config: TritonConfig,
    launch: Callable,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_ids: torch.Tensor,
    temperature: float | torch.Tensor,
) -> torch.Tensor:
    """fp32 ``[n, k]``: ``hidden[t] · weight[local_ids[t, j]] / T_t``, 0 where the id is -1
    (``gather_dot_kernel``: a slot outside the shard costs no work)."""
    from mcore_ppo.kernels.gather import gather_dot_kernel

    n, h = hidden.shape
    k = local_ids.shape[1]
    out = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    if n == 0 or k == 0:
        return out
    hidden, weight = rowmajor(hidden), rowmajor(weight)
    block_j, block_h, warps = config.gather_rows
    block_k, stride_x, stride_w = _scan_block(config, k), hidden.stride(0), weight.stride(0)
    # What Triton specialises on (the ids' and the output's alignment and n, k, h it does not),
    # and the block sizes: the launch's site.
    site = (
        "gather_dot", hidden.dtype, local_ids.dtype, hidden.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0,
        stride_x, stride_w, block_j, block_h, block_k, warps,
    )  # fmt: skip
    launch(
        gather_dot_kernel,
        (n,),
        (hidden, weight, local_ids.contiguous(), out, n, k, h, stride_x, stride_w),
        {"BLOCK_J": block_j, "BLOCK_H": block_h, "BLOCK_K": block_k, "num_warps": warps},
        site,
    )
    scale = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
    return torch.where(local_ids >= 0, out / scale, 0.0)


def _scan_block(config: TritonConfig, k: int) -> int:
    return min(config.gather_scan_slots, max(16, next_power_of_two(k)))


def merged_onehot(
    config: TritonConfig,
    launch: Callable,
    sparse: SparseGradient | None,
    perm: torch.Tensor,
    count: torch.Tensor,
    temperature: float | torch.Tensor,
    placeholder: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids, g)`` ``[n, k]`` of a sparse gradient in the backward's compacted row order, each
    id once per row (-1 elsewhere), ``g`` summed over a duplicate's slots and times ``1/T``;
    None without one."""
    if sparse is None:
        return None
    from mcore_ppo.kernels.gather import onehot_merge_kernel

    ids, g = sparse.ids, sparse.g
    n, k = ids.shape
    if ids.dtype != torch.int64 or g.dtype != torch.float32 or g.shape != ids.shape or n != perm.shape[0]:
        raise ValueError(
            f"request.sparse must be int64 ids and fp32 g of one shape [n={perm.shape[0]}, k], got ids "
            f"{ids.dtype} {tuple(ids.shape)} and g {g.dtype} {tuple(g.shape)}"
        )
    inv_temp, inv_temp_rows, row_temp = inverse_temperature(temperature, placeholder)
    ids_out = torch.empty(n, k, dtype=torch.int64, device=ids.device)
    g_out = torch.empty(n, k, dtype=torch.float32, device=ids.device)
    block_k = _onehot_block(config, k)
    if n and k:
        launch(
            onehot_merge_kernel,
            (n,),
            (ids.contiguous(), g.contiguous(), perm, count, ids_out, g_out, n, k, inv_temp, inv_temp_rows),
            {"BLOCK_K": block_k, "ROW_TEMP": row_temp, "num_warps": 4},
            # The dtypes are checked above; the kernel specialises on the row order's alignment.
            ("onehot_merge", block_k, row_temp, perm.data_ptr() % 16 == 0, count.data_ptr() % 16 == 0),
        )
    return ids_out, g_out


def add_onehot(
    config: TritonConfig,
    launch: Callable,
    dz: torch.Tensor,
    onehot: tuple[torch.Tensor, torch.Tensor],
    v0: int,
    vc: int,
) -> None:
    """``dz[r, id - v0] += g`` for the merged ids of :func:`merged_onehot` in ``[v0, v0 + vc)``."""
    from mcore_ppo.kernels.gather import onehot_add_kernel

    ids, g = onehot
    n, k = ids.shape
    if not (n and k):
        return
    block_k = _onehot_block(config, k)
    block_r = max(1, config.onehot_add_elements // block_k)
    launch(
        onehot_add_kernel,
        (cdiv(n, block_r),),
        (dz, ids, g, n, k, v0, vc, dz.stride(0)),
        {"BLOCK_R": block_r, "BLOCK_K": block_k, "num_warps": 4},
        # The merged ids and g are fresh int64 / fp32; dz's dtype, alignment and row stride vary.
        ("onehot_add", dz.dtype, dz.data_ptr() % 16 == 0, dz.stride(0), block_r, block_k),
    )


def _onehot_block(config: TritonConfig, k: int) -> int:
    # At least 16 lanes (masked past k): no 1-wide blocks for k = 1.
    return min(config.onehot_block_k, max(16, next_power_of_two(k)))
