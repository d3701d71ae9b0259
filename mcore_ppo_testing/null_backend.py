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

    def residual_spec(self, hidden, weight, *, fused, grad_needed, with_entropy, row_temperature, with_sum_pi_squared):
        """Nothing kept for the backward."""
        return ()

    def shard_statistics(
        self, hidden, weight, local_labels, valid, temperature, *, grad_needed, with_entropy, with_sum_pi_squared=False
    ) -> ShardStatistics:
        """``(m, s, u, y)`` (and ``q``) as fresh ``[n]`` fp32 tensors."""
        n = hidden.shape[0]

        def per_token(present: bool = True) -> torch.Tensor | None:
            return torch.empty(n, dtype=torch.float32, device=hidden.device) if present else None

        return ShardStatistics(
            per_token(), per_token(), per_token(with_entropy), per_token(), (), per_token(with_sum_pi_squared)
        )

    def gather_logits(self, hidden, weight, local_ids, temperature) -> torch.Tensor:
        """``[n, k]`` fp32."""
        return torch.empty(local_ids.shape, dtype=torch.float32, device=hidden.device)

    def shard_gradients(self, hidden, weight, saved: SavedTokens, request: GradientRequest, *, temperature):
        """``d_hidden`` fresh, ``d_W`` the request's buffer (a real backend writes it)."""
        d_hidden = torch.empty_like(hidden) if request.need_hidden_grad else None
        return d_hidden, request.weight_grad

    def head_forward(
        self, hidden, weight, labels, temperature, *, ignore_index, vocab_start, vocab_size, labels_in_range,
        grad_needed, with_entropy, max_entropy, combine, with_sum_pi_squared=False,
    ) -> HeadForward:  # fmt: skip
        """The outputs and the backward's per-token tensors, as the triton backend allocates them."""
        n, device = hidden.shape[0], hidden.device

        def empty(dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(n, dtype=dtype, device=device)

        log_prob = empty()
        entropy = empty() if with_entropy else None
        saved = SavedTokens(empty(torch.int64), empty(torch.bool), empty(), empty() if with_entropy else None)
        return HeadForward(log_prob, entropy, saved, empty() if with_sum_pi_squared else None)
