"""Fused Triton backend: the head's statistics and gradients at the GEMM floor (docs/kernels.md).

Forward (:meth:`TritonBackend.shard_statistics`): ``stats_kernel`` folds the logit tiles
``x @ W.T / T`` (fp32 accumulation) into online softmax statistics in registers, one partial
per (vocab split, token); ``merge_splits_kernel`` merges the splits per token. When a gradient
will be needed and it fits the budget (:attr:`TritonConfig.buffer_budget_bytes`), the forward
also stores ``2^(z₂ − tile max)`` and the tile maxima as its residual (:data:`BUFFER_RESIDUAL`)
for a three-GEMM backward (:mod:`mcore_ppo.backends.triton_gradients`).

A per-token temperature (``[n]`` tensor) reaches every kernel as a ``1/T`` vector read per row
(their ``ROW_TEMP`` flag); a float reaches them as the scalar ``1/T``. Without the entropy
the forward kernels skip its sums and the backward's entropy term is off (``HAS_E``). What the
forward reduces is the call's :class:`~mcore_ppo.statistics.Statistics`: each term's plane is a
constexpr of the kernels (:meth:`Statistics.kernel_options
<mcore_ppo.statistics.Statistics.kernel_options>`, 0 for a term not asked for, whose code is
compiled out). ``k`` ids per token: :mod:`mcore_ppo.backends.triton_ids`.

Ignored tokens are compacted on the device (:func:`compact_rows`): programs past the valid count
exit before any GEMM work, and nothing syncs the host.

Host work per call (``scripts/host_work.py``): the head's op runs the whole single-label
forward through :meth:`TritonBackend.head_forward` (:mod:`mcore_ppo.backends.triton_forward`),
which prepares the labels
(``tokens_kernel``: valid flags, local labels, row order, zeroed label logits) and finishes the
outputs (``merge_finish_kernel``: ``lse``, entropy, log-prob, clamps and masks) in kernels, so
the forward issues only allocations and launches; what depends on shapes alone is decided once
per shape (:class:`~mcore_ppo.backends.triton_plan.LaunchPlan`, cached on the backend), and its
launches are keyed by the plan through the backend's :class:`~mcore_ppo.backends.triton_launch.Launcher`.

Nothing is kept on the backend between calls but those plans and the launcher's kept compiled
kernels; its settings are its :class:`~mcore_ppo.backends.triton_config.TritonConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from mcore_ppo.backends import registry
from mcore_ppo.backends.base import Capabilities, GradientRequest, HeadForward, SavedTokens, ShardStatistics
from mcore_ppo.backends.torch_backend import TorchBackend, TorchConfig
from mcore_ppo.backends.triton_config import FP32_TILES, IEEE_BLOCKS, TritonConfig
from mcore_ppo.backends.triton_forward import fused_head_forward, statistics_launch
from mcore_ppo.backends.triton_gradients import gradients_by_recompute, gradients_from_buffer, vocab_chunk
from mcore_ppo.backends.triton_host import GemmConfig, compact_rows, merge_splits, operand_parts
from mcore_ppo.backends.triton_ids import gather_logits
from mcore_ppo.backends.triton_launch import Launcher, interpreting
from mcore_ppo.backends.triton_plan import LaunchPlan, buffer_decision
from mcore_ppo.logs import log_once
from mcore_ppo.numerics import Numerics, cdiv, rowmajor
from mcore_ppo.statistics import Statistics

try:  # the package itself is optional; anything else broken in it should raise
    import triton
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = None

__all__ = ["TritonBackend", "TritonConfig", "is_available"]


def _takes_reference(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp64 (gradcheck), empty problems and meta tensors (shape inference) run on the torch reference."""
    return hidden.dtype == torch.float64 or hidden.numel() == 0 or weight.shape[0] == 0 or hidden.is_meta


def is_available() -> bool:
    """Triton is importable and can run here (a CUDA device, or the interpreter)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


# What the residual holds, in order: in buffer mode the probability buffer ``2^(z₂ − tile max)``
# ([n, v], input dtype, rows in compacted order), the tile maxima ([n, v tiles], fp32), the row order
# and the valid count; a forward that recomputes in its backward keeps the row order and count alone.
BUFFER_RESIDUAL = ("probs", "tile_max", "perm", "count")
ROW_ORDER_RESIDUAL = ("perm", "count")


class TritonBackend:
    """Fused Triton kernels behind the :class:`~mcore_ppo.backends.base.Backend` protocol.

    Capabilities: the whole single-label forward in its kernels (``fused_forward``, unless the
    config turns it off); a ``d_W`` buffer in the weight's own dtype, unfilled (every row of
    ``d_W`` comes out of one fp32-accumulated GEMM over all tokens, so rounding it once into
    bf16 is what an fp32 buffer cast at the end would give, for half the memory and no cast,
    and each row is written, not added to).
    """

    name = "triton"

    def __init__(self, config: TritonConfig | None = None, *, launcher: Launcher | None = None):
        """``config``: the backend's settings for its whole life (None: the defaults).
        ``launcher``: the :class:`~mcore_ppo.backends.triton_launch.Launcher` of its kernel
        launches (None: one with the config's ``kept_kernels``; tests pass one that checks its
        launch sites)."""
        if config is not None and not isinstance(config, TritonConfig):
            raise TypeError(f"config must be a TritonConfig or None, got {type(config).__name__}")
        if launcher is not None and not isinstance(launcher, Launcher):
            raise TypeError(f"launcher must be a Launcher or None, got {type(launcher).__name__}")
        self.config = config or TritonConfig()
        self.launcher = launcher if launcher is not None else Launcher(kept=self.config.kept_kernels)
        self.forward_config, self.tiles_by_shard = self.config.resolved_forward()
        self.backward_config, self.backward_by_dtype = self.config.resolved_backward()
        self.capabilities = Capabilities(
            fused_forward=self.config.fused_forward, weight_grad_in_weight_dtype=True, writes_weight_grad=True
        )
        self._reference = TorchBackend()
        tokens, vocab = IEEE_BLOCKS
        self._cublas_ieee = TorchBackend(TorchConfig(token_chunk=tokens, vocab_chunk=vocab, precision="ieee"))
        self._plans: dict[tuple, LaunchPlan] = {}
        self.op_key = registry.register(self)  # the key the head's ops name it by

    def unsupported(self, hidden: torch.Tensor) -> str | None:
        """Why these inputs cannot run here (CPU tensors without ``TRITON_INTERPRET=1``), or None."""
        if hidden.device.type not in ("cuda", "meta") and not interpreting():
            return (
                f"the triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {hidden.device} tensors; "
                "use backend='torch' or 'auto' for them"
            )
        return None

    def _ieee_by_cublas(self, hidden: torch.Tensor) -> bool:
        """fp32 CUDA operands under IEEE dots go to cuBLAS (:attr:`TritonConfig.ieee_gemms`):
        where cuBLAS's fp32 GEMMs are IEEE, they are the fastest IEEE dots there are."""
        return (
            hidden.dtype == torch.float32
            and hidden.is_cuda
            and self.config.ieee_gemms == "cublas"
            and Numerics.of(torch.float32, self.config.precision).dot == "ieee"
            and not torch.backends.cuda.matmul.allow_tf32
        )

    def _delegate(self, hidden: torch.Tensor, weight: torch.Tensor) -> TorchBackend | None:
        """The torch backend these inputs run on instead of the kernels: the chunked reference
        for fp64 (gradcheck), empty problems and meta tensors (shape inference), the cuBLAS route
        for IEEE fp32 dots (:meth:`_ieee_by_cublas`); None for the kernels' own."""
        if _takes_reference(hidden, weight):
            return self._reference
        return self._cublas_ieee if self._ieee_by_cublas(hidden) else None

    def _fallback(self, hidden: torch.Tensor, weight: torch.Tensor) -> TorchBackend | None:
        """:meth:`_delegate`, once the inputs are known to run here (ValueError otherwise)."""
        reason = self.unsupported(hidden)
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run these inputs: {reason}")
        if hidden.dtype == torch.float64:
            log_once(logging.INFO, ("triton-fallback", "fp64"), "mcore_ppo: triton backend -> torch reference: fp64")
        return self._delegate(hidden, weight)

    def fused_forward_for(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """The one-label forward runs in :meth:`head_forward` (unless ``fused_forward=False``)
        for every input but those a torch backend takes (:meth:`_delegate`)."""
        return self.config.fused_forward and self._delegate(hidden, weight) is None

    def residual_spec(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        *,
        fused: bool,
        grad_needed: bool,
        statistics: Statistics,
        row_temperature: bool,
    ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The residual's ``(shape, dtype)`` by :data:`BUFFER_RESIDUAL` when the buffer fits the
        budget, else :data:`ROW_ORDER_RESIDUAL` for :meth:`head_forward` and nothing for
        :meth:`shard_statistics`; nothing without a backward or for a torch backend's inputs."""
        if not grad_needed or self._delegate(hidden, weight) is not None:
            return ()
        n, v = hidden.shape[0], weight.shape[0]
        store, n_tiles_v = buffer_decision(self.config, self.forward_config_for(v, hidden.dtype), n, v, hidden.dtype)
        order = (((n,), torch.int32), ((1,), torch.int32))
        if store and not self._parts(hidden):
            return (((n, v), hidden.dtype), ((n, n_tiles_v), torch.float32), *order)
        return order if fused else ()

    def shard_statistics(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: float | torch.Tensor,
        *,
        grad_needed: bool,
        statistics: Statistics,
    ) -> ShardStatistics:
        """fp32 statistics over this shard (its max, the terms of ``statistics``, the label
        logit), and with ``grad_needed`` and a budget that fits, the probability buffer as
        residual (:data:`BUFFER_RESIDUAL`); see the Backend protocol."""
        delegate = self._fallback(hidden, weight)
        if delegate is not None:
            return delegate.shard_statistics(
                hidden, weight, local_labels, valid, temperature, grad_needed=False, statistics=statistics
            )
        launch = self.launcher.bound()
        hidden, weight, unscale = self._operands(hidden, weight, launch)
        row_temp = isinstance(temperature, torch.Tensor)
        plan = self._forward_plan(hidden, weight, grad_needed, statistics, row_temp, unscale is not None)
        perm, count = compact_rows(valid, launch)
        y = torch.zeros(plan.n, dtype=torch.float32, device=hidden.device)
        # The plan, the caller's labels' dtype and the fresh tensors here fix every launch's
        # specialisation (the kernels do not specialise on the per-token vectors' alignment).
        site = (plan, "shard_statistics", local_labels.dtype)
        parts, residual = statistics_launch(
            plan, launch, hidden, weight, local_labels, perm, count, y, temperature, unscale=unscale, site=site
        )
        merged = merge_splits(parts, perm, count, launch, options=plan.merge_options, site=(*site, "merge"))
        return ShardStatistics(merged[0], merged[1:], y, residual)

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
        labels_in_range: bool,
        grad_needed: bool,
        statistics: Statistics,
        max_entropy: float,
        combine: Callable | None,
    ) -> HeadForward | None:
        """The whole forward of the head on this shard in three or four launches, six over TP
        (see :class:`~mcore_ppo.backends.base.Backend`): the per-token preparation from the
        global labels (``tokens_kernel``), the copy of the rows the forward kernel cannot read in
        place (TMA operands only), the statistics, and, on one shard, the merge with
        the outputs' epilogue in one kernel (``merge_finish_kernel``). Over TP, around the
        caller's ``combine`` (:func:`~mcore_ppo.parallel.combine.reduce_shard_statistics`), the
        shard's max (``split_max_kernel``) before its all-reduce MAX, the splits merged to the
        group's max and packed for its all-reduce SUM (``merge_to_max_kernel``), and the epilogue
        from the sums (``finish_kernel``): no torch op between the launches. None (the caller runs
        the generic path) where :meth:`shard_statistics` would fall back to the reference. The
        same launches carry every term of ``statistics`` (their planes are kernel constexprs)."""
        if self._fallback(hidden, weight) is not None:
            return None

        launch = self.launcher.bound()
        hidden, weight, unscale = self._operands(hidden, weight, launch)
        row_temp = isinstance(temperature, torch.Tensor)
        plan = self._forward_plan(hidden, weight, grad_needed, statistics, row_temp, unscale is not None)
        return fused_head_forward(
            plan, launch, hidden, weight, labels, temperature, ignore_index=ignore_index, vocab_start=vocab_start,
            vocab_size=vocab_size, labels_in_range=labels_in_range, grad_needed=grad_needed,
            max_entropy=max_entropy, combine=combine, unscale=unscale,
        )  # fmt: skip

    def _forward_plan(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        grad_needed: bool,
        statistics: Statistics,
        row_temp: bool,
        parts: bool = False,
    ) -> LaunchPlan:
        """The forward's per-shape decisions, made once per key (shapes, dtype, strides, 16-byte
        alignment of the operands, device, gradient and options). ``hidden`` and ``weight``: the
        kernels' operands, with ``parts`` fp32 inputs' fp16 parts (:meth:`_operands`)."""
        key = (
            tuple(hidden.shape), weight.shape[0], hidden.dtype, hidden.stride(0), weight.stride(0),
            hidden.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0, hidden.device, grad_needed,
            statistics, row_temp, parts,
        )  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.config.plan_cache_size:
                self._plans.clear()
            dtype = torch.float32 if parts else hidden.dtype  # the inputs' (their tiles)
            plan = self._plans[key] = LaunchPlan.build(
                self.config, self.forward_config_for(weight.shape[0], dtype), hidden, weight, grad_needed,
                statistics, row_temp, parts,
            )  # fmt: skip
        return plan

    def _parts(self, hidden: torch.Tensor) -> bool:
        """fp32 inputs under ``precision="fp32_faithful"``: the GEMM kernels read their fp16 parts."""
        return Numerics.of(hidden.dtype, self.config.precision).parts

    def _operands(
        self, hidden: torch.Tensor, weight: torch.Tensor, launch: Callable
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(hidden, weight, unscale)``: the forward kernels' operands, row-major; for
        :meth:`_parts` inputs their fp16 parts ``[rows, 3h]`` and the rows' scale-backs
        (:func:`~mcore_ppo.backends.triton_host.operand_parts`), else None."""
        hidden, weight = rowmajor(hidden), rowmajor(weight)
        if not self._parts(hidden):
            return hidden, weight, None
        return operand_parts(hidden, weight, launch)

    def forward_config_for(self, v: int, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
        """The forward's tile config for a shard of ``v`` vocab rows of operands of ``dtype``
        (one per shard size, so one compile per model): the default's tiles (fp32 operands':
        their dot's, :data:`FP32_TILES`), its ``tiles_per_split`` by the config's rule."""
        cfg = self.forward_config
        if not self.tiles_by_shard:
            return cfg
        cfg = self._fp32_tiles(dtype, 0) or cfg
        for tiles in self.config.forward_tiles_per_split:
            if cdiv(v, tiles * cfg.block_n) >= self.config.min_forward_splits:
                return replace(cfg, tiles_per_split=tiles)
        return replace(cfg, tiles_per_split=self.config.forward_tiles_per_split[-1])

    def backward_config_for(self, dtype: torch.dtype) -> GemmConfig:
        """The backward's tile config for operands of ``dtype``: the config's, or for fp32
        operands under the GPU default their dot's (:data:`FP32_TILES`)."""
        return (self.backward_by_dtype and self._fp32_tiles(dtype, 1)) or self.backward_config

    def _fp32_tiles(self, dtype: torch.dtype, index: int) -> GemmConfig | None:
        """:data:`FP32_TILES`' forward (``index`` 0) or backward (1) config for operands of
        ``dtype`` under this backend's precision; None for 16-bit operands."""
        tiles = FP32_TILES.get(Numerics.of(dtype, self.config.precision).dot)
        return None if tiles is None else tiles[index]

    def vocab_chunk(self, n: int, v: int, itemsize: int) -> int:
        """Columns per backward chunk: the ``dz`` workspace stays within ``workspace_bytes``."""
        return vocab_chunk(self.config, self.backward_config, n, v, itemsize)

    def gather_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, local_ids: torch.Tensor, temperature: float | torch.Tensor
    ) -> torch.Tensor:
        """The logits at ``k`` local ids per token (``gather_dot_kernel``; the reference's for
        fp64 and empty inputs); see the Backend protocol."""
        delegate = self._fallback(hidden, weight)
        if delegate is not None:
            return delegate.gather_logits(hidden, weight, local_ids, temperature)
        return gather_logits(self.config, self.launcher.bound(), hidden, weight, local_ids, temperature)

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
        ``dz`` before the GEMMs (:mod:`mcore_ppo.backends.triton_ids`)."""
        delegate = self._fallback(hidden, weight)
        if delegate is not None:
            if request.weight_grad_unset:  # the torch backend adds into d_W
                request.weight_grad.zero_()
            return delegate.shard_gradients(hidden, weight, saved, request, temperature=temperature)
        hidden, weight = rowmajor(hidden), rowmajor(weight)
        buffered = len(saved.residual) == len(BUFFER_RESIDUAL)
        plan = None
        # (fp32 inputs' parts: the forward's plan was keyed by the parts; Triton's own dispatch.)
        if not self._parts(hidden):
            # The forward's plan (cached under the same key when its statistics were the
            # entropy's alone; the backward reads only shapes and tiles from it): its tiles are
            # the buffer's, and with the per-token tensors' dtypes (fresh allocations of its n,
            # whose alignment the kernels do not specialise on) it keys the launches.
            statistics = Statistics.from_key("entropy" if saved.entropy is not None else "")
            plan = self._forward_plan(hidden, weight, True, statistics, isinstance(temperature, torch.Tensor))
        launch = self.launcher.bound()
        if buffered:
            return gradients_from_buffer(
                self.config, launch, plan, hidden, weight, saved, request, temperature=temperature
            )
        backward_config = self.backward_config_for(hidden.dtype)
        return gradients_by_recompute(
            self.config, backward_config, launch, plan, hidden, weight, saved, request, temperature=temperature
        )
