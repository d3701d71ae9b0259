"""A backend that computes nothing: the head's host work above its backend, on any machine.

:class:`NullBackend` follows the :class:`~mcore_ppo.backends.base.Backend` protocol with the
triton backend's capabilities (the whole one-label forward in ``head_forward``, a ``d_W``
buffer it writes) and allocates what a real backend returns, uninitialised, without computing
it. A call through the API with it therefore costs what the head's Python around its kernels
costs (options, checks, the op boundary, autograd, the output tensors' allocations), with no
kernel or GEMM: ``scripts/host_work.py --backend null`` times that part of the host work on a
CPU, where the real kernels cannot run. The numbers it returns are garbage by design; nothing
but timing may use it.
"""

from __future__ import annotations

import torch

from mcore_ppo.backends import registry
from mcore_ppo.backends.base import Capabilities, GradientRequest, HeadForward, SavedTokens, ShardStatistics


class NullBackend:
    """The protocol's methods, each returning fresh uninitialised tensors of the right shapes."""

    name = "null"

    def __init__(self) -> None:
        """Registered like every backend object, so the head's ops find it by its key."""
        self.capabilities = Capabilities(fused_forward=True, weight_grad_in_weight_dtype=True, writes_weight_grad=True)
        self.op_key = registry.register(self)

    def unsupported(self, hidden: torch.Tensor) -> str | None:
        """Runs anywhere."""
        return None

    def fused_forward_for(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Always the fused forward (one launch sequence's worth of host work in a real backend)."""
        return True

    def residual_spec(self, hidden, weight, *, fused, grad_needed, statistics, row_temperature):
        """Nothing kept for the backward."""
        return ()

    def shard_statistics(
        self, hidden, weight, local_labels, valid, temperature, *, grad_needed, statistics
    ) -> ShardStatistics:
        """``m``, ``y`` and the terms' ``sums`` as fresh fp32 tensors."""
        n = hidden.shape[0]
        stats = torch.empty(2 + len(statistics.sums), n, dtype=torch.float32, device=hidden.device)
        return ShardStatistics(stats[0], stats[2:], stats[1])

    def gather_logits(self, hidden, weight, local_ids, temperature) -> torch.Tensor:
        """``[n, k]`` fp32."""
        return torch.empty(local_ids.shape, dtype=torch.float32, device=hidden.device)

    def shard_gradients(self, hidden, weight, saved: SavedTokens, request: GradientRequest, *, temperature):
        """``d_hidden`` fresh, ``d_W`` the request's buffer (a real backend writes it)."""
        d_hidden = torch.empty_like(hidden) if request.need_hidden_grad else None
        return d_hidden, request.weight_grad

    def head_forward(
        self, hidden, weight, labels, temperature, *, ignore_index, vocab_start, vocab_size, labels_in_range,
        grad_needed, statistics, max_entropy, combine,
    ) -> HeadForward:  # fmt: skip
        """The outputs and the backward's per-token tensors, as the triton backend allocates them."""
        n, device = hidden.shape[0], hidden.device

        def empty(dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(n, dtype=dtype, device=device)

        log_prob = empty()
        entropy = empty() if statistics.entropy else None
        saved = SavedTokens(empty(torch.int64), empty(torch.bool), empty(), empty() if statistics.entropy else None)
        detached = None
        if statistics.detached:
            detached = torch.empty(len(statistics.detached), n, dtype=torch.float32, device=device)
        return HeadForward(log_prob, entropy, saved, detached)
