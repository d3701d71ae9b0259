"""The *logits path*: log-probs and entropy the way a Megatron / verl user computes them today.

The model's own output layer (``ColumnParallelLinear.forward``) produces vocab-parallel logits
``[b, s, V/tp]`` (bf16 for a bf16 model); they are brought to fp32 and divided by the
temperature (what Megatron's ``Float16Module`` upcast and verl's ``logits.div_(T)`` do), then

- log-probs: ``log p = -CE``, Megatron-Core's ``tensor_parallel.vocab_parallel_cross_entropy``
  on a clone of those logits (it works in place);
- entropy: :func:`vocab_parallel_entropy`, verl's ``_VocabParallelEntropy`` (softmax statistics
  all-reduced over TP; its backward needs no communication).

:class:`LogitsPath` is a ``forward_fn`` for :class:`mcore_ppo.actor.MegatronPPOActor`, the
baseline the fused head is benchmarked against (``scripts/bench_ppo.py``). It works on a model
with or without the fused head installed: called without labels the head *is* the
``ColumnParallelLinear`` it replaced.

Not part of the library: the library never imports ``mcore_ppo_testing``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from mcore_ppo.model import unwrap_gpt_model
from mcore_ppo.parallel.groups import ProcessGroup, group_size


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelEntropy(torch.autograd.Function):
    """verl's vocab-parallel entropy (``verl/utils/megatron/tensor_parallel.py``), same memory use.

    Like verl's, the backward computes the gradient in the saved buffers (no new ``[t, V/tp]``
    tensor), so it supports one backward per forward (no ``retain_graph`` re-use).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        logits_max = logits.max(dim=-1, keepdim=True).values
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        probs = (logits - logits_max).exp_()
        sum_exp = probs.sum(dim=-1, keepdim=True)
        _all_reduce(sum_exp, group)
        probs.div_(sum_exp)
        mean_logit = (probs * logits).sum(dim=-1, keepdim=True)  # E_p[z]
        _all_reduce(mean_logit, group)
        entropy = logits_max + sum_exp.log() - mean_logit
        ctx.save_for_backward(logits, probs, mean_logit)
        return entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        logits, probs, mean_logit = ctx.saved_tensors
        # dH/dz = -p · (z - E_p[z]), computed in place in the saved buffers as verl does (no
        # extra [t, V/tp] allocation); the logits are restored afterwards (to rounding).
        logits.sub_(mean_logit)
        probs.mul_(logits).mul_(grad_entropy.unsqueeze(-1)).neg_()
        logits.add_(mean_logit)
        return probs, None


def vocab_parallel_entropy(logits: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the vocab split across ``group`` (last dim = ``V/tp``).

    Args:
        logits: ``[..., V/tp]`` this rank's vocab shard (any float dtype; computed in it).
        group: the TP group; None = one rank.

    Returns:
        ``[...]`` entropies, identical on every rank of ``group``; differentiable once (the
        backward reuses the saved buffers).
    """
    return _VocabParallelEntropy.apply(logits, group)


class LogitsPath:
    """``forward_fn`` of :class:`~mcore_ppo.actor.MegatronPPOActor` that goes through full logits.

    Same call signature as :func:`mcore_ppo.model.gpt_log_probs_and_entropy`: returns
    ``(log_probs, entropy)`` ``[b, s]`` on the last pipeline stage, zero where ``labels`` is
    negative (``ignore_index``), and whatever the model returns on other stages. Log-probs are
    fp32 (Megatron's CE computes in fp32 whatever the input); the entropy is fp32, fp64 for an
    fp64 model.

    Attributes:
        track_max_logit: when True, :attr:`max_abs_logit` records the largest ``|logit / T|``
            seen (one extra reduction per call; used to state the bf16 rounding bound).
        max_abs_logit: that largest value on this rank (0.0 until tracked).
    """

    def __init__(self) -> None:
        self.track_max_logit = False
        self.max_abs_logit = 0.0

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        packed_seq_params: Any | None = None,
    ) -> Any:
        """Run the model for logits, then Megatron's vocab-parallel CE and the vocab-parallel entropy."""
        gpt = unwrap_gpt_model(model)
        logits = model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        if not gpt.post_process:
            return logits
        # An fp32 copy divided by T in place: Float16Module's upcast, then verl's logits.div_(T).
        # fp32/fp64 logits are the model's own output: divided out of place (fp64 stays fp64).
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logits = logits.to(dtype).div_(temperature) if logits.dtype != dtype else logits / temperature
        if self.track_max_logit:
            self.max_abs_logit = max(self.max_abs_logit, float(logits.detach().abs().max()))
        group = parallel_state.get_tensor_model_parallel_group()
        entropy = vocab_parallel_entropy(logits, group)
        # Megatron's CE subtracts the max in place in its input: give it its own copy (as verl does).
        ignored = labels < 0
        log_probs = -vocab_parallel_cross_entropy(logits.clone(), labels.masked_fill(ignored, 0))
        return log_probs.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)
