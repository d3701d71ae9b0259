"""The gradients of one policy update: zero, finalise (reduce), measure, clip, apply.

Megatron's own code does the work where it can:

- Reductions: :func:`megatron.core.distributed.finalize_model_grads` for every model. A model
  wrapped in Megatron DDP goes in as it is; a bare model goes in behind :class:`_BareModelChunk`,
  which gives Megatron the two things it reads from a DDP chunk (``ddp_config`` and
  ``finish_grad_sync``, the DP×CP average of ``.grad``). Megatron then sums the SP-replicated
  parameters (norms) over TP and the tied embeddings over the embedding group, as under DDP.
- Norm: :func:`megatron.core.optimizer.clip_grads.get_grad_norm_fp32` over Megatron's selection
  (``param_is_not_shared``, ``param_is_not_tensor_parallel_duplicate``) and its model-parallel
  group, for fp32 gradients; see :func:`grad_norm` for the rest.
- Clipping: :func:`megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32` for CUDA
  fp32 gradients; see :func:`clip_grads` for the rest.
- A Megatron optimizer (a DDP model needs one: its gradients live in ``main_grad``) measures,
  clips and steps itself (``optimizer.step()``).

Like Megatron's schedule (``device="cuda"`` literals in ``forward_backward_no_pipelining``), its
grad-norm code allocates on ``"cuda"``: a CPU run already needs ``mcore_ppo_testing.cpu_shims``
for the schedule, and the same shims cover the norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from mcore_ppo.actor.layout import ActorParallel, all_reduce
from mcore_ppo.model import unwrap_gpt_model
from mcore_ppo.parallel.groups import ProcessGroup, group_size

__all__ = ["ActorGradients", "clip_grads", "grad_norm", "is_megatron_optimizer"]


def is_megatron_optimizer(optimizer: Any) -> bool:
    """A Megatron-Core optimizer (its ``step()`` clips and returns the grad norm). By class, not by
    attribute: megatron-core 0.19's ``ChainedOptimizer`` lacks methods its 0.16 version has."""
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


class _BareModelChunk:
    """A bare model as ``finalize_model_grads`` sees a DDP chunk.

    Megatron reads ``ddp_config`` (only to ask whether it is Megatron-FSDP) and calls
    ``finish_grad_sync`` for the DP×CP reduction; everything else it reaches through ``module``
    (``get_attr_wrapped_model``). Without DDP there are no ``main_grad`` buffers, so the average
    is taken here, over ``.grad``.
    """

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], grad_avg: ProcessGroup | None):
        self.module = module
        self.ddp_config = DistributedDataParallelConfig()
        self._params = params
        self._grad_avg = grad_avg

    def finish_grad_sync(self, **_: Any) -> None:
        """Average ``.grad`` over the DP×CP group (DDP's reduction)."""
        size = group_size(self._grad_avg)
        if size == 1 or not self._params:
            return
        grads = [p.grad for p in self._params]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self._grad_avg)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def grad_norm(params: list[torch.nn.Parameter], tp_group: ProcessGroup | None) -> float:
    """Global L2 norm of ``params``' ``.grad``: each TP shard and pipeline stage counted once.

    fp32 gradients: Megatron's ``get_grad_norm_fp32``. Other dtypes: the same sum, accumulated in
    fp64 here, because Megatron's rounds each rank's norm to fp32 (fp64 models are the parity
    tests' oracle, to ~1e-13) and, without Apex/TransformerEngine, takes ``torch.norm`` in the
    gradient's own dtype (bf16 gradients of a bare half-precision model). Every rank holds the
    same kind of parameters, so every rank of the model-parallel group takes the same branch.
    """
    grads = [
        p.grad.detach()
        for p in params
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group=tp_group)
    ]
    group = parallel_state.get_model_parallel_group()
    if all(p.grad.dtype == torch.float32 for p in params):
        return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=group))
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for g in grads:
        squares += g.to(torch.float64).pow(2).sum()
    all_reduce(squares, group)
    return float(squares.sqrt())


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale ``params``' ``.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1.

    CUDA fp32 gradients: Megatron's ``clip_grad_by_total_norm_fp32``. It asserts
    ``torch.cuda.FloatTensor`` gradients, so CPU runs and fp64/bf16 gradients are scaled here,
    by the same formula.
    """
    if all(p.grad.is_cuda and p.grad.dtype == torch.float32 for p in params):
        clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
        return
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in params:
            p.grad.mul_(coeff)


class ActorGradients:
    """Zeroing, finalising and applying the gradients of one update of ``model``.

    Args:
        model: the model as the schedule runs it (bare, or wrapped in Megatron DDP).
        optimizer: a ``torch.optim.Optimizer`` (bare model) or a Megatron optimizer.
        parallel: the actor's groups (``grad_avg`` is the DP×CP average of a bare model).
        max_grad_norm: clip to this norm (None = no clipping); a Megatron optimizer clips by its
            own ``config.clip_grad`` instead.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, parallel: ActorParallel, max_grad_norm: float | None):
        self.model = model
        self.gpt = unwrap_gpt_model(model)
        self.optimizer = optimizer
        self.parallel = parallel
        self.max_grad_norm = max_grad_norm
        self.uses_ddp = hasattr(model, "finish_grad_sync")
        self.megatron_optimizer = is_megatron_optimizer(optimizer)
        if self.uses_ddp and not self.megatron_optimizer:
            raise TypeError("a model wrapped in Megatron DDP needs a Megatron optimizer (grads live in main_grad)")

    def params(self) -> list[torch.nn.Parameter]:
        """The trained parameters of this rank."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def zero(self) -> None:
        """Clear the gradients before an update (DDP: its grad buffers too)."""
        if self.uses_ddp:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if not self.uses_ddp:
            for p in self.params():
                p.grad = None

    def finalize(self) -> None:
        """Megatron's ``finalize_model_grads``: the DP×CP average, SP norms over TP, tied embeddings."""
        if self.uses_ddp:
            # The schedule already called it when the config names a finalize function.
            if self.gpt.config.finalize_model_grads_func is None:
                finalize_model_grads([self.model])
            return
        params = self.params()
        for p in params:
            if p.grad is None:  # e.g. no response token reached this rank: still take part below
                p.grad = torch.zeros_like(p)
        finalize_model_grads([_BareModelChunk(self.model, params, self.parallel.grad_avg)])

    def step(self) -> tuple[bool, float]:
        """Measure, clip and apply the finalised gradients: ``(update_successful, grad_norm)``.

        The norm is taken before clipping; a non-finite norm skips the step, as Megatron's
        optimizer skips one.
        """
        if self.megatron_optimizer:
            update_successful, norm, _ = self.optimizer.step()
            return bool(update_successful), float(norm if norm is not None else float("nan"))
        params = self.params()
        norm = grad_norm(params, self.parallel.tp)
        if not math.isfinite(norm):
            return False, norm
        if self.max_grad_norm is not None:
            clip_grads(params, self.max_grad_norm, norm)
        self.optimizer.step()
        return True, norm
