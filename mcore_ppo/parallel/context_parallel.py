"""Context-parallel label roll and load-balanced sequence split (Megatron's layout).

Megatron splits each sequence into ``2·cp`` equal chunks and gives rank ``r`` chunks ``r`` and
``2·cp-1-r``, so causal attention work is balanced. The head's math is per token, so CP only
decides which labels a rank holds, and those must be the *global* next tokens: roll first,
split second. Rolling a rank's local shard after the split would pair each chunk's last token
with the first token of the rank's *other* chunk instead of its true successor.

Padded batches (``[b, s]``-like, sequence along ``seq_dim``) split every row the same way.
Packed batches (THD, all sequences concatenated along ``seq_dim``, boundaries in
``cu_seqlens``) split each sequence on its own; every sequence length must be a multiple of
``2·cp`` (Megatron's and verl's packers pad them so, with padding labelled ``ignore_index``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

import torch


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_cp_args(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int, name: str = "tensor") -> int:
    """Checks the arguments every helper here takes (``name``: what the caller calls ``tensor``);
    returns ``seq_dim`` as a non-negative index."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not _is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not _is_int(cp_rank) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    if not _is_int(seq_dim):
        raise TypeError(f"seq_dim must be an int (the sequence dimension of {name}), got {type(seq_dim).__name__}")
    if not -tensor.dim() <= seq_dim < tensor.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for a {tensor.dim()}-D tensor")
    return seq_dim % tensor.dim()


def sequence_bounds(cu_seqlens: torch.Tensor | Sequence[int], total: int) -> list[int]:
    """``cu_seqlens`` as a validated host list (one copy, at data-preparation time): ints from 0
    to ``total``, non-decreasing (empty sequences allowed).

    Only integers are taken: a float would be a length nobody can pad to (and ``int()`` would
    truncate it silently), so it is a TypeError, as a bool is."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor, got dtype {cu_seqlens.dtype}")
        bounds = [int(v) for v in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Iterable):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, got {type(cu_seqlens).__name__}"
        )
    else:
        bounds = []
        for value in cu_seqlens:
            try:  # ints, numpy ints, 0-d integer tensors; not floats or bools
                if isinstance(value, bool):
                    raise TypeError
                bounds.append(operator.index(value))
            except TypeError:
                raise TypeError(f"cu_seqlens must hold ints, got {type(value).__name__} {value!r}") from None
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at the packed length {total}, got {bounds}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds


def cp_token_index(bounds: Sequence[int], cp_size: int, cp_rank: int) -> list[int]:
    """Positions rank ``cp_rank`` keeps, in its local order: chunks ``r`` and ``2cp-1-r`` of every
    sequence (``bounds``: cumulative sequence lengths, each length divisible by ``2·cp_size``)."""
    num_chunks = 2 * cp_size
    index: list[int] = []
    for seq_id, (start, end) in enumerate(itertools.pairwise(bounds)):
        length = end - start
        if length % num_chunks:
            raise ValueError(
                f"sequence {seq_id} has length {length}, which is not divisible by 2*cp_size="
                f"{num_chunks}; pad each sequence to a multiple of {num_chunks} (padding "
                "labelled ignore_index) before the context-parallel split"
            )
        chunk = length // num_chunks
        for c in (cp_rank, num_chunks - 1 - cp_rank):
            index.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return index


def split_for_cp(
    tensor: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    seq_dim: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """This CP rank's part of ``tensor`` under Megatron's load-balanced split.

    Args:
        tensor: any tensor with the (global) sequence along ``seq_dim``.
        cp_size: context-parallel world size.
        cp_rank: this rank's index in the CP group.
        seq_dim: the sequence dimension (1 for ``[b, s]`` labels, 0 for ``[s, b, h]`` hidden).
        cu_seqlens: for packed batches, cumulative sequence lengths ``[0, l0, l0+l1, ...]``
            along ``seq_dim``; each length must divide by ``2·cp_size``. ``None`` for padded
            batches, where the whole ``seq_dim`` must divide by ``2·cp_size``.

    Returns:
        ``tensor`` with ``seq_dim`` shrunk by ``cp_size`` (chunks ``r`` and ``2cp-1-r``).
    """
    seq_dim = _check_cp_args(tensor, cp_size, cp_rank, seq_dim)
    total = tensor.shape[seq_dim]
    # Checked at cp_size 1 too: metadata that is wrong there is wrong at every CP size.
    bounds = [0, total] if cu_seqlens is None else sequence_bounds(cu_seqlens, total)
    if cp_size == 1:
        return tensor
    index = torch.tensor(cp_token_index(bounds, cp_size, cp_rank), dtype=torch.long, device=tensor.device)
    return tensor.index_select(seq_dim, index)


def roll_labels(
    input_ids: torch.Tensor,
    *,
    seq_dim: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token labels: ``labels[i] = input_ids[i+1]`` within each sequence, last = ignore_index.

    The labels keep ``input_ids``' dtype, so ``ignore_index`` must be representable in it
    (ValueError otherwise: -100 would wrap to 156 in uint8 and be taken for a token)."""
    seq_dim = _check_cp_args(input_ids, 1, 0, seq_dim, "input_ids")
    if input_ids.dtype.is_floating_point or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    info = torch.iinfo(input_ids.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(
            f"ignore_index={ignore_index} does not fit input_ids' dtype {input_ids.dtype} (range [{info.min}, "
            f"{info.max}]), which the labels keep; convert input_ids to torch.int64 first"
        )
    total = input_ids.shape[seq_dim]
    bounds = [0, total] if cu_seqlens is None else sequence_bounds(cu_seqlens, total)
    # Rolled and filled in int64: index_fill_ has no unsigned 16/32/64-bit kernels.
    labels = torch.roll(input_ids.long(), shifts=-1, dims=seq_dim)
    last_positions = [end - 1 for start, end in itertools.pairwise(bounds) if end > start]
    if len(last_positions) == 1:
        labels.narrow(seq_dim, last_positions[0], 1).fill_(ignore_index)
    elif last_positions:
        # Pinned and copied without blocking: a list copied straight to the GPU is a host sync.
        index = torch.tensor(last_positions, dtype=torch.long)
        if labels.device.type == "cuda":
            index = index.pin_memory().to(labels.device, non_blocking=True)
        labels.index_fill_(seq_dim, index, ignore_index)
    return labels.to(input_ids.dtype)


def roll_and_split_labels(
    input_ids: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    seq_dim: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels for this CP rank: roll the *global* sequence by one, then split it for CP.

    Each sequence (each row of a padded batch, or each ``cu_seqlens`` segment of a packed one)
    is rolled within itself and its last position gets ``ignore_index``; the result is split
    exactly as :func:`split_for_cp` splits ``input_ids``, so label ``i`` of this rank is the
    global successor of this rank's token ``i``.
    """
    labels = roll_labels(input_ids, seq_dim=seq_dim, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    return split_for_cp(labels, cp_size, cp_rank, seq_dim=seq_dim, cu_seqlens=cu_seqlens)


def split_temperature_for_cp(
    temperature: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    seq_dim: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """This CP rank's part of a per-token temperature tensor, split like the tokens.

    A temperature that covers the sequence (``[b, s]`` beside ``[b, s]`` labels, ``[1, t]``
    packed) is split by :func:`split_for_cp` exactly as the labels are. One that is broadcast
    along the sequence (size 1 there: ``[b, 1]`` per sequence of a padded batch) is the same on
    every CP rank and is returned as it is, as is a 0-d tensor. (A per-sequence temperature of
    a packed batch is per token there: expand it over each sequence, e.g. with
    ``repeat_interleave`` by the sequence lengths, before the split.)
    """
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature must be a torch.Tensor, got {type(temperature).__name__}")
    if temperature.dim() == 0:
        _check_cp_args(temperature.reshape(1), cp_size, cp_rank, 0, "temperature")
        return temperature
    seq_dim = _check_cp_args(temperature, cp_size, cp_rank, seq_dim, "temperature")
    if temperature.shape[seq_dim] == 1:
        return temperature
    return split_for_cp(temperature, cp_size, cp_rank, seq_dim=seq_dim, cu_seqlens=cu_seqlens)
