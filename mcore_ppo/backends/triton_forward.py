"""The triton backend's forward: the statistics launch, and the head's whole forward in kernels.

:func:`statistics_launch` runs ``stats_kernel`` (with the copy of the rows it cannot read in
place): per-split partial statistics, the label logits, and in buffer mode the probability
buffer. :func:`fused_head_forward` is :meth:`TritonBackend.head_forward
<mcore_ppo.backends.triton_backend.TritonBackend.head_forward>` once the shape's plan is taken:
``tokens_kernel`` prepares the labels, the statistics launch follows, and the outputs come out of
``merge_finish_kernel`` on one shard, or over TP out of ``split_max_kernel``,
``merge_to_max_kernel`` and ``finish_kernel`` around the combine's two all-reduces, with no torch
op between the launches (host work per call: ``scripts/host_work.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_ppo.backends.base import HeadForward, SavedTokens
from mcore_ppo.backends.triton_host import COMPACT_BLOCK, COMPACT_WARPS, gathered_rows
from mcore_ppo.backends.triton_launch import BoundLauncher
from mcore_ppo.backends.triton_plan import LaunchPlan
from mcore_ppo.numerics import inverse_temperature

_TOKENS_OPTIONS = {save: {"BLOCK": COMPACT_BLOCK, "num_warps": COMPACT_WARPS, "SAVE": save} for save in (False, True)}


def statistics_launch(
    plan: LaunchPlan,
    launch: BoundLauncher,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_labels: torch.Tensor,
    perm: torch.Tensor,
    count: torch.Tensor,
    y: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    unscale: tuple[torch.Tensor, torch.Tensor] | None = None,
    site: tuple | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The forward kernel's launch: the per-split partials ``[planes, splits, n]`` (the max, then
    one plane per term of the plan's statistics) and the label logits into ``y``; the
    probability buffer as residual when the plan stores it. ``unscale``: the operands' rows'
    scale-backs when they are fp32 inputs' fp16 parts (the plan's ``PARTS``). ``site``: the
    prefix of the launches' site keys (starting with ``plan``), given where the plan and the
    prefix fix every argument's specialisation: ``perm``, ``count`` and ``y`` fresh int32 / int32
    / fp32 tensors, and ``local_labels`` of the dtype the prefix names or int64 (the kernel does
    not specialise on their alignment); None: Triton's dispatch per launch."""
    from mcore_ppo import kernels  # decorated on first use (under the interpreter where it is set)

    n, v, device = plan.n, plan.v, hidden.device
    parts = torch.empty(plan.n_parts, plan.num_splits, n, dtype=torch.float32, device=device)
    inv_temp, inv_temp_rows, _ = inverse_temperature(temperature, y)
    if plan.store:
        buf = torch.empty(n, v, dtype=hidden.dtype, device=device)
        tmax = torch.empty(n, plan.n_tiles_v, dtype=torch.float32, device=device)
    else:
        buf = tmax = y  # unused (STORE_P off)
    gathered = hidden  # unused without descriptors: the kernel gathers rows through perm
    if plan.use_tma:
        # Only the blocks the kernel cannot read in place are copied (none when nothing is ignored).
        skip = plan.cfg.block_m if plan.direct else 0
        gathered = gathered_rows(hidden, perm, count, launch, skip_direct_blocks=skip, site=site and (*site, "gather"))
    x_unscale, w_unscale = (y, y) if unscale is None else unscale  # never read without PARTS
    # The three after inv_temp_rows are the top-k's outputs (TOPK_C), never written here.
    args = (
        hidden, gathered, weight, perm, count, local_labels, parts, y, buf, tmax, n, v, plan.h, hidden.stride(0),
        weight.stride(0), plan.num_splits, inv_temp, plan.n_tiles_v, inv_temp_rows, y, count, y, x_unscale, w_unscale,
    )  # fmt: skip
    launch(kernels.stats_kernel, plan.stats_grid, args, plan.stats_options, site and (*site, "stats"))
    return parts, (buf, tmax, perm, count) if plan.store else ()


def fused_head_forward(
    plan: LaunchPlan,
    launch: BoundLauncher,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    ignore_index: int,
    vocab_start: int,
    vocab_size: int,
    labels_in_range: bool,
    grad_needed: bool,
    max_entropy: float,
    combine: Callable | None,
    unscale: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> HeadForward:
    """:meth:`TritonBackend.head_forward <mcore_ppo.backends.triton_backend.TritonBackend.head_forward>`
    on row-major operands whose ``plan`` is taken (the statistics are the plan's), through the
    call's bound ``launch`` (module doc); ``unscale``: as for :func:`statistics_launch`."""
    from mcore_ppo import kernels

    n, device, statistics = plan.n, hidden.device, plan.statistics
    local_labels = torch.empty(n, dtype=torch.int64, device=device)
    perm = torch.empty(n, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    # Over TP the label logits are plane 0 of the sums the combine all-reduces (the same
    # pointer class as a fresh [n] tensor: the launches' specialisation is the plan's).
    sums = None if combine is None else torch.empty(plan.n_parts, n, dtype=torch.float32, device=device)
    y = torch.empty(n, dtype=torch.float32, device=device) if sums is None else sums[0]
    # Kept for the backward only: without one, placeholders the kernels never write (SAVE off).
    valid = torch.empty(n, dtype=torch.bool, device=device) if grad_needed else None
    stride_l = labels.stride(0)
    launch(
        kernels.tokens_kernel,
        (1,),
        (labels, local_labels, perm if valid is None else valid, perm, count, y, n, stride_l, ignore_index,
         vocab_start, plan.v),
        _TOKENS_OPTIONS[grad_needed],
        # The values themselves stand for their integer classes (finer, and cheaper to key).
        (plan, "tokens", labels.dtype, stride_l, ignore_index, vocab_start),
    )  # fmt: skip
    parts, residual = statistics_launch(
        plan, launch, hidden, weight, local_labels, perm, count, y, temperature, unscale=unscale, site=(plan,)
    )
    log_prob = torch.empty(n, dtype=torch.float32, device=device)
    entropy_out = torch.empty(n, dtype=torch.float32, device=device) if statistics.entropy else None
    entropy_out_arg = log_prob if entropy_out is None else entropy_out  # never written without the entropy
    detached = None
    if statistics.detached:
        detached = torch.empty(len(statistics.detached), n, dtype=torch.float32, device=device)
    detached_arg = log_prob if detached is None else detached  # nor without a detached statistic
    merge_grid = plan.merge_grid
    lse = torch.empty(n, dtype=torch.float32, device=device) if grad_needed else None
    entropy = torch.empty(n, dtype=torch.float32, device=device) if grad_needed and statistics.entropy else None
    lse_arg = log_prob if lse is None else lse  # never written without SAVE
    entropy_arg = lse_arg if entropy is None else entropy
    if sums is None:
        launch(
            kernels.merge_finish_kernel,
            merge_grid,
            (
                parts, perm, count, y, labels, lse_arg, entropy_arg, log_prob, entropy_out_arg, detached_arg, n,
                plan.num_splits, stride_l, vocab_size, max_entropy,
            ),
            plan.finish_options[labels_in_range, grad_needed],
            # The plan fixes every argument's specialisation but the labels' dtype and the
            # integer class of their stride and of the vocab size (their values stand for it).
            (plan, "finish", labels_in_range, labels.dtype, stride_l, vocab_size),
        )  # fmt: skip
    else:
        # The plan fixes the specialisation of every argument of these three launches (fresh
        # tensors of its n) but the labels' and the integers' (their values stand for it).
        shard_max = torch.empty(n, dtype=torch.float32, device=device)
        merge_args = (parts, perm, count, shard_max, n, plan.num_splits)
        launch(kernels.split_max_kernel, merge_grid, merge_args, plan.tp_options["max"], (plan, "max"))

        def sums_relative_to(global_max: torch.Tensor) -> torch.Tensor:
            launch(
                kernels.merge_to_max_kernel, merge_grid, (*merge_args[:3], global_max, sums, *merge_args[4:]),
                plan.tp_options["merge"], (plan, "merge"),
            )  # fmt: skip
            return sums

        global_max, summed = combine(shard_max, sums_relative_to)
        launch(
            kernels.finish_kernel,
            merge_grid,
            (
                global_max, summed, labels, lse_arg, entropy_arg, log_prob, entropy_out_arg, detached_arg, n,
                stride_l, ignore_index, vocab_size, max_entropy,
            ),
            plan.tp_options[labels_in_range, grad_needed],
            (plan, "combined", labels_in_range, labels.dtype, stride_l, ignore_index, vocab_size),
        )  # fmt: skip
    if not residual and grad_needed:
        residual = (perm, count)  # the row order, for a backward that recomputes
    saved = SavedTokens(local_labels, valid, lse, entropy, residual, fused_forward=True)
    return HeadForward(log_prob, entropy_out, saved, detached)
