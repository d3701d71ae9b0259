"""The triton backend's backward: ``dz`` by recompute, or from the forward's probability buffer.

Recompute: per vocab chunk ``dz_kernel`` recomputes the logits and writes ``dz / T`` (input
dtype, rows in compacted order: valid first) into a bounded workspace; cuBLAS then does
``d_hidden_c += dz @ W_chunk`` (fp32 output) and ``d_W_chunk (+)= dzᵀ @ x_c``, where each row of
``d_W`` comes from one fp32-accumulated GEMM over all tokens (so a weight-dtype buffer rounds
once) and ``x_c`` has zeros past the valid rows (no inf padding reaches ``d_W``).

Buffer: ``dz`` formed in place from the forward's ``2^(z₂ − tile max)`` and tile maxima, then the
two GEMMs once over the whole shard: three GEMMs per step instead of four.

A request's one-hot gradients at ``k`` ids per token are added to ``dz`` after the kernel that
writes it and before the GEMMs (:mod:`mcore_ppo.backends.triton_ids`), so both modes carry them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_ppo.backends.base import GradientRequest, SavedTokens
from mcore_ppo.backends.fp32_gemms import addmm_fp32, gemm_into, mm_fp32
from mcore_ppo.backends.triton_config import TritonConfig
from mcore_ppo.backends.triton_host import (
    GemmConfig,
    compact_rows,
    for_dtype,
    gathered_rows,
    kernel_flags,
    operand_parts,
    operands_by_tma,
    scatter_rows,
    upstream_gradients,
    with_tma_store,
)
from mcore_ppo.backends.triton_ids import add_onehot, merged_onehot
from mcore_ppo.backends.triton_launch import host_descriptor
from mcore_ppo.backends.triton_plan import LaunchPlan
from mcore_ppo.numerics import Numerics, cdiv, inverse_temperature


def vocab_chunk(config: TritonConfig, backward_config: GemmConfig, n: int, v: int, itemsize: int) -> int:
    """Columns per backward chunk: the ``dz`` workspace stays within ``config.workspace_bytes``."""
    bn = backward_config.block_n
    cols = max(bn, (config.workspace_bytes // max(1, n * itemsize)) // bn * bn)
    return min(cols, v)


def gradients_by_recompute(
    config: TritonConfig,
    backward_config: GemmConfig,
    launch: Callable,
    plan: LaunchPlan | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    saved: SavedTokens,
    request: GradientRequest,
    *,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward without a buffer: ``dz`` recomputed vocab chunk by chunk (module doc), with a
    backend's ``config`` and backward tiles ``backward_config``, through ``launch`` (the call's
    bound launcher). ``plan``: the forward's, keying the launch sites (None: Triton's own
    dispatch per launch)."""
    from mcore_ppo.kernels import dz_kernel

    local_labels, valid, lse, entropy = saved.local_labels, saved.valid, saved.lse, saved.entropy
    weight_grad = request.weight_grad

    numerics = Numerics.of(hidden.dtype, config.precision)
    cfg = for_dtype(backward_config, numerics.operand_dtype)
    n, v = hidden.shape[0], weight.shape[0]
    device = hidden.device
    if saved.residual:  # the forward's row order, when it kept it
        perm, count = saved.residual
    else:
        perm, count = compact_rows(valid, launch)
    has_g, has_e, g, e = upstream_gradients(request.grad_log_prob, _entropy_grad(saved, request), lse)
    inv_temp, inv_temp_rows, row_temp = inverse_temperature(temperature, lse)
    entropy = lse if entropy is None else entropy  # a pointer the kernel never reads (HAS_E off)
    # The GEMM operands: the inputs, or fp32 inputs' fp16 parts, which the forward's logits
    # came from (dz then meets the forward's lse on the same logits; fp32 dz for the fp32 GEMMs).
    if numerics.parts:
        x_dot, w_dot, (x_unscale, w_unscale) = operand_parts(hidden, weight, launch)
    else:
        x_dot, w_dot, x_unscale, w_unscale = hidden, weight, lse, lse  # the scale-backs: never read
    # Compacted order throughout: dz rows, d_hidden rows, and x_c for d_W (ignored rows zero).
    use_tma = operands_by_tma(x_dot, w_dot, cfg)
    site = None if plan is None else (plan, "recompute")
    x_c = x_dot_c = None
    if (use_tma and not numerics.parts) or weight_grad is not None:
        x_c = gathered_rows(hidden, perm, count, launch, site=site and (*site, "gather"))
    if use_tma:  # the dz kernel's rows, by descriptor: the gathered inputs, or gathered parts
        parts_site = site and (*site, "gather_parts")
        x_dot_c = gathered_rows(x_dot, perm, count, launch, site=parts_site) if numerics.parts else x_c
    hidden_grad_c = None  # fp32 [n, h]: the first chunk's GEMM writes it, the others add
    chunk = vocab_chunk(config, backward_config, n, v, hidden.element_size())
    workspace = torch.empty(n, chunk, dtype=hidden.dtype, device=device)
    flags = kernel_flags(x_dot, cfg, numerics)
    # Host descriptors, encoded per launch by Triton: one launch per chunk of thousands of
    # single-tile programs, where a descriptor built in each program would cost more GPU time.
    x_desc = host_descriptor(x_dot_c, (cfg.block_m, cfg.block_k)) if use_tma else x_dot
    w_desc = host_descriptor(w_dot, (cfg.block_n, cfg.block_k)) if use_tma else w_dot
    dz_tma, cfg = with_tma_store(config.dz_store_tma, workspace, cfg)
    options = {
        "HAS_G": has_g, "HAS_E": has_e, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "USE_TMA": use_tma,
        "DZ_TMA": dz_tma, **flags, **({"ROW_TEMP": True} if row_temp else {}),
    }  # fmt: skip
    x_arg = x_dot_c if use_tma else x_dot
    onehot = merged_onehot(config, launch, request.sparse, perm, count, temperature, lse)
    # The chunks' rows of W and d_W as views made in one call each (a slice per chunk costs
    # more host time); the same views as weight[v0 : v0 + vc].
    w_chunks = weight.split(chunk) if chunk < v else (weight,)
    g_chunks = () if weight_grad is None else weight_grad.split(chunk) if chunk < v else (weight_grad,)
    for index, v0 in enumerate(range(0, v, chunk)):
        vc = min(chunk, v - v0)
        dz = workspace[:, :vc] if vc < chunk else workspace
        dz_desc = host_descriptor(dz, (cfg.block_m, cfg.block_n)) if dz_tma else dz
        args = (
            x_arg, w_dot, x_desc, w_desc, perm, count, local_labels, lse, entropy, g, e, dz, dz_desc, n, vc, v0,
            x_dot.shape[1], x_dot.stride(0), w_dot.stride(0), workspace.stride(0), inv_temp, inv_temp_rows,
            x_unscale, w_unscale,
        )  # fmt: skip
        # The forward's plan fixes the operands' (and the chunk's) specialisation; the
        # upstream gradients' presence and the per-token tensors' dtypes vary by call.
        key = site and (*site, "dz", has_g, has_e, local_labels.dtype, lse.dtype, entropy.dtype)
        launch(dz_kernel, (cdiv(n, cfg.block_m) * cdiv(vc, cfg.block_n),), args, options, key)
        if onehot is not None:
            add_onehot(config, launch, dz, onehot, v0, vc)
        w_rows = w_chunks[index]
        if request.need_hidden_grad and hidden_grad_c is None:
            hidden_grad_c = mm_fp32(dz, w_rows)
        elif request.need_hidden_grad:
            addmm_fp32(hidden_grad_c, dz, w_rows)
        if weight_grad is not None:
            gemm_into(g_chunks[index], dz.t(), x_c, overwrite=request.weight_grad_unset)
    # Before the rows of d_hidden get a second buffer: every reference to the workspace and x_c.
    del workspace, x_c, x_dot_c, x_arg, x_dot, w_dot, dz, dz_desc, x_desc, w_desc, args, w_chunks, g_chunks
    hidden_grad = None
    if hidden_grad_c is not None:
        hidden_grad = scatter_rows(hidden_grad_c, perm, hidden.dtype, launch, site=site and (*site, "scatter"))
    return hidden_grad, weight_grad


def gradients_from_buffer(
    config: TritonConfig,
    launch: Callable,
    plan: LaunchPlan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    saved: SavedTokens,
    request: GradientRequest,
    *,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of the buffer mode: ``dz`` formed in place from the forward's buffer, then
    the two GEMMs over the whole shard at once (K = V/tp for ``d_hidden``: no fp32
    read-modify-write per chunk). Three GEMMs per step instead of four. ``plan``: the
    forward's (its tiles are the buffer's); it keys the launch sites. ``launch``: the call's
    bound launcher."""
    from mcore_ppo.kernels import dz_from_buffer_kernel

    buf, tmax, perm, count = saved.residual
    local_labels, lse, entropy = saved.local_labels, saved.lse, saved.entropy
    weight_grad = request.weight_grad
    n, v = hidden.shape[0], weight.shape[0]
    block_n = plan.cfg.block_n  # the forward's tiles, whose maxima tmax holds
    has_g, has_e, g, e = upstream_gradients(request.grad_log_prob, _entropy_grad(saved, request), lse)
    inv_temp, inv_temp_rows, row_temp = inverse_temperature(temperature, lse)
    entropy = lse if entropy is None else entropy  # a pointer the kernel never reads (HAS_E off)
    cfg = config.buffer_dz_config
    n_tiles_v = tmax.shape[1]
    # The forward's plan fixes every argument's specialisation but the upstream gradients'
    # presence and the per-token tensors' dtypes (the kernel does not specialise on their
    # alignment).
    launch(
        dz_from_buffer_kernel,
        (cdiv(n, cfg.block_m) * n_tiles_v,),
        (buf, tmax, perm, count, local_labels, lse, entropy, g, e, n, v, n_tiles_v, inv_temp, inv_temp_rows),
        {
            "HAS_G": has_g, "HAS_E": has_e, "BLOCK_M": cfg.block_m, "BLOCK_N": block_n,
            "FAST_LOG2": cfg.fast_log2 and buf.dtype == torch.bfloat16, "num_warps": cfg.num_warps,
            **({"ROW_TEMP": True} if row_temp else {}),
        },
        (plan, "dz_buffer", has_g, has_e, local_labels.dtype, lse.dtype, entropy.dtype),
    )  # fmt: skip
    del tmax
    if request.sparse is not None:
        onehot = merged_onehot(config, launch, request.sparse, perm, count, temperature, lse)
        add_onehot(config, launch, buf, onehot, 0, v)
    hidden_grad = None
    if request.need_hidden_grad:
        hidden_grad_c = mm_fp32(buf, weight)
    if weight_grad is not None:
        x_c = gathered_rows(hidden, perm, count, launch, site=(plan, "gather_backward"))
        gemm_into(weight_grad, buf.t(), x_c, overwrite=request.weight_grad_unset)
        del x_c
    del buf
    if request.need_hidden_grad:
        hidden_grad = scatter_rows(hidden_grad_c, perm, hidden.dtype, launch, site=(plan, "scatter"))
    return hidden_grad, weight_grad


def _entropy_grad(saved: SavedTokens, request: GradientRequest) -> torch.Tensor | None:
    """The entropy's upstream gradient, None when the forward computed no entropy."""
    return None if saved.entropy is None else request.grad_entropy
