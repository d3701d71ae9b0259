"""NeMo-RL's logits-path log-probs, reimplemented on the full logits, as the NeMo-RL adapter's reference.

From NVIDIA-NeMo/RL at 7ea279ab, ``nemo_rl/distributed/model_utils.py``:

- ``from_parallel_logits_to_logprobs(logits [b, s/cp, V/tp], target [b, s], ...)``: roll the
  unshifted target by one (``target.roll(shifts=-1, dims=-1)``), take ``log_softmax`` of the
  (temperature-scaled) logits over the whole vocab, gather the target's entry, all-gather over
  CP, drop the CP padding and the last position: ``[b, s - 1]``.
- ``from_parallel_logits_to_logprobs_packed_sequences(logits [1, T/cp, V/tp], target [1, T],
  cu_seqlens_padded, unpacked_seqlen, ...)``: the same per packed sequence (each rolled within
  itself), unpacked into ``[batch, unpacked_seqlen - 1]``: row ``i`` holds sequence ``i``'s values
  but its last position, from column 0, zeros after.

Here on one rank (the whole vocab and sequence) in the input dtype, with the entropy of the
same softmax beside it.
"""

from __future__ import annotations

import itertools

import torch


def logits_path_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: float = 1.0,
    *,
    cu_seqlens_padded: list[int] | None = None,
    unpacked_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` as NeMo-RL's logits path returns log-probs, from ``hidden [s, b, h]``."""
    logits = hidden.transpose(0, 1) @ weight.t() / temperature  # [b, s, V], as Megatron returns them
    log_softmax = torch.log_softmax(logits, dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    if cu_seqlens_padded is None:
        rolled = target.roll(shifts=-1, dims=-1)
        log_probs = log_softmax[:, : target.shape[1]].gather(-1, rolled.unsqueeze(-1)).squeeze(-1)
        return log_probs[:, :-1], entropy[:, : target.shape[1] - 1]
    width = unpacked_seqlen - 1
    rows_lp, rows_ent = [], []
    for start, end in itertools.pairwise(cu_seqlens_padded):
        rolled = target[0, start:end].roll(shifts=-1, dims=0)
        seq_lp = log_softmax[0, start:end].gather(-1, rolled.unsqueeze(-1)).squeeze(-1)[: end - start - 1]
        seq_ent = entropy[0, start:end][: end - start - 1]
        pad = (0, width - min(width, seq_lp.shape[0]))
        rows_lp.append(torch.nn.functional.pad(seq_lp[:width], pad))
        rows_ent.append(torch.nn.functional.pad(seq_ent[:width], pad))
    return torch.stack(rows_lp), torch.stack(rows_ent)
