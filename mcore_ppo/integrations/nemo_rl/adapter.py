"""NeMo-RL adapter: its hidden-states-to-log-probs call on the fused head, with CP, packing and entropy.

NeMo-RL (NVIDIA-NeMo/RL at 7ea279ab, ``nemo_rl/distributed/model_utils.py``) gets a Megatron
policy's next-token log-probs in one of two ways:

- from the full logits, ``from_parallel_logits_to_logprobs`` (padded ``[b, s]``) or
  ``from_parallel_logits_to_logprobs_packed_sequences`` (packed, ``cu_seqlens_padded``): the
  target is the *unshifted, global* ``input_ids``, rolled by one inside, CP-split like the model's
  tokens (Megatron's 2·cp load-balanced chunks), the log-probs all-gathered over CP and returned
  ``[b, s - 1]`` (packed: unpacked to ``[batch, unpacked_seqlen - 1]``);
- from the hidden states, ``from_parallel_hidden_states_to_logprobs`` (its
  ``use_fused_linear_logprobs``): the same signature as below up to ``chunk_size``, a chunked
  autograd Function that all-gathers the SP-sharded hidden states, but which asserts CP 1, is
  refused with sequence packing and top-k/top-p, applies no temperature and gives no entropy.

:func:`from_parallel_hidden_states_to_logprobs` here takes the hidden-states call's arguments
and returns what the logits path returns, for every layout that path has: TP (with or without
SP), CP, packed sequences, temperature, and the entropy on request. It builds the labels with
:func:`mcore_ppo.parallel.roll_and_split_labels` (roll the global sequence, then split: the position a
rank holds gets its true successor) and runs :func:`mcore_ppo.head_call.run_head`. Top-k/top-p
filtering is refused: the head's log-probs are those of the whole softmax. (What
:func:`mcore_ppo.integrations.nemo_rl.enable` puts in NeMo-RL's own call site is
:mod:`mcore_ppo.integrations.nemo_rl.fused`, which calls this.)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from mcore_ppo import validation
from mcore_ppo.backends.base import Backend
from mcore_ppo.head_call import attempt, run_head
from mcore_ppo.options import DEFAULT_LAYOUT, DEFAULT_OPTIONS, call_options, megatron_layout
from mcore_ppo.parallel.context_parallel import roll_labels, split_for_cp
from mcore_ppo.parallel.cp_gather import gather_from_cp
from mcore_ppo.parallel.ranks import ProcessGroup, group_rank, group_size

__all__ = ["from_parallel_hidden_states_to_logprobs"]

_IGNORE = -100  # the labels' ignore index inside the adapter (rolled-off and padding positions)


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool | None,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: ProcessGroup | None,
    inference_only: bool = False,
    cp_group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    *,
    sampling_params: Any = None,
    temperature: float | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    unpacked_seqlen: int | None = None,
    sequence_parallel: bool | None = None,
    return_entropy: bool = False,
    backend: str | Backend = "auto",
    validate: bool | None = None,
    precision: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs ``[b, s - 1]`` of ``softmax(hidden @ W.T / T)`` (and entropy) from hidden states.

    Args:
        tensor_parallel_hidden_states: the decoder's output on this rank, ``[s_local, b, h]``:
            this CP rank's tokens (load-balanced order), sequence-sharded over TP under SP.
            Packed: ``[T_local, 1, h]``.
        output_weight_layer: this rank's vocab shard ``[V/tp, h]`` (the output layer's, or the
            embedding's for tied models).
        runtime_gather_output, chunk_size: accepted for NeMo-RL's signature, unused (the head
            never materialises logits and tiles the vocab itself).
        target: the unshifted token ids of the *whole* sequence (not CP-split), as for NeMo-RL's
            logits path: ``[b, s]``, packed ``[1, T]`` with ``cu_seqlens_padded``. (NeMo-RL's
            patched forward passes the CP-sharded ids, which is only right at CP 1.)
        vocab_start_index, vocab_end_index: this rank's vocab range; must be its shard's.
        tp_group, cp_group: the TP and CP groups (None: one rank).
        inference_only: no autograd graph (NeMo-RL's log-prob passes).
        sampling_params: NeMo-RL's ``TrainingSamplingParams``: its ``temperature`` is used;
            ``top_k`` / ``top_p`` filtering is refused.
        temperature: the logits are divided by it (default ``sampling_params.temperature`` or
            1). NeMo-RL divides the *logits* by T before its logits path; do not also divide
            what this returns.
        cu_seqlens_padded, unpacked_seqlen: packed sequences: the global cumulative (padded)
            sequence lengths ``[batch + 1]``, each a multiple of ``2·cp``, and the length of the
            unpacked rows to return.
        sequence_parallel: the hidden states are sequence-sharded over TP; None means TP > 1,
            as NeMo-RL's fused path assumes.
        return_entropy: also return the entropy, shaped like the log-probs.
        backend, validate, precision: the head's options (:class:`mcore_ppo.options.HeadOptions`; a backend
            object carries its settings; ``validate`` None: the default), not in NeMo-RL's signature.

    Returns:
        fp32 (fp64 for fp64 inputs) log-probs ``[b, s - 1]`` (packed: ``[batch, unpacked_seqlen - 1]``, zero past each
        sequence), identical on every TP and CP rank; or ``(log_probs, entropy)``. Backward:
        ``d_hidden`` reduced over TP once (reduce-scattered under SP); the CP gather's backward
        sums the upstream gradients over CP, as NeMo-RL's ``AllGatherCPTensor``.

    Raises:
        ValueError: top-k/top-p filtering, a vocab range that is not this rank's shard,
            inconsistent shapes, or two different temperatures.
    """
    del runtime_gather_output, chunk_size  # NeMo-RL's signature; nothing to do with them here
    weight = output_weight_layer
    hidden = tensor_parallel_hidden_states
    tp_size, cp_size = group_size(tp_group), group_size(cp_group)

    def prepared() -> tuple:
        """This rank's own checks and labels (a refusal is shared over TP by the head's verdict)."""
        call_temperature = _temperature(sampling_params, temperature)
        validation.check_tensor("output_weight_layer", weight, "float")
        validation.check_tensor("tensor_parallel_hidden_states", hidden, "any")
        validation.check_tensor("target", target, "index")
        validation.check_bool("inference_only", inference_only)
        for name, value in (("vocab_start_index", vocab_start_index), ("vocab_end_index", vocab_end_index)):
            if not validation.is_int(value):
                raise TypeError(f"{name} must be an int, got {validation.type_name(value)}")
        if unpacked_seqlen is not None:
            validation.check_positive_int("unpacked_seqlen", unpacked_seqlen)
        shard = weight.shape[0]
        rank = group_rank(tp_group)
        if (vocab_start_index, vocab_end_index) != (rank * shard, (rank + 1) * shard):
            raise ValueError(
                f"vocab range [{vocab_start_index}, {vocab_end_index}) is not TP rank {rank}'s shard of {shard} rows; "
                "the head needs equal vocab shards in rank order (Megatron's ColumnParallelLinear)"
            )
        sp = tp_size > 1 if sequence_parallel is None else sequence_parallel
        layout = megatron_layout(sp)
        total = hidden.shape[0] * (tp_size if sp else 1) * cp_size  # global tokens per row
        if cu_seqlens_padded is not None:
            bounds = [int(v) for v in cu_seqlens_padded.tolist()]  # host copy: NeMo-RL's unpacking needs it too
            if target.shape != (1, total) or unpacked_seqlen is None:
                raise ValueError(
                    f"packed sequences need target [1, {total}] (the whole packed sequence) and unpacked_seqlen, "
                    f"got target {tuple(target.shape)} and unpacked_seqlen={unpacked_seqlen}"
                )
            labels = split_for_cp(
                roll_labels(target, seq_dim=1, cu_seqlens=bounds, ignore_index=_IGNORE),
                cp_size, group_rank(cp_group), seq_dim=1, cu_seqlens=bounds,
            )  # fmt: skip
            return call_temperature, layout, labels, bounds, None
        seq = target.shape[-1]
        if target.dim() != 2 or target.shape[0] != hidden.shape[1] or seq > total:
            raise ValueError(
                f"target must be [b={hidden.shape[1]}, s <= {total}] (the whole sequence), got {tuple(target.shape)}"
            )
        # Rolled, then padded to the model's (CP-padded) length with ignored labels, then split.
        labels = torch.nn.functional.pad(
            roll_labels(target, seq_dim=1, ignore_index=_IGNORE), (0, total - seq), value=_IGNORE
        )
        return call_temperature, layout, split_for_cp(labels, cp_size, group_rank(cp_group), seq_dim=1), None, seq

    def checked() -> tuple:
        # Without return_entropy the head skips the entropy's sums, its TP combine and backward term.
        options = call_options(
            None, ignore_index=_IGNORE, backend=backend, return_entropy=return_entropy, validate=validate,
            precision=precision,
        )  # fmt: skip
        return options, prepared()

    (options, (call_temperature, layout, labels, bounds, seq)), error = attempt(
        checked, (DEFAULT_OPTIONS, (1.0, DEFAULT_LAYOUT, target, None, None))
    )
    with torch.no_grad() if inference_only else torch.enable_grad():
        outputs = run_head(
            hidden, weight, labels, call_temperature, options, tp_group=tp_group, layout=layout,
            prior_error=error,
        )  # fmt: skip
    packed = bounds is not None
    results = []
    for values in outputs[: 2 if return_entropy else 1]:
        values = gather_from_cp(values, cp_group, seq_dim=1, cu_seqlens=bounds if packed else None)
        results.append(_unpack(values, bounds, unpacked_seqlen) if packed else values[:, : seq - 1])
    return (results[0], results[1]) if return_entropy else results[0]


def _temperature(sampling_params: Any, temperature: float | None) -> float:
    """The temperature to use; ValueError for top-k/top-p filtering (NeMo-RL's own tests of it)."""
    if sampling_params is not None:
        if not hasattr(sampling_params, "temperature"):
            # A mapping or another object would leave its temperature unread: a silent T = 1.
            raise TypeError(
                "sampling_params must be NeMo-RL's TrainingSamplingParams (an object with temperature, top_k and "
                f"top_p attributes), got {validation.type_name(sampling_params)}"
            )
        top_k, top_p = getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0)
        if (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0):
            raise ValueError(
                f"top-k/top-p filtering (top_k={top_k}, top_p={top_p}) is not supported: the fused head gives the "
                "log-probs of the whole softmax. Use NeMo-RL's logits path for filtered log-probs, or set "
                "policy.generation.top_k=null and top_p=1.0"
            )
        sampled = getattr(sampling_params, "temperature", 1.0)
        if temperature is not None and temperature != sampled:
            raise ValueError(f"temperature={temperature} differs from sampling_params.temperature={sampled}")
        temperature = sampled
    return 1.0 if temperature is None else temperature


def _unpack(values: torch.Tensor, bounds: list[int], unpacked_seqlen: int) -> torch.Tensor:
    """Packed ``[1, T]`` -> ``[batch, unpacked_seqlen - 1]``: each sequence's values but its last
    position, from column 0 (NeMo-RL's unpacking of ``from_parallel_logits_to_logprobs_packed_sequences``)."""
    width = unpacked_seqlen - 1
    src, dst = [], []
    for row, (start, end) in enumerate(itertools.pairwise(bounds)):
        count = max(0, min(end - start - 1, width))
        src.extend(range(start, start + count))
        dst.extend(range(row * width, row * width + count))
    flat = values.new_zeros((len(bounds) - 1) * width)
    index = torch.tensor(src, dtype=torch.long, device=values.device)
    flat = flat.index_copy(
        0, torch.tensor(dst, dtype=torch.long, device=values.device), values[0].index_select(0, index)
    )
    return flat.view(len(bounds) - 1, width)
