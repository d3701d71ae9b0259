"""Fused Triton backend: the head's statistics and gradients at the GEMM floor.

Forward (:meth:`TritonBackend.shard_statistics`): ``stats_kernel`` computes the logit tiles
``x @ W.T / T`` with fp32 accumulation and folds them into online softmax statistics in
registers (logits never reach memory), one partial per (vocab split, token);
``merge_splits_kernel`` merges the splits per token. Two launches plus a few tiny torch ops.

Backward (:meth:`TritonBackend.shard_gradients`): per vocab chunk of ``chunk`` columns,
``dz_kernel`` recomputes the logits and writes ``dz / T`` (input dtype) into a workspace of
``n × chunk`` elements, rows in compacted order (valid first); cuBLAS then does
``d_hidden_c += dz @ W_chunk`` (fp32 output, accumulated across chunks) and
``d_W_chunk (+)= dzᵀ @ x_c`` (each row of ``d_W`` is produced by one GEMM over all tokens with
fp32 accumulation, so writing it in the weight's dtype rounds once). ``x_c`` holds the valid
rows first and zeros after them, so nothing in an ignored row (inf padding) reaches ``d_W``;
the rows of ``d_hidden`` are put back in place once at the end.

Budgeted buffer (issue 6): when a gradient will be needed and ``n × V`` values fit in
``buffer_budget_bytes``, the forward also stores ``2^(z₂ − tile max)`` (input dtype) and the
tile maxima; the backward turns that buffer into ``dz`` in place (``dz_from_buffer_kernel``)
and runs the two GEMMs once over the whole shard: three GEMMs per step instead of four.

Ignored tokens: ``valid`` is compacted on the device (a cumulative sum gives every row its
place, valid rows first) into ``perm`` and a device-side ``count``; the kernels are launched
for every row and programs past ``count`` exit before any GEMM work. Nothing syncs the host.

No-grad forward: nothing here is kept between calls; the workspaces are freed on return.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from mcore_ppo.backends.torch_backend import TorchBackend

try:  # the package itself is optional; anything else broken in it should raise
    import triton
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available() -> bool:
    """Triton is importable and can run here (a CUDA device, or the interpreter)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one fused GEMM kernel."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 16
    num_warps: int = 8
    num_stages: int = 3
    tiles_per_split: int = 4  # forward only: vocab tiles folded per program before a partial is written
    use_tma: bool = False  # operands through the copy engine (host descriptors; rows gathered first)


# Chosen by measurement on one H200 (docs/kernels.md): TMA operands won 27.4 vs 31.1 ms in the
# forward and 112.3 vs 114.3 ms forward+backward at qwen7b tp1; 3 stages with 2 tiles per split
# beat 4 stages with 4 tiles by 0.2-2.5 % over V/tp = 19008 ... 152064 (profile_head --sweep-forward).
FORWARD_CONFIG = GemmConfig(num_stages=3, tiles_per_split=2, use_tma=True)
BACKWARD_CONFIG = GemmConfig(tiles_per_split=1, use_tma=True)
INTERPRETER_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1)
COMPACT_BLOCK = 1024
# Upper bound on the bf16 ``dz`` workspace of the backward (one vocab chunk × all tokens).
WORKSPACE_BYTES = 240 * 2**20
# Budgeted probability buffer (issue 6): when ``n × V/tp`` values (input dtype) + fp32 tile
# maxima fit in this many bytes and a gradient will be needed, the forward keeps
# ``2^(z₂ − tile max)`` and the backward skips the recompute GEMM: forward+backward 0.83-0.86×
# the four-GEMM floor against 1.06-1.10× for the recompute (H200, docs/kernels.md). The default
# buys that where it costs at most 1 GiB (e.g. 16384 tokens × V/tp ≤ 32k in bf16: TP 8 for a
# 152k vocab); larger shards recompute unless the caller raises it (``buffer_budget_bytes``,
# or the environment variable MCORE_PPO_BUFFER_BUDGET_BYTES). 0 = always recompute.
BUFFER_BUDGET_BYTES = 1 << 30
# Copy-engine (TMA) stores of the forward's buffer tiles and the backward's dz tiles: both are
# written in compacted row order, so a program's tile is one contiguous block.
BUFFER_STORE_TMA = True
DZ_STORE_TMA = True


@dataclass(frozen=True)
class ElementwiseConfig:
    """Tiling of ``dz_from_buffer_kernel`` (rows per program; the columns are one forward tile)."""

    block_m: int = 8
    num_warps: int = 4
    fast_log2: bool = True  # bf16 buffers: log2 from the bits (see kernels.backward._log2_bf16)


BUFFER_DZ_CONFIG = ElementwiseConfig()
MERGE_BLOCK_T = 64
ROW_BLOCK = 1024  # columns per step of the row gather / scatter kernels
MERGE_BLOCK_S = 32


def compact_rows(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, count)``: row indices with valid rows first (in order), and their number.

    Both stay on the device: one single-program Triton launch (``compact_kernel``) instead of
    the five torch ops of a cumulative-sum formulation; ``nonzero`` would sync the host.
    ``perm`` is int32 ``[n]``; ``count`` is an int32 ``[1]`` tensor.
    """
    from mcore_ppo.kernels import compact_kernel

    n = valid.shape[0]
    perm = torch.empty(n, dtype=torch.int32, device=valid.device)
    count = torch.empty(1, dtype=torch.int32, device=valid.device)
    compact_kernel[(1,)](valid.contiguous().view(torch.uint8), perm, count, n, BLOCK=COMPACT_BLOCK)
    return perm, count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _for_dtype(config: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """fp32 operands take twice the shared memory per stage: halve the K tile for them."""
    if dtype == torch.float32 and config.block_k > 16:
        return replace(config, block_k=config.block_k // 2)
    return config


def _flags(hidden: torch.Tensor, config: GemmConfig) -> dict[str, bool]:
    return {
        "EVEN_K": hidden.shape[1] % config.block_k == 0,
        "UPCAST": interpreting() and hidden.dtype != torch.float32,
        "DOT_IEEE": hidden.dtype == torch.float32,
    }


#: Which path :func:`_addmm_fp32` took, per output (recorded by the benchmark).
ADDMM_PATH: dict[str, str] = {}


def _tma_capable(tensor: torch.Tensor) -> bool:
    """The copy engine is there: Hopper or newer, or the interpreter (which emulates it)."""
    return interpreting() or (tensor.is_cuda and torch.cuda.get_device_capability(tensor.device)[0] >= 9)


def _tma_store_fits(tensor: torch.Tensor, config: GemmConfig) -> bool:
    """A ``BLOCK_M × BLOCK_N`` staging tile for a TMA store fits beside 3 operand stages.

    Datacenter Hopper/Blackwell have 227 KiB of shared memory per block (3 × 48 KiB + 64 KiB
    at the default tiles); parts with ~100 KiB (sm_120) store through pointers instead.
    """
    if interpreting():
        return True
    stage = (config.block_m + config.block_n) * config.block_k * tensor.element_size()
    staging = config.block_m * config.block_n * tensor.element_size()
    props = torch.cuda.get_device_properties(tensor.device)
    # Older torch lacks the field: Hopper and datacenter Blackwell (sm_90/sm_100) have 227 KiB.
    available = getattr(props, "shared_memory_per_block_optin", 227 * 1024 if props.major in (9, 10) else 99 * 1024)
    return 3 * stage + staging <= available


def _with_tma_store(enabled: bool, tensor: torch.Tensor, config: GemmConfig) -> tuple[bool, GemmConfig]:
    """Whether ``[BLOCK_M, BLOCK_N]`` tiles of ``tensor`` are stored by the copy engine, and the
    kernel config to use: with the 64 KiB staging tile the operand pipeline keeps 3 stages (a
    fourth overflows shared memory). Only 16-bit tiles, on rows the engine can address, where
    the staging tile fits (:func:`_tma_store_fits`)."""
    ok = (
        enabled
        and tensor.element_size() == 2
        and _tma_capable(tensor)
        and _descriptor_ok(tensor)
        and _tma_store_fits(tensor, config)
    )
    return ok, (replace(config, num_stages=min(config.num_stages, 3)) if ok else config)


def _upstream_gradients(grad_log_prob, grad_entropy, placeholder: torch.Tensor):
    """``(has_g, has_e, g, e)``: the per-token upstream gradients as contiguous fp32 vectors for
    the kernels; an absent one is replaced by ``placeholder`` (a pointer the kernel never reads)."""
    has_g, has_e = grad_log_prob is not None, grad_entropy is not None
    g = grad_log_prob.float().contiguous() if has_g else placeholder
    e = grad_entropy.float().contiguous() if has_e else placeholder
    return has_g, has_e, g, e


def _descriptor_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor the copy engine can address: unit last stride, 16-byte aligned rows."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _use_tma(hidden: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> bool:
    """Operands through the copy engine (host descriptors over gathered rows)?"""
    aligned = (hidden.shape[1] * hidden.element_size()) % 16 == 0 and _descriptor_ok(weight)
    return config.use_tma and aligned and _tma_capable(hidden)


def _gathered_rows(hidden: torch.Tensor, perm: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``hidden[perm]`` with the rows past the device-side ``count`` zeroed: valid rows first.

    Contiguous ``n × h`` in the input dtype, one launch (``gather_rows_kernel``). The zeros are
    stored, not multiplied in, so an inf in an ignored row (padding) never reaches a GEMM that
    runs over every row (``d_W``) as 0·inf = NaN.
    """
    from mcore_ppo.kernels import gather_rows_kernel

    n, h = hidden.shape
    rows = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device)
    if n:
        gather_rows_kernel[(n,)](hidden, perm, count, rows, h, hidden.stride(0), BLOCK_H=ROW_BLOCK)
    return rows


def _scatter_rows(compacted: torch.Tensor, perm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of fp32 ``compacted`` (in ``perm`` order) back to their places, cast to ``dtype``
    in the same pass (the one rounding of ``d_hidden``)."""
    from mcore_ppo.kernels import scatter_rows_kernel

    n, h = compacted.shape
    out = torch.empty(n, h, dtype=dtype, device=compacted.device)
    if n:
        scatter_rows_kernel[(n,)](compacted, perm, out, h, BLOCK_H=ROW_BLOCK)
    return out


def _addmm_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """``out += a @ b`` with fp32 ``out`` and low-precision ``a``, ``b``.

    cuBLAS does it in one GEMM with fp32 output and ``beta = 1`` (``addmm(..., out_dtype=
    float32)``, torch ≥ 2.8 on CUDA), so partial sums are never rounded to bf16; older torch
    gets an fp32-output product added separately, or at worst a bf16 product.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        ADDMM_PATH[what] = "addmm_ same dtype"
        return
    if not a.is_cuda:
        out.add_(torch.mm(a.float(), b.float()))
        ADDMM_PATH[what] = "fp32 upcast (CPU)"
        return
    try:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        ADDMM_PATH[what] = "addmm out_dtype=fp32, beta=1"
        return
    except (RuntimeError, TypeError):  # older torch: no out_dtype overload
        pass
    try:
        out.add_(torch.mm(a, b, out_dtype=torch.float32))
        ADDMM_PATH[what] = "mm out_dtype=fp32 + add"
    except (RuntimeError, TypeError):
        out.add_(torch.mm(a, b))
        ADDMM_PATH[what] = "bf16 mm + add"


class TritonBackend:
    """Fused Triton kernels behind the :class:`~mcore_ppo.backends.base.Backend` protocol.

    ``weight_grad_in_weight_dtype``: when Megatron's ``main_grad`` is not used, the Function
    may hand this backend a zero ``d_W`` buffer in the weight's own dtype: every row of ``d_W``
    comes out of one fp32-accumulated GEMM over all tokens, so rounding it once into bf16 is
    what an fp32 buffer cast at the end would give, for half the memory and no cast.
    """

    name = "triton"
    weight_grad_in_weight_dtype = True
    # Set by the API before the forward: False under no_grad or without differentiable
    # inputs, so the forward never keeps the probability buffer when nothing will use it.
    grad_needed = True

    def __init__(
        self,
        forward_config: GemmConfig | None = None,
        backward_config: GemmConfig | None = None,
        workspace_bytes: int | None = None,
        buffer_budget_bytes: int | None = None,
    ):
        small = INTERPRETER_CONFIG if interpreting() else None
        self.forward_config = forward_config or small or FORWARD_CONFIG
        self.backward_config = backward_config or (small and replace(small, tiles_per_split=1)) or BACKWARD_CONFIG
        self.workspace_bytes = workspace_bytes or WORKSPACE_BYTES
        if buffer_budget_bytes is None:
            env = os.environ.get("MCORE_PPO_BUFFER_BUDGET_BYTES")
            buffer_budget_bytes = int(env) if env else BUFFER_BUDGET_BYTES
        self.buffer_budget_bytes = buffer_budget_bytes
        # (buffer, tile maxima, tile width, perm, valid count) from the forward, for the backward.
        self._buffer: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None
        self._reference = TorchBackend()

    def _fallback(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        # fp64 (gradcheck) and empty problems go to the chunked reference.
        return hidden.dtype == torch.float64 or hidden.shape[0] == 0 or weight.shape[0] == 0

    def shard_statistics(self, hidden, weight, local_labels, valid, temperature):
        """fp32 ``(m, s, u, y)`` over this shard; see the Backend protocol."""
        if self._fallback(hidden, weight):
            return self._reference.shard_statistics(hidden, weight, local_labels, valid, temperature)
        from mcore_ppo.kernels import merge_splits_kernel, stats_kernel

        hidden, weight = _rowmajor(hidden), _rowmajor(weight)
        cfg = _for_dtype(self.forward_config, hidden.dtype)
        n, h = hidden.shape
        v = weight.shape[0]
        perm, count = compact_rows(valid)
        num_splits = _cdiv(v, cfg.tiles_per_split * cfg.block_n)
        parts = torch.empty(3, num_splits, n, dtype=torch.float32, device=hidden.device)
        y = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        n_tiles_v = _cdiv(v, cfg.block_n)
        store = self.grad_needed and n * (v * hidden.element_size() + n_tiles_v * 4) <= self.buffer_budget_bytes
        self._buffer = None
        use_tma = _use_tma(hidden, weight, cfg)
        x_rows = _gathered_rows(hidden, perm, count) if use_tma else hidden
        x_desc = _descriptor(x_rows, [cfg.block_m, cfg.block_k]) if use_tma else x_rows
        w_desc = _descriptor(weight, [cfg.block_n, cfg.block_k]) if use_tma else weight
        buf_tma = False
        if store:
            buf = torch.empty(n, v, dtype=hidden.dtype, device=hidden.device)
            tmax = torch.empty(n, n_tiles_v, dtype=torch.float32, device=hidden.device)
            buf_tma, cfg = _with_tma_store(BUFFER_STORE_TMA, buf, cfg)
        else:
            buf = tmax = y  # unused (STORE_P off)
        buf_desc = _descriptor(buf, [cfg.block_m, cfg.block_n]) if buf_tma else buf
        stats_kernel[(_cdiv(n, cfg.block_m) * num_splits,)](
            x_rows,
            weight,
            x_desc,
            w_desc,
            perm,
            count,
            local_labels,
            parts[0],
            parts[1],
            parts[2],
            y,
            buf,
            buf_desc,
            tmax,
            n,
            v,
            h,
            hidden.stride(0),
            weight.stride(0),
            num_splits,
            1.0 / temperature,
            n_tiles_v,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            TILES_PER_SPLIT=cfg.tiles_per_split,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            USE_TMA=use_tma,
            STORE_P=store,
            BUF_TMA=buf_tma,
            **_flags(hidden, cfg),
        )
        del x_rows, x_desc  # the descriptor holds the gathered rows too
        if store:
            self._buffer = (buf, tmax, cfg.block_n, perm, count)
        stats = torch.empty(3, n, dtype=torch.float32, device=hidden.device)
        merge_splits_kernel[(_cdiv(n, MERGE_BLOCK_T),)](
            parts[0],
            parts[1],
            parts[2],
            perm,
            count,
            stats[0],
            stats[1],
            stats[2],
            n,
            num_splits,
            BLOCK_T=MERGE_BLOCK_T,
            BLOCK_S=MERGE_BLOCK_S,
        )
        return stats[0], stats[1], stats[2], y

    def vocab_chunk(self, n: int, v: int, itemsize: int) -> int:
        """Columns per backward chunk: the ``dz`` workspace stays within ``workspace_bytes``."""
        bn = self.backward_config.block_n
        cols = max(bn, (self.workspace_bytes // max(1, n * itemsize)) // bn * bn)
        return min(cols, v)

    def shard_gradients(
        self,
        hidden,
        weight,
        local_labels,
        valid,
        temperature,
        lse,
        entropy,
        grad_log_prob,
        grad_entropy,
        need_hidden_grad,
        weight_grad,
    ):
        """This shard's ``(d_hidden, d_weight)`` (``d_hidden`` in the input dtype, rounded once
        from fp32 accumulation); see the Backend protocol."""
        args = (hidden, weight, local_labels, valid, temperature, lse, entropy)
        args += (grad_log_prob, grad_entropy, need_hidden_grad, weight_grad)
        if self._fallback(hidden, weight):
            return self._reference.shard_gradients(*args)
        if self._buffer is not None and self._buffer[0].shape == (hidden.shape[0], weight.shape[0]):
            return self._gradients_from_buffer(*args)
        from mcore_ppo.kernels import dz_kernel

        hidden, weight = _rowmajor(hidden), _rowmajor(weight)
        cfg = _for_dtype(self.backward_config, hidden.dtype)
        n, h = hidden.shape
        v = weight.shape[0]
        device = hidden.device
        perm, count = compact_rows(valid)
        has_g, has_e, g, e = _upstream_gradients(grad_log_prob, grad_entropy, lse)
        # Compacted order throughout: dz rows, d_hidden rows, and x_c for d_W (ignored rows zero).
        use_tma = _use_tma(hidden, weight, cfg)
        x_c = _gathered_rows(hidden, perm, count) if use_tma or weight_grad is not None else None
        hidden_grad_c = torch.zeros(n, h, dtype=torch.float32, device=device) if need_hidden_grad else None
        chunk = self.vocab_chunk(n, v, hidden.element_size())
        workspace = torch.empty(n, chunk, dtype=hidden.dtype, device=device)
        flags = _flags(hidden, cfg)
        x_desc = _descriptor(x_c, [cfg.block_m, cfg.block_k]) if use_tma else hidden
        w_desc = _descriptor(weight, [cfg.block_n, cfg.block_k]) if use_tma else weight
        dz_tma, cfg = _with_tma_store(DZ_STORE_TMA, workspace, cfg)
        for v0 in range(0, v, chunk):
            vc = min(chunk, v - v0)
            dz = workspace[:, :vc]
            dz_desc = _descriptor(dz, [cfg.block_m, cfg.block_n]) if dz_tma else dz
            dz_kernel[(_cdiv(n, cfg.block_m) * _cdiv(vc, cfg.block_n),)](
                x_c if use_tma else hidden,
                weight,
                x_desc,
                w_desc,
                perm,
                count,
                local_labels,
                lse,
                entropy,
                g,
                e,
                dz,
                dz_desc,
                n,
                vc,
                v0,
                h,
                hidden.stride(0),
                weight.stride(0),
                workspace.stride(0),
                1.0 / temperature,
                HAS_G=has_g,
                HAS_E=has_e,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                USE_TMA=use_tma,
                DZ_TMA=dz_tma,
                **flags,
            )
            if hidden_grad_c is not None:
                _addmm_fp32(hidden_grad_c, dz, weight[v0 : v0 + vc], "d_hidden")
            if weight_grad is not None:
                _addmm_fp32(weight_grad[v0 : v0 + vc], dz.t(), x_c, "d_weight")
        del workspace, x_c, dz, dz_desc, x_desc  # before the rows of d_hidden get a second buffer
        hidden_grad = _scatter_rows(hidden_grad_c, perm, hidden.dtype) if hidden_grad_c is not None else None
        return hidden_grad, weight_grad

    def _gradients_from_buffer(
        self,
        hidden,
        weight,
        local_labels,
        valid,
        temperature,
        lse,
        entropy,
        grad_log_prob,
        grad_entropy,
        need_hidden_grad,
        weight_grad,
    ):
        """Backward of the buffer mode: ``dz`` formed in place from the forward's buffer, then
        the two GEMMs over the whole shard at once (K = V/tp for ``d_hidden``: no fp32
        read-modify-write per chunk). Three GEMMs per step instead of four."""
        from mcore_ppo.kernels import dz_from_buffer_kernel

        buf, tmax, block_n, perm, count = self._buffer
        self._buffer = None  # consumed: a second backward would need the forward again
        hidden, weight = _rowmajor(hidden), _rowmajor(weight)
        n, h = hidden.shape
        v = weight.shape[0]
        has_g, has_e, g, e = _upstream_gradients(grad_log_prob, grad_entropy, lse)
        cfg = BUFFER_DZ_CONFIG
        n_tiles_v = tmax.shape[1]
        dz_from_buffer_kernel[(_cdiv(n, cfg.block_m) * n_tiles_v,)](
            buf,
            tmax,
            perm,
            count,
            local_labels,
            lse,
            entropy,
            g,
            e,
            n,
            v,
            n_tiles_v,
            1.0 / temperature,
            HAS_G=has_g,
            HAS_E=has_e,
            BLOCK_M=cfg.block_m,
            BLOCK_N=block_n,
            FAST_LOG2=cfg.fast_log2 and buf.dtype == torch.bfloat16,
            num_warps=cfg.num_warps,
        )
        del tmax
        hidden_grad = None
        if need_hidden_grad:
            hidden_grad_c = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
            _addmm_fp32(hidden_grad_c, buf, weight, "d_hidden")
        if weight_grad is not None:
            x_c = _gathered_rows(hidden, perm, count)
            _addmm_fp32(weight_grad, buf.t(), x_c, "d_weight")
            del x_c
        del buf
        if need_hidden_grad:
            hidden_grad = _scatter_rows(hidden_grad_c, perm, hidden.dtype)
        return hidden_grad, weight_grad
