"""Chunked PyTorch backend: the oracle every faster backend is checked against.

It follows the math of docs/design.md §1 literally, in fp32 (fp64 for fp64 inputs), on any
device, and never holds more than one ``[token_chunk, vocab_chunk]`` block of logits. No host
synchronisation: ignored tokens are computed and masked rather than compacted (that needs a
device-to-host count).

Backward, per token with upstream ``g`` (log-prob) and ``e`` (entropy), ``p = exp(z - lse)``:

    dz_j = g·(1[j = label] - p_j) - e·p_j·(log p_j + H)
         = g·1[j = label] - p_j·(g + e·(log p_j + H))

since ``z_j - lse = log p_j``. The logits are ``x·w/T``, so ``d_hidden = (dz/T) @ W`` and
``d_W = (dz/T)ᵀ @ x``. A per-token temperature (``[n]`` tensor) divides row ``i`` by ``T_i``.
One-hot gradients at ``k`` ids per token (:attr:`GradientRequest.sparse`) are added to each
chunk's ``dz`` where the ids fall in it, before the products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_ppo.backends import registry
from mcore_ppo.backends.base import Capabilities, GradientRequest, SavedTokens, ShardStatistics
from mcore_ppo.numerics import accumulation_dtype, check_precision, chunks
from mcore_ppo.statistics import Statistics
from mcore_ppo.validation import check_positive_int


@dataclass(frozen=True)
class TorchConfig:
    """Settings of :class:`TorchBackend`.

    Attributes:
        token_chunk, vocab_chunk: the block of logits held at once, ``[token_chunk,
            vocab_chunk]`` in fp32 (32 MiB by default).
        gather_elements: weight rows gathered at once by :meth:`TorchBackend.gather_logits`, in
            elements (``tokens × k × h``; 128 MiB of fp32): few enough launches per call to stay
            off the host's critical path.
        precision: :data:`mcore_ppo.numerics.PRECISIONS`, accepted for every backend alike:
            here every choice is torch's own fp32 matmul, IEEE under torch's defaults (TF32
            only if the caller allows it process-wide, ``torch.backends.cuda.matmul``), at
            least as accurate as ``"fp32_faithful"`` asks.
    """

    token_chunk: int = 2048
    vocab_chunk: int = 4096
    gather_elements: int = 1 << 25
    precision: str = "auto"

    def __post_init__(self) -> None:
        for name in ("token_chunk", "vocab_chunk", "gather_elements"):
            check_positive_int(name, getattr(self, name))
        check_precision(self.precision)


def _tempered_logits(x: torch.Tensor, w: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    acc = accumulation_dtype(x.dtype)
    return torch.matmul(x.to(acc), w.to(acc).t()) / temperature


def _rows_of(temperature: float | torch.Tensor, t0: int, t1: int) -> float | torch.Tensor:
    """The temperature of tokens ``[t0, t1)``: the float, or the rows' ``[t1 - t0, 1]`` column."""
    if isinstance(temperature, torch.Tensor):
        return temperature[t0:t1, None]
    return temperature


def _label_columns(local_labels: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each token's label inside vocab chunk [v0, v1), and whether it is there."""
    in_chunk = (local_labels >= v0) & (local_labels < v1)
    return torch.where(in_chunk, local_labels - v0, torch.zeros_like(local_labels)), in_chunk


class TorchBackend:
    """Chunked fp32 PyTorch implementation of the shard statistics and gradients (no residual:
    the backward always recomputes)."""

    name = "torch"
    capabilities = Capabilities()

    def __init__(self, config: TorchConfig | None = None):
        if config is not None and not isinstance(config, TorchConfig):
            raise TypeError(f"config must be a TorchConfig or None, got {type(config).__name__}")
        self.config = config or TorchConfig()
        self.op_key = registry.register(self)  # the key the head's ops name it by

    def unsupported(self, hidden: torch.Tensor) -> str | None:
        """None: torch ops run on every device and dtype."""
        return None

    def fused_forward_for(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Never: the head's generic forward runs over :meth:`shard_statistics`."""
        return False

    def residual_spec(self, hidden: torch.Tensor, weight: torch.Tensor, **flags: bool) -> tuple:
        """Nothing is kept: the backward recomputes."""
        return ()

    def head_forward(self, *args, **kwargs) -> None:
        """Not fused (:meth:`fused_forward_for` is False): never called."""
        raise NotImplementedError("the torch backend has no fused forward")

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
        """``statistics``' terms in the accumulation dtype, vocab chunk by chunk
        (:meth:`Statistics.chunk`, merged by :meth:`Statistics.merge`); see the Backend protocol."""
        n, v = hidden.shape[0], weight.shape[0]
        acc = accumulation_dtype(hidden.dtype)
        # Planes: the max, the label logit, then the terms.
        stats = torch.empty(2 + len(statistics.sums), n, dtype=acc, device=hidden.device)
        for t0, t1 in chunks(n, self.config.token_chunk):
            x, labels = hidden[t0:t1], local_labels[t0:t1]
            rows_t = _rows_of(temperature, t0, t1)
            running = None
            label_logit = torch.zeros(t1 - t0, dtype=acc, device=hidden.device)
            for v0, v1 in chunks(v, self.config.vocab_chunk):
                z = _tempered_logits(x, weight[v0:v1], rows_t)
                part = statistics.chunk(z)
                running = part if running is None else statistics.merge(running, part)
                cols, in_chunk = _label_columns(labels, v0, v1)
                picked = z.gather(1, cols[:, None]).squeeze(1)
                label_logit = torch.where(in_chunk, picked, label_logit)
            stats[0, t0:t1], stats[2:, t0:t1] = running
            stats[1, t0:t1] = label_logit
        return ShardStatistics(stats[0], stats[2:], stats[1])

    def gather_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, local_ids: torch.Tensor, temperature: float | torch.Tensor
    ) -> torch.Tensor:
        """The logits at ``k`` local ids per token, gathered rows and a batched GEMM in token
        chunks of at most :attr:`TorchConfig.gather_elements` elements; see the Backend protocol."""
        n, h = hidden.shape
        k = local_ids.shape[1]
        acc = accumulation_dtype(hidden.dtype)
        logits = torch.zeros(n, k, dtype=acc, device=hidden.device)
        in_shard = local_ids >= 0
        # A token with no id in the shard (ignored, or all ids elsewhere) may hold anything (inf
        # padding): never let it into a product.
        x_all = torch.where(
            in_shard.any(dim=1)[:, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        )
        rows_ids = local_ids.clamp(min=0)
        for t0, t1 in chunks(n, max(1, self.config.gather_elements // max(1, k * h))):
            rows = weight[rows_ids[t0:t1]].to(acc)  # [c, k, h]; .to is free for fp32 / fp64 weights
            z = torch.bmm(rows, x_all[t0:t1].to(acc)[:, :, None]).squeeze(-1) / _rows_of(temperature, t0, t1)
            logits[t0:t1] = torch.where(in_shard[t0:t1], z, 0.0)
        return logits

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(d_hidden, d_weight)`` of this shard, logits recomputed chunk by chunk; see the Backend protocol."""
        local_labels, valid, lse, entropy = saved.local_labels, saved.valid, saved.lse, saved.entropy
        grad_log_prob, grad_entropy, weight_grad = request.grad_log_prob, request.grad_entropy, request.weight_grad
        n, h = hidden.shape
        v = weight.shape[0]
        acc = accumulation_dtype(hidden.dtype)
        zeros = torch.zeros(n, dtype=acc, device=hidden.device)
        # Ignored tokens get zero upstream gradient, whatever the caller passed.
        g = torch.where(valid, grad_log_prob.to(acc), zeros) if grad_log_prob is not None else zeros
        has_e = grad_entropy is not None and entropy is not None
        e = torch.where(valid, grad_entropy.to(acc), zeros) if has_e else zeros
        hidden_grad = torch.zeros(n, h, dtype=acc, device=hidden.device) if request.need_hidden_grad else None
        sparse = request.sparse
        for t0, t1 in chunks(n, self.config.token_chunk):
            valid_c = valid[t0:t1, None]
            # Ignored rows' hidden states may be anything (inf padding): zero them so their
            # zero dz cannot meet an inf in d_W (0·inf = NaN).
            x = torch.where(valid_c, hidden[t0:t1], torch.zeros((), dtype=hidden.dtype, device=hidden.device))
            labels = local_labels[t0:t1]
            g_c, e_c = g[t0:t1, None], e[t0:t1, None]
            lse_c = lse[t0:t1, None]
            entropy_c = entropy[t0:t1, None] if has_e else zeros[t0:t1, None]
            rows_t = _rows_of(temperature, t0, t1)
            for v0, v1 in chunks(v, self.config.vocab_chunk):
                w = weight[v0:v1]
                log_p = _tempered_logits(x, w, rows_t) - lse_c
                # Ignored rows: lse may be anything there, so mask before exp can overflow.
                log_p = torch.where(valid_c, log_p, torch.full_like(log_p, -torch.inf))
                p = torch.exp(log_p)
                dz = -p * (g_c + e_c * torch.where(valid_c, log_p + entropy_c, torch.zeros_like(log_p)))
                cols, in_chunk = _label_columns(labels, v0, v1)
                dz.scatter_add_(1, cols[:, None], torch.where(in_chunk[:, None], g_c, torch.zeros_like(g_c)))
                if sparse is not None:
                    ids_cols, ids_in = _label_columns(sparse.ids[t0:t1], v0, v1)
                    dz.scatter_add_(1, ids_cols, torch.where(ids_in, sparse.g[t0:t1].to(acc), 0.0))
                dz /= rows_t
                if hidden_grad is not None:
                    hidden_grad[t0:t1] += dz @ w.to(acc)
                if weight_grad is not None:
                    weight_grad[v0:v1] += (dz.t() @ x.to(acc)).to(weight_grad.dtype)
        return hidden_grad, weight_grad
