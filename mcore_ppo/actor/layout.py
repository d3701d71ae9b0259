"""The actor's process groups (:class:`ActorParallel`) and context parallelism at the head.

CP at the head (:meth:`ActorParallel.cp_at_head`, :func:`cp_split_at_head`) is for models whose
attention cannot run CP (Megatron's ``GPTModel`` needs TransformerEngine attention for CP > 1):
Megatron's data-parallel ranks act as the CP ranks, every CP rank runs the whole sequence
through the decoder, and a forward hook on ``model.decoder`` splits the final hidden states
exactly as Megatron splits a CP batch. From the head on (labels, loss, counts, gradient
reduction) the run is then a CP run; only the decoder compute is replicated instead of split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from mcore_ppo.parallel.context_parallel import split_for_cp
from mcore_ppo.parallel.groups import ProcessGroup, group_rank, group_size

__all__ = ["ActorParallel", "all_reduce", "broadcast_from_last_stage", "cp_split_at_head"]


@dataclass(frozen=True)
class ActorParallel:
    """The process groups the actor uses, and whether the model itself runs CP.

    ``tp`` and ``pp`` must be Megatron's own groups (both constructors take them from
    ``parallel_state``): Megatron's gradient finalisation and its grad-norm group read them there.

    Attributes:
        tp: tensor-parallel group (the model's).
        cp: context-parallel group: ranks holding shards of the same sequences.
        dp: data-parallel group: ranks holding different sequences (CP excluded).
        grad_avg: DP×CP group over which gradients are averaged (Megatron DDP's group).
        pp: pipeline group.
        model_runs_cp: True when the model's inputs are CP-split (TransformerEngine attention);
            False when CP is applied at the head (the decoder sees whole sequences).
        schedule_cp_size: the size of the CP group Megatron's schedule works with (``parallel_state``'s:
            the actor hands it no groups of its own). The schedule multiplies a 2-tuple loss by
            it and divides ``seq_length`` by it for the activations pipeline stages exchange.
    """

    tp: ProcessGroup | None
    cp: ProcessGroup | None
    dp: ProcessGroup | None
    grad_avg: ProcessGroup | None
    pp: ProcessGroup | None
    model_runs_cp: bool
    schedule_cp_size: int = field(default=1)

    @classmethod
    def from_parallel_state(cls) -> ActorParallel:
        """Megatron's layout as initialised: CP (if any) runs inside the model."""
        cp = parallel_state.get_context_parallel_group()
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=cp,
            dp=parallel_state.get_data_parallel_group(),
            grad_avg=parallel_state.get_data_parallel_group(with_context_parallel=True),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            model_runs_cp=group_size(cp) > 1,
            schedule_cp_size=group_size(cp),
        )

    @classmethod
    def cp_at_head(cls, *, cp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None) -> ActorParallel:
        """CP applied at the head, for models that cannot run CP (no TransformerEngine).

        Initialise Megatron with ``context_parallel_size=1``: its data-parallel ranks are then
        the CP ranks (and any real DP ranks) of the intended layout — with Megatron's rank order,
        TP × DP' with DP' = cp·dp is the same rank grid as TP × CP × DP. The CP ranks hold the
        *same* sequences, the model sees them whole, and the actor splits the decoder's output
        for CP before the head. Gradients are averaged over Megatron's DP group (= DP×CP).

        Args:
            cp_group: the CP ranks inside Megatron's DP group (default: all of it).
            dp_group: the real data-parallel ranks (default: none).
        """
        if parallel_state.get_context_parallel_world_size() != 1:
            raise ValueError("cp_at_head needs Megatron initialised with context_parallel_size=1")
        dp_cp = parallel_state.get_data_parallel_group()
        cp = cp_group if cp_group is not None else dp_cp
        if group_size(cp) * group_size(dp_group) != group_size(dp_cp):
            raise ValueError(
                f"cp_group ({group_size(cp)} ranks) × dp_group ({group_size(dp_group)} ranks) must make up "
                f"Megatron's data-parallel group ({group_size(dp_cp)} ranks)"
            )
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=cp,
            dp=dp_group,
            grad_avg=dp_cp,
            pp=parallel_state.get_pipeline_model_parallel_group(),
            model_runs_cp=False,
            schedule_cp_size=1,
        )

    @property
    def cp_size(self) -> int:
        """Number of CP ranks."""
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        """This rank's place in the CP group."""
        return group_rank(self.cp)

    def schedule_seq_length(self, model_tokens: int) -> int:
        """The ``seq_length`` Megatron's schedule needs for micro-batches of ``model_tokens``
        tokens per rank (the model's input length here, after any CP split).

        The schedule sizes the activations pipeline stages send and receive as
        ``seq_length // schedule_cp_size`` (divided by TP too under SP, as the model's own
        scatter divides them): it takes the length *before* the CP split. Handing it the
        CP-local length would make one stage send ``schedule_cp_size`` times the tensor the
        next one posts a receive for.
        """
        return model_tokens * self.schedule_cp_size


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` all-reduced in place over ``group`` (nothing to do for one rank); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast_from_last_stage(tensor: torch.Tensor, pp: ProcessGroup | None) -> None:
    """Only the last pipeline stage has outputs and metrics: give every stage its values."""
    if group_size(pp) > 1:
        dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=pp)


@contextlib.contextmanager
def cp_split_at_head(
    gpt: torch.nn.Module, parallel: ActorParallel, cu_seqlens_padded: list[int], *, sequence_parallel: bool
) -> Iterator[None]:
    """While inside, ``gpt.decoder``'s output is split for CP as Megatron splits a CP batch.

    Does nothing when the model runs CP itself, without CP, or off the last pipeline stage (the
    head is not there). ``cu_seqlens_padded``: the micro-batch's global padded sequence bounds.
    """
    if parallel.model_runs_cp or parallel.cp_size == 1 or not gpt.post_process:
        yield
        return
    tp, cp, cp_rank, sp = parallel.tp, parallel.cp_size, parallel.cp_rank, sequence_parallel

    def split_hidden(_module, _args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"CP at the head expects the decoder to return a tensor, got {type(output).__name__}")
        hidden = output
        if sp:
            # SP shards of the whole sequence -> whole sequence. The gradient coming back is
            # already TP-complete and identical on every TP rank (the SP scatter below
            # all-gathers it), so this gather's backward only splits (no sum).
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp)
        hidden = split_for_cp(hidden, cp, cp_rank, seq_dim=0, cu_seqlens=cu_seqlens_padded)
        if sp:
            hidden = scatter_to_sequence_parallel_region(hidden, group=tp)
        return hidden

    handle = gpt.decoder.register_forward_hook(split_hidden)
    try:
        yield
    finally:
        handle.remove()
