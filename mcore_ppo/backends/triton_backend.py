"""Fused Triton backend: the head's statistics and gradients at the GEMM floor (docs/kernels.md).

Forward (:meth:`TritonBackend.shard_statistics`): ``stats_kernel`` folds the logit tiles
``x @ W.T / T`` (fp32 accumulation) into online softmax statistics in registers, one partial
per (vocab split, token); ``merge_splits_kernel`` merges the splits per token.

Backward, recompute: per vocab chunk ``dz_kernel`` recomputes the logits and writes ``dz / T``
(input dtype, rows in compacted order: valid first) into a bounded workspace; cuBLAS then does
``d_hidden_c += dz @ W_chunk`` (fp32 output) and ``d_W_chunk (+)= dzᵀ @ x_c``, where each row of
``d_W`` comes from one fp32-accumulated GEMM over all tokens (so a weight-dtype buffer rounds
once) and ``x_c`` has zeros past the valid rows (no inf padding reaches ``d_W``).

Backward, buffer (the option is documented on :class:`mcore_ppo.pipeline.HeadOptions`):
when a gradient will be needed and the buffer fits the budget, the forward also stores
``2^(z₂ − tile max)`` and the tile maxima and returns them as its residual
(:class:`ProbabilityBuffer`); the backward forms ``dz`` from it in place and runs the two GEMMs
once over the shard: three GEMMs per step instead of four.

A request with one-hot gradients at ``k`` ids per token (:attr:`GradientRequest.sparse`: the
student's, :mod:`mcore_ppo.distill.student`) has them merged once per token and added to ``dz``
after the kernel that writes it and before the GEMMs (:mod:`mcore_ppo.kernels.gather`), so both
modes' GEMMs carry them; without one the launches are the ones above.

A per-token temperature (``[n]`` tensor) reaches every kernel as a ``1/T`` vector read per row
(their ``ROW_TEMP`` flag); a float reaches them as the scalar ``1/T``, in kernels compiled as
they were before the option existed. Without the entropy (``with_entropy=False``) the forward
kernels skip the ``u`` sums (``WITH_U``) and the backward's entropy term is off (``HAS_E``).

Ignored tokens are compacted on the device (:func:`compact_rows`): programs past the valid count
exit before any GEMM work, and nothing syncs the host.

Host work per call (docs: ``scripts/host_work.py``): the autograd Function runs the whole forward
through :meth:`TritonBackend.head_forward`, which prepares the labels (``tokens_kernel``:
valid flags, local labels, row order, zeroed label logits) and finishes the outputs
(``merge_finish_kernel``: ``lse``, entropy, log-prob, clamps and masks) in kernels, so the
forward issues only allocations and launches; what depends on shapes alone is decided once per
shape (:class:`_ForwardPlan`, cached on the backend by shape, dtype, strides, alignment and
device); the launches skip Triton's per-call dispatch (:mod:`mcore_ppo.backends.triton_launch`), keyed by the plan.

Nothing is kept on the backend between calls but those plans; its settings are constructor
arguments whose defaults are this module's constants, read at construction (tests patch the
constants, benchmarks pass arguments).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mcore_ppo.backends.base import GradientRequest, HeadForward, SavedTokens, ShardStatistics, SparseGradient
from mcore_ppo.backends.torch_backend import TorchBackend
from mcore_ppo.backends.triton_host import (
    COMPACT_BLOCK,
    COMPACT_WARPS,
    MERGE_BLOCK_S,
    MERGE_BLOCK_T,
    ElementwiseConfig,
    GemmConfig,
    ProbabilityBuffer,
    addmm_fp32,
    budget_bytes,
    cdiv,
    compact_rows,
    descriptor_ok,
    for_dtype,
    gathered_rows,
    gemm_into,
    interpreting,
    kernel_flags,
    log_buffer_decision,
    merge_splits,
    mm_fp32,
    operands_by_tma,
    rowmajor,
    scatter_rows,
    upstream_gradients,
    with_tma_store,
)
from mcore_ppo.backends.triton_launch import TmaDesc, launch
from mcore_ppo.logs import log_once

try:  # the package itself is optional; anything else broken in it should raise
    import triton
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = None

__all__ = [
    "ProbabilityBuffer",
    "TritonBackend",
    "compact_rows",
    "environment_budget",
    "interpreting",
    "is_available",
    "replace",
]


def is_available() -> bool:
    """Triton is importable and can run here (a CUDA device, or the interpreter)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


# Chosen by measurement on one H200 (docs/kernels.md, profile_head --sweep-forward): TMA
# operands and 3 stages were the fastest forward at every V/tp measured; tiles per split follow
# the shard (below), 2 being the small shards' value.
FORWARD_CONFIG = GemmConfig(num_stages=3, tiles_per_split=2, use_tma=True)
# Vocab tiles per forward program, by shard (measured: profile_head.py --sweep-forward, qwen7b,
# llama3-8b and V 262144 at TP 1-8, docs/kernels.md "tiles per split by shard"): the most of
# these that still leaves MIN_FORWARD_SPLITS vocab splits per row block. Longer programs merge
# fewer partials and start fewer pipelines; too few splits leave SMs idle in the last waves.
FORWARD_TILES_PER_SPLIT = (8, 4, 2)
MIN_FORWARD_SPLITS = 48
BACKWARD_CONFIG = GemmConfig(tiles_per_split=1, use_tma=True)
INTERPRETER_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1)
# Upper bound on the bf16 ``dz`` workspace of the backward (one vocab chunk × all tokens).
WORKSPACE_BYTES = 240 * 2**20
# Default of ``buffer_budget_bytes`` (documented in full on mcore_ppo.pipeline.HeadOptions):
# it buys the buffer where it costs at most 1 GiB (e.g. 16384 tokens × V/tp ≤ 32k in bf16, TP 8
# for a 152k vocab); docs/kernels.md has the measurements behind it.
BUFFER_BUDGET_BYTES = 1 << 30
# The budget of the backend that backend="triton"/"auto" build (read once, when it is built): bytes,
# or with a unit ("1GiB", "512MB").
BUFFER_BUDGET_ENV = "MCORE_PPO_BUFFER_BUDGET_BYTES"
# Copy-engine (TMA) stores of the forward's buffer tiles and the backward's dz tiles: both are
# written in compacted row order, so a program's tile is one contiguous block.
BUFFER_STORE_TMA = True
DZ_STORE_TMA = True
BUFFER_DZ_CONFIG = ElementwiseConfig()
# The whole forward through head_forward (labels prepared and outputs finished in kernels);
# False: the Function's generic path over shard_statistics (tests compare the two).
FUSED_HEAD = True
# Forward plans kept per backend (one per shape and option set a process uses).
PLAN_CACHE_SIZE = 64
# Slots per step of the one-hot kernels of a sparse gradient (mcore_ppo.kernels.gather), and
# slots per program of its add (rows × slots); read at each call.
ONEHOT_BLOCK_K = 64
ONEHOT_ADD_ELEMENTS = 1024
_TOKENS_OPTIONS = {save: {"BLOCK": COMPACT_BLOCK, "num_warps": COMPACT_WARPS, "SAVE": save} for save in (False, True)}


def environment_budget() -> int | None:
    """``MCORE_PPO_BUFFER_BUDGET_BYTES`` as bytes (a unit allowed: ``1GiB``), None when unset.

    Read by :func:`mcore_ppo.backends.resolve_backend` when it first builds the triton backend
    for a name; a ``TritonBackend`` built by the caller ignores it."""
    env = os.environ.get(BUFFER_BUDGET_ENV, "").strip()
    return budget_bytes(env, BUFFER_BUDGET_ENV) if env else None


class TritonBackend:
    """Fused Triton kernels behind the :class:`~mcore_ppo.backends.base.Backend` protocol.

    ``weight_grad_in_weight_dtype``: when Megatron's ``main_grad`` is not used, the Function
    may hand this backend a ``d_W`` buffer in the weight's own dtype: every row of ``d_W``
    comes out of one fp32-accumulated GEMM over all tokens, so rounding it once into bf16 is
    what an fp32 buffer cast at the end would give, for half the memory and no cast.
    ``writes_weight_grad``: that buffer may come unfilled; each row is written, not added to.
    """

    name = "triton"
    weight_grad_in_weight_dtype = True
    writes_weight_grad = True

    def __init__(
        self,
        forward_config: GemmConfig | None = None,
        backward_config: GemmConfig | None = None,
        workspace_bytes: int | None = None,
        buffer_budget_bytes: int | None = None,
        *,
        buffer_store_tma: bool | None = None,
        dz_store_tma: bool | None = None,
        buffer_dz_config: ElementwiseConfig | None = None,
    ):
        """Settings fixed for the backend's life; None takes this module's default (read now).

        ``buffer_budget_bytes``: bytes this rank may hold in the probability buffer (an int, or
        text with a unit: ``1GiB``, ``512MB``; see :func:`triton_host.budget_bytes`); None:
        :data:`BUFFER_BUDGET_BYTES`. The environment variable is not read here: it is the
        default of the backend that ``backend="triton"`` / ``"auto"`` build
        (:func:`environment_budget`). ``buffer_store_tma`` / ``dz_store_tma``: copy-engine
        stores of the buffer / dz tiles where the device allows them. ``buffer_dz_config``:
        tiling of the buffer-mode ``dz`` kernel.
        """
        small = INTERPRETER_CONFIG if interpreting() else None
        self.forward_config = forward_config or small or FORWARD_CONFIG
        # Only the default GPU config follows the shard size; a given config is used as given.
        self.tiles_by_shard = forward_config is None and small is None
        self.backward_config = backward_config or (small and replace(small, tiles_per_split=1)) or BACKWARD_CONFIG
        self.workspace_bytes = workspace_bytes or WORKSPACE_BYTES
        if buffer_budget_bytes is None:
            buffer_budget_bytes = BUFFER_BUDGET_BYTES
        self.buffer_budget_bytes = budget_bytes(buffer_budget_bytes, "buffer_budget_bytes")
        self.buffer_store_tma = BUFFER_STORE_TMA if buffer_store_tma is None else buffer_store_tma
        self.dz_store_tma = DZ_STORE_TMA if dz_store_tma is None else dz_store_tma
        self.buffer_dz_config = buffer_dz_config or BUFFER_DZ_CONFIG
        self.fused_head = FUSED_HEAD
        self._reference = TorchBackend()
        self._plans: dict[tuple, _ForwardPlan] = {}

    def _fallback(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        # fp64 (gradcheck), empty problems and meta tensors (shape inference) go to the chunked reference.
        if hidden.device.type not in ("cuda", "meta") and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {hidden.device} tensors; "
                "use backend='torch' or 'auto' for them"
            )
        if hidden.dtype == torch.float64:
            log_once(logging.INFO, ("triton-fallback", "fp64"), "mcore_ppo: triton backend -> torch reference: fp64")
            return True
        return hidden.numel() == 0 or weight.shape[0] == 0 or hidden.is_meta

    def shard_statistics(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        grad_needed: bool = False,
        with_entropy: bool = True,
    ) -> ShardStatistics:
        """fp32 ``(m, s, u, y)`` over this shard (``u`` None without entropy), and with
        ``grad_needed`` and a budget that fits, the :class:`ProbabilityBuffer` as residual; see
        the Backend protocol."""
        if self._fallback(hidden, weight):
            return self._reference.shard_statistics(
                hidden, weight, local_labels, valid, temperature, with_entropy=with_entropy
            )
        hidden, weight = rowmajor(hidden), rowmajor(weight)
        plan = self._forward_plan(hidden, weight, grad_needed, with_entropy, isinstance(temperature, torch.Tensor))
        perm, count = compact_rows(valid)
        y = torch.zeros(plan.n, dtype=torch.float32, device=hidden.device)
        parts, residual = self._statistics(plan, hidden, weight, local_labels, perm, count, y, temperature)
        m, sum_exp, u = merge_splits(parts, perm, count, with_u=with_entropy)
        return ShardStatistics(m, sum_exp, u, y, residual)

    def head_forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        ignore_index: int,
        vocab_start: int,
        vocab_size: int,
        labels_checked: bool,
        grad_needed: bool,
        with_entropy: bool,
        max_entropy: float,
        combine: Callable | None,
    ) -> HeadForward | None:
        """The whole forward of the head on this shard in three to six launches (see
        :class:`~mcore_ppo.backends.base.FusedHeadBackend`): the per-token preparation from the
        global labels (``tokens_kernel``), the statistics, and, on one shard, the merge with
        the outputs' epilogue in one kernel (``merge_finish_kernel``); over TP the merge, the
        caller's ``combine`` and the epilogue (``finish_kernel``). None (the caller runs the
        generic path) where :meth:`shard_statistics` would fall back to the reference, or with
        :data:`FUSED_HEAD` off."""
        if not self.fused_head or self._fallback(hidden, weight):
            return None
        from mcore_ppo import kernels

        hidden, weight = rowmajor(hidden), rowmajor(weight)
        row_temp = isinstance(temperature, torch.Tensor)
        plan = self._forward_plan(hidden, weight, grad_needed, with_entropy, row_temp)
        n, device = plan.n, hidden.device
        local_labels = torch.empty(n, dtype=torch.int64, device=device)
        perm = torch.empty(n, dtype=torch.int32, device=device)
        count = torch.empty(1, dtype=torch.int32, device=device)
        y = torch.empty(n, dtype=torch.float32, device=device)
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
        parts, residual = self._statistics(plan, hidden, weight, local_labels, perm, count, y, temperature, site=True)
        log_prob = torch.empty(n, dtype=torch.float32, device=device)
        entropy_out = torch.empty(n, dtype=torch.float32, device=device) if with_entropy else None
        ent_out = log_prob if entropy_out is None else entropy_out  # never written without WITH_U
        merge_grid = (cdiv(n, MERGE_BLOCK_T),)
        if combine is None:
            lse = torch.empty(n, dtype=torch.float32, device=device) if grad_needed else None
            entropy = torch.empty(n, dtype=torch.float32, device=device) if grad_needed and with_entropy else None
            lse_arg = log_prob if lse is None else lse
            launch(
                kernels.merge_finish_kernel,
                merge_grid,
                (
                    parts[0], parts[1], parts[-1], perm, count, y, labels, lse_arg,
                    lse_arg if entropy is None else entropy, log_prob, ent_out, n, plan.num_splits, stride_l,
                    vocab_size, max_entropy,
                ),
                plan.finish_options[labels_checked, grad_needed],
                # The plan fixes every argument's specialisation but the labels' dtype and the
                # integer class of their stride and of the vocab size (their values stand for it).
                (plan, "finish", labels_checked, labels.dtype, stride_l, vocab_size),
            )  # fmt: skip
        else:
            m, sum_exp, u = merge_splits(parts, perm, count, with_u=with_entropy)
            lse, entropy, label_logit = combine(m, sum_exp, u, y)
            launch(
                kernels.finish_kernel,
                merge_grid,
                (
                    lse, lse if entropy is None else entropy, label_logit, labels, log_prob, ent_out, n, stride_l,
                    ignore_index, vocab_size, max_entropy,
                ),
                plan.combined_options[labels_checked],
            )  # fmt: skip
        if residual is None and grad_needed:
            residual = RowOrder(perm, count, plan)
        return HeadForward(log_prob, entropy_out, SavedTokens(local_labels, valid, lse, entropy, residual))

    def _forward_plan(
        self, hidden: torch.Tensor, weight: torch.Tensor, grad_needed: bool, with_entropy: bool, row_temp: bool
    ) -> _ForwardPlan:
        """The forward's per-shape decisions, made once per key (shapes, dtype, strides, 16-byte
        alignment of the operands, device, gradient and options)."""
        key = (
            tuple(hidden.shape), weight.shape[0], hidden.dtype, hidden.stride(0), weight.stride(0),
            hidden.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0, hidden.device, grad_needed,
            with_entropy, row_temp,
        )  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = self._plans[key] = _ForwardPlan.build(self, hidden, weight, grad_needed, with_entropy, row_temp)
        return plan

    def _statistics(
        self,
        plan: _ForwardPlan,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        perm: torch.Tensor,
        count: torch.Tensor,
        y: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        site: bool = False,
    ) -> tuple[tuple[torch.Tensor, ...], ProbabilityBuffer | None]:
        """The forward kernel's launches: per-split partials ``(m, s[, u])`` (``[splits, n]``
        each) and the label logits into ``y``; the probability buffer as residual when the
        plan stores it. ``site``: the caller's ``local_labels``, ``perm``, ``count`` and ``y``
        are the fresh int64 / int32 / int32 / fp32 tensors of :meth:`head_forward`, so the plan
        fixes every argument's specialisation (the launch skips the per-argument key)."""
        from mcore_ppo import kernels

        n, v, device = plan.n, plan.v, hidden.device
        # Separate buffers: views of one (unbind) cost more host time than the allocations.
        parts = tuple(torch.empty(plan.num_splits, n, dtype=torch.float32, device=device) for _ in range(plan.n_parts))
        inv_temp, inv_temp_rows, _ = _inverse_temperature(temperature, y)
        if plan.store:
            buf = torch.empty(n, v, dtype=hidden.dtype, device=device)
            tmax = torch.empty(n, plan.n_tiles_v, dtype=torch.float32, device=device)
        else:
            buf = tmax = y  # unused (STORE_P off)
        cfg = plan.cfg
        w_desc = TmaDesc(weight, (cfg.block_n, cfg.block_k)) if plan.use_tma else weight
        buf_desc = TmaDesc(buf, (cfg.block_m, cfg.block_n)) if plan.buf_tma else buf

        def run(x_rows: torch.Tensor, direct_pass: int) -> None:
            x_desc = TmaDesc(x_rows, (cfg.block_m, cfg.block_k)) if plan.use_tma else x_rows
            args = (
                x_rows, weight, x_desc, w_desc, perm, count, local_labels, parts[0], parts[1], parts[-1], y, buf,
                buf_desc, tmax, n, v, plan.h, x_rows.stride(0), weight.stride(0), plan.num_splits, inv_temp,
                plan.n_tiles_v, direct_pass, inv_temp_rows,
            )  # fmt: skip
            key = (plan, "stats", direct_pass) if site else None
            launch(kernels.stats_kernel, plan.stats_grid, args, plan.stats_options, key)

        gather_site = (plan, "gather") if site else None
        if plan.direct:
            run(hidden, 1)
            run(gathered_rows(hidden, perm, count, skip_direct_blocks=cfg.block_m, site=gather_site), 0)
        else:
            run(gathered_rows(hidden, perm, count, site=gather_site) if plan.use_tma else hidden, 0)
        residual = (
            ProbabilityBuffer(buf, tmax, cfg.block_n, perm, count, plan if site else None) if plan.store else None
        )
        return parts, residual

    def forward_config_for(self, v: int) -> GemmConfig:
        """The forward's tile config for a shard of ``v`` vocab rows (one per shard size, so
        one compile per model): the default's ``tiles_per_split`` by FORWARD_TILES_PER_SPLIT."""
        cfg = self.forward_config
        if not self.tiles_by_shard:
            return cfg
        for tiles in FORWARD_TILES_PER_SPLIT:
            if cdiv(v, tiles * cfg.block_n) >= MIN_FORWARD_SPLITS:
                return replace(cfg, tiles_per_split=tiles)
        return replace(cfg, tiles_per_split=FORWARD_TILES_PER_SPLIT[-1])

    def vocab_chunk(self, n: int, v: int, itemsize: int) -> int:
        """Columns per backward chunk: the ``dz`` workspace stays within ``workspace_bytes``."""
        bn = self.backward_config.block_n
        cols = max(bn, (self.workspace_bytes // max(1, n * itemsize)) // bn * bn)
        return min(cols, v)

    def folds_sparse_gradient(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`shard_gradients` takes a :class:`GradientRequest` with ``sparse`` for
        these inputs: where it runs its kernels (not on the reference's inputs: fp64, empty)."""
        return not self._fallback(hidden, weight)

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This shard's ``(d_hidden, d_weight)`` (``d_hidden`` in the input dtype, rounded once
        from fp32 accumulation): from the forward's buffer when ``saved`` carries one, else by
        recomputing the logits; see the Backend protocol. A ``request.sparse`` is added to
        ``dz`` before the GEMMs (:func:`_merged_onehot`)."""
        if self._fallback(hidden, weight):
            if request.sparse is not None:
                raise ValueError(
                    "request.sparse needs the triton backend's kernels (folds_sparse_gradient is False for "
                    f"{hidden.dtype} inputs of shape {tuple(hidden.shape)})"
                )
            if request.weight_grad_unset:  # the reference adds into d_W
                request.weight_grad.zero_()
            path = self._reference.shard_gradients
        elif isinstance(saved.residual, ProbabilityBuffer):
            path = self._gradients_from_buffer
        else:
            path = self._gradients_by_recompute
        return path(hidden, weight, saved, request, temperature=temperature)

    def _gradients_by_recompute(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Backward without a buffer: ``dz`` recomputed vocab chunk by chunk (module doc)."""
        from mcore_ppo.kernels import dz_kernel

        local_labels, valid, lse, entropy = saved.local_labels, saved.valid, saved.lse, saved.entropy
        weight_grad = request.weight_grad

        hidden, weight = rowmajor(hidden), rowmajor(weight)
        cfg = for_dtype(self.backward_config, hidden.dtype)
        n, h = hidden.shape
        v = weight.shape[0]
        device = hidden.device
        plan = None
        if isinstance(saved.residual, RowOrder):  # the forward's, when it kept it
            perm, count, plan = saved.residual.perm, saved.residual.count, saved.residual.plan
        else:
            perm, count = compact_rows(valid)
        has_g, has_e, g, e = upstream_gradients(request.grad_log_prob, _entropy_grad(saved, request), lse)
        inv_temp, inv_temp_rows, row_temp = _inverse_temperature(temperature, lse)
        entropy = lse if entropy is None else entropy  # a pointer the kernel never reads (HAS_E off)
        # Compacted order throughout: dz rows, d_hidden rows, and x_c for d_W (ignored rows zero).
        use_tma = operands_by_tma(hidden, weight, cfg)
        site = None if plan is None else (plan, "recompute")
        x_c = None
        if use_tma or weight_grad is not None:
            x_c = gathered_rows(hidden, perm, count, site=site and (*site, "gather"))
        hidden_grad_c = None  # fp32 [n, h]: the first chunk's GEMM writes it, the others add
        chunk = self.vocab_chunk(n, v, hidden.element_size())
        workspace = torch.empty(n, chunk, dtype=hidden.dtype, device=device)
        flags = kernel_flags(hidden, cfg)
        x_desc = TmaDesc(x_c, (cfg.block_m, cfg.block_k)) if use_tma else hidden
        w_desc = TmaDesc(weight, (cfg.block_n, cfg.block_k)) if use_tma else weight
        dz_tma, cfg = with_tma_store(self.dz_store_tma, workspace, cfg)
        options = {
            "HAS_G": has_g, "HAS_E": has_e, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "USE_TMA": use_tma,
            "DZ_TMA": dz_tma, **flags, **({"ROW_TEMP": True} if row_temp else {}),
        }  # fmt: skip
        x_arg = x_c if use_tma else hidden
        onehot = _merged_onehot(request.sparse, perm, count, temperature, lse)
        # The chunks' rows of W and d_W as views made in one call each (a slice per chunk costs
        # more host time); the same views as weight[v0 : v0 + vc].
        w_chunks = weight.split(chunk) if chunk < v else (weight,)
        g_chunks = () if weight_grad is None else weight_grad.split(chunk) if chunk < v else (weight_grad,)
        for index, v0 in enumerate(range(0, v, chunk)):
            vc = min(chunk, v - v0)
            dz = workspace[:, :vc] if vc < chunk else workspace
            dz_desc = TmaDesc(dz, (cfg.block_m, cfg.block_n)) if dz_tma else dz
            args = (
                x_arg, weight, x_desc, w_desc, perm, count, local_labels, lse, entropy, g, e, dz, dz_desc, n, vc, v0,
                h, hidden.stride(0), weight.stride(0), workspace.stride(0), inv_temp, inv_temp_rows,
            )  # fmt: skip
            # The forward's plan fixes the operands' (and the chunk's) specialisation; the
            # upstream gradients' presence and the labels' dtype vary by call.
            key = site and (*site, "dz", has_g, has_e, local_labels.dtype)
            launch(dz_kernel, (cdiv(n, cfg.block_m) * cdiv(vc, cfg.block_n),), args, options, key)
            if onehot is not None:
                _add_onehot(dz, onehot, v0, vc)
            w_rows = w_chunks[index]
            if request.need_hidden_grad and hidden_grad_c is None:
                hidden_grad_c = mm_fp32(dz, w_rows)
            elif request.need_hidden_grad:
                addmm_fp32(hidden_grad_c, dz, w_rows)
            if weight_grad is not None:
                gemm_into(g_chunks[index], dz.t(), x_c, overwrite=request.weight_grad_unset)
        # Before the rows of d_hidden get a second buffer: every reference to the workspace and x_c.
        del workspace, x_c, x_arg, dz, dz_desc, x_desc, args, w_chunks, g_chunks
        hidden_grad = None
        if hidden_grad_c is not None:
            hidden_grad = scatter_rows(hidden_grad_c, perm, hidden.dtype, site=site and (*site, "scatter"))
        return hidden_grad, weight_grad

    def _gradients_from_buffer(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Backward of the buffer mode: ``dz`` formed in place from the forward's buffer, then
        the two GEMMs over the whole shard at once (K = V/tp for ``d_hidden``: no fp32
        read-modify-write per chunk). Three GEMMs per step instead of four."""
        from mcore_ppo.kernels import dz_from_buffer_kernel

        buffer: ProbabilityBuffer = saved.residual
        buf, tmax, block_n, perm, count = buffer.probs, buffer.tile_max, buffer.block_n, buffer.perm, buffer.count
        local_labels, lse, entropy = saved.local_labels, saved.lse, saved.entropy
        weight_grad = request.weight_grad
        hidden, weight = rowmajor(hidden), rowmajor(weight)
        n, v = hidden.shape[0], weight.shape[0]
        has_g, has_e, g, e = upstream_gradients(request.grad_log_prob, _entropy_grad(saved, request), lse)
        inv_temp, inv_temp_rows, row_temp = _inverse_temperature(temperature, lse)
        entropy = lse if entropy is None else entropy  # a pointer the kernel never reads (HAS_E off)
        cfg = self.buffer_dz_config
        n_tiles_v = tmax.shape[1]
        # The forward's plan (head_forward's buffers) fixes every argument's specialisation but
        # the upstream gradients' presence and the labels' dtype.
        plan = buffer.plan
        launch(
            dz_from_buffer_kernel,
            (cdiv(n, cfg.block_m) * n_tiles_v,),
            (buf, tmax, perm, count, local_labels, lse, entropy, g, e, n, v, n_tiles_v, inv_temp, inv_temp_rows),
            {
                "HAS_G": has_g, "HAS_E": has_e, "BLOCK_M": cfg.block_m, "BLOCK_N": block_n,
                "FAST_LOG2": cfg.fast_log2 and buf.dtype == torch.bfloat16, "num_warps": cfg.num_warps,
                **({"ROW_TEMP": True} if row_temp else {}),
            },
            None if plan is None else (plan, "dz_buffer", has_g, has_e, local_labels.dtype),
        )  # fmt: skip
        del tmax
        if request.sparse is not None:
            _add_onehot(buf, _merged_onehot(request.sparse, perm, count, temperature, lse), 0, v)
        hidden_grad = None
        if request.need_hidden_grad:
            hidden_grad_c = mm_fp32(buf, weight)
        if weight_grad is not None:
            x_c = gathered_rows(hidden, perm, count, site=None if plan is None else (plan, "gather_backward"))
            gemm_into(weight_grad, buf.t(), x_c, overwrite=request.weight_grad_unset)
            del x_c
        del buf
        if request.need_hidden_grad:
            hidden_grad = scatter_rows(
                hidden_grad_c, perm, hidden.dtype, site=None if plan is None else (plan, "scatter")
            )
        return hidden_grad, weight_grad


@dataclass(frozen=True)
class RowOrder:
    """The forward's compacted row order, kept for a backward that recomputes (no buffer), and
    its plan (the backward's launch sites key on it)."""

    perm: torch.Tensor
    count: torch.Tensor
    plan: _ForwardPlan | None = None


@dataclass(frozen=True, eq=False)
class _ForwardPlan:
    """What the forward decides from shapes, dtypes, strides, alignment and options alone.

    Hashed by identity: launches use the cached plan object itself as their site key."""

    n: int
    h: int
    v: int
    cfg: GemmConfig
    num_splits: int
    n_tiles_v: int
    n_parts: int
    store: bool
    use_tma: bool
    buf_tma: bool
    direct: bool
    stats_grid: tuple[int]
    stats_options: dict
    finish_options: dict  # by (labels_checked, grad_needed): the launch options of merge_finish_kernel
    combined_options: dict  # by labels_checked: those of finish_kernel

    @staticmethod
    def build(
        backend: TritonBackend,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        grad_needed: bool,
        with_entropy: bool,
        row_temp: bool,
    ) -> _ForwardPlan:
        n, h = hidden.shape
        v = weight.shape[0]
        cfg = for_dtype(backend.forward_config_for(v), hidden.dtype)
        num_splits = cdiv(v, cfg.tiles_per_split * cfg.block_n)
        n_tiles_v = cdiv(v, cfg.block_n)
        buffer_bytes = n * (v * hidden.element_size() + n_tiles_v * 4)
        store = grad_needed and buffer_bytes <= backend.buffer_budget_bytes
        log_buffer_decision(grad_needed, store, buffer_bytes, backend.buffer_budget_bytes)
        use_tma = operands_by_tma(hidden, weight, cfg)
        buf_tma = False
        if store:
            buf_tma, cfg = with_tma_store(backend.buffer_store_tma, hidden, cfg, row_elements=v)
        # Blocks of consecutive valid rows are read in place (a first launch), the others from
        # a gathered copy of only their rows (a second): no row copy when nothing is ignored.
        direct = use_tma and descriptor_ok(hidden)
        # The default variant is launched without the new flags: its compile is the same as before.
        variant = {**({"ROW_TEMP": True} if row_temp else {}), **({} if with_entropy else {"WITH_U": False})}
        stats_options = {
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "TILES_PER_SPLIT": cfg.tiles_per_split, "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "USE_TMA": use_tma, "STORE_P": store, "BUF_TMA": buf_tma,
            "DIRECT_ROWS": direct, **kernel_flags(hidden, cfg), **variant,
        }  # fmt: skip
        libdevice = not interpreting()
        finish_options = {
            (checked, grad_needed): {
                "BLOCK_T": MERGE_BLOCK_T, "BLOCK_S": MERGE_BLOCK_S, "WITH_U": with_entropy,
                "CHECK_RANGE": not checked, "LIBDEVICE": libdevice, "SAVE": grad_needed, **_exact_libdevice(),
            }
            for checked in (False, True)
        }  # fmt: skip
        combined_options = {
            checked: {"BLOCK_T": MERGE_BLOCK_T, "WITH_U": with_entropy, "CHECK_RANGE": not checked}
            for checked in (False, True)
        }
        return _ForwardPlan(
            n, h, v, cfg, num_splits, n_tiles_v, 3 if with_entropy else 2, store, use_tma, buf_tma, direct,
            (cdiv(n, cfg.block_m) * num_splits,), stats_options, finish_options, combined_options,
        )  # fmt: skip


@functools.cache
def _exact_libdevice() -> dict:
    """Launch options for the epilogue's ``logf`` / ``div_rn``: libdevice without flushing
    subnormals (Triton's default flushes them), as torch's CUDA kernels compute them; {} where
    this Triton has no such option (its default then) or runs the interpreter."""
    if interpreting():
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return {}
    return {"enable_reflect_ftz": False} if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__ else {}


def _inverse_temperature(temperature: float | torch.Tensor, placeholder: torch.Tensor):
    """``(inv_temp, inv_temp_rows, row_temp)`` for the kernels: a float gives the scalar ``1/T``
    (exactly as it always was) and ``placeholder`` as the never-read vector; a per-token tensor
    gives ``1/T_i`` as an fp32 vector, each the fp32 rounding of the exact ``1/T_i`` (formed in
    fp64, as the scalar is), and a scalar 1.0 the kernels do not read."""
    if not isinstance(temperature, torch.Tensor):
        return 1.0 / temperature, placeholder, False
    return 1.0, (1.0 / temperature.to(torch.float64)).to(torch.float32).contiguous(), True


def _merged_onehot(
    sparse: SparseGradient | None,
    perm: torch.Tensor,
    count: torch.Tensor,
    temperature: float | torch.Tensor,
    placeholder: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids, g)`` ``[n, k]`` of a sparse gradient in the backward's compacted row order, each
    id once per row (-1 elsewhere), ``g`` summed over a duplicate's slots and times ``1/T`` as
    ``dz_kernel`` scales its label term (:func:`_inverse_temperature`); None without one."""
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
    inv_temp, inv_temp_rows, row_temp = _inverse_temperature(temperature, placeholder)
    ids_out = torch.empty(n, k, dtype=torch.int64, device=ids.device)
    g_out = torch.empty(n, k, dtype=torch.float32, device=ids.device)
    if n and k:
        launch(
            onehot_merge_kernel,
            (n,),
            (ids.contiguous(), g.contiguous(), perm, count, ids_out, g_out, n, k, inv_temp, inv_temp_rows),
            {"BLOCK_K": _onehot_block(k), "ROW_TEMP": row_temp, "num_warps": 4},
        )
    return ids_out, g_out


def _add_onehot(dz: torch.Tensor, onehot: tuple[torch.Tensor, torch.Tensor], v0: int, vc: int) -> None:
    """``dz[r, id - v0] += g`` for the merged ids of :func:`_merged_onehot` in ``[v0, v0 + vc)``."""
    from mcore_ppo.kernels.gather import onehot_add_kernel

    ids, g = onehot
    n, k = ids.shape
    if not (n and k):
        return
    block_k = _onehot_block(k)
    block_r = max(1, ONEHOT_ADD_ELEMENTS // block_k)
    launch(
        onehot_add_kernel,
        (cdiv(n, block_r),),
        (dz, ids, g, n, k, v0, vc, dz.stride(0)),
        {"BLOCK_R": block_r, "BLOCK_K": block_k, "num_warps": 4},
    )


def _onehot_block(k: int) -> int:
    # At least 16 lanes (masked past k): no 1-wide blocks for k = 1.
    return min(ONEHOT_BLOCK_K, max(16, 1 << max(0, (k - 1).bit_length())))


def _entropy_grad(saved: SavedTokens, request: GradientRequest) -> torch.Tensor | None:
    """The entropy's upstream gradient, None when the forward computed no entropy."""
    return None if saved.entropy is None else request.grad_entropy
