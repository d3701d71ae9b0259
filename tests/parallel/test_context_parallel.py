"""Context parallelism on one process: Megatron's load-balanced split, the label roll, and the head.

The head's math is per token, so CP only decides which labels a rank holds. These tests run
every CP rank's share in turn in one process (no communication is involved) and check that

* ``split_for_cp`` is Megatron's split: each sequence in ``2·cp`` chunks, rank ``r`` keeps
  chunks ``r`` and ``2cp-1-r``, and the ranks together hold every position exactly once;
* labels rolled *before* the split (``roll_and_split_labels``) differ from a naive roll of the
  rank's local shard exactly at the global chunk boundaries (the seed bug);
* the head run on each rank's split hidden and labels, reassembled, equals the cp=1 result.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import TorchBackend, TorchConfig
from mcore_ppo.parallel import roll_and_split_labels, roll_labels, split_for_cp
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

# (cp_size, cu_seqlens or None for a padded batch). Packed sequences have different lengths,
# each a multiple of 2·cp.
LAYOUTS = [
    (2, None),
    (4, None),
    (2, [0, 4, 16, 24]),
    (4, [0, 8, 24, 48]),
]
LAYOUT_IDS = ["cp2-padded", "cp4-padded", "cp2-packed", "cp4-packed"]


def total_length(cp_size: int, cu_seqlens: list[int] | None) -> int:
    """Sequence length of the padded batch (4 chunks of 2 per rank) or the packed length."""
    return 8 * cp_size if cu_seqlens is None else cu_seqlens[-1]


def local_cu_seqlens(cu_seqlens: list[int] | None, cp_size: int) -> list[int] | None:
    """A rank's packed boundaries after the split: every sequence shrinks by ``cp_size``."""
    return None if cu_seqlens is None else [b // cp_size for b in cu_seqlens]


def sequences(cu_seqlens: list[int] | None, total: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every sequence."""
    return list(itertools.pairwise([0, total] if cu_seqlens is None else cu_seqlens))


def positions(cp_size: int, cp_rank: int, cu_seqlens: list[int] | None, total: int) -> torch.Tensor:
    """Global sequence positions held by ``cp_rank``, in its local order."""
    return split_for_cp(torch.arange(total), cp_size, cp_rank, seq_dim=0, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize(("cp_size", "cu_seqlens"), [(1, None), *LAYOUTS, (3, [0, 6, 6, 18])])
def test_split_is_megatron_load_balanced(cp_size, cu_seqlens):
    """Rank r holds chunks r and 2cp-1-r of every sequence; the ranks' union is a permutation."""
    total = total_length(cp_size, cu_seqlens)
    held = [positions(cp_size, r, cu_seqlens, total) for r in range(cp_size)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(total)), "not a permutation"
    for r, pos in enumerate(held):
        expected = []
        for start, end in sequences(cu_seqlens, total):
            chunk = (end - start) // (2 * cp_size)
            for c in (r, 2 * cp_size - 1 - r):
                expected.extend(range(start + c * chunk, start + (c + 1) * chunk))
        assert pos.tolist() == expected, f"rank {r}"


@pytest.mark.parametrize(("cp_size", "cu_seqlens"), LAYOUTS, ids=LAYOUT_IDS)
def test_split_selects_along_seq_dim(cp_size, cu_seqlens):
    """hidden [s,b,h] (seq_dim 0) and labels [b,s] (seq_dim 1 or -1) are split by the same index."""
    gen = generator(next_seed())
    total = total_length(cp_size, cu_seqlens)
    batch = 3 if cu_seqlens is None else 1
    hidden = torch.randn(total, batch, 5, generator=gen)
    labels = torch.randint(0, 100, (batch, total), generator=gen)
    for r in range(cp_size):
        index = positions(cp_size, r, cu_seqlens, total)
        assert torch.equal(split_for_cp(hidden, cp_size, r, seq_dim=0, cu_seqlens=cu_seqlens), hidden[index])
        for dim in (1, -1):
            assert torch.equal(split_for_cp(labels, cp_size, r, seq_dim=dim, cu_seqlens=cu_seqlens), labels[:, index])
        tensor_cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
        assert torch.equal(split_for_cp(labels, cp_size, r, seq_dim=1, cu_seqlens=tensor_cu), labels[:, index])


@pytest.mark.parametrize("cu_seqlens", [None, [0, 3, 3, 10]])
@pytest.mark.parametrize("ignore_index", [IGNORE_INDEX, -1])
def test_roll_labels(cu_seqlens, ignore_index):
    """labels[i] = input_ids[i+1] within each sequence; each sequence's last label is ignore_index."""
    gen = generator(next_seed())
    ids = torch.randint(0, 50, (2 if cu_seqlens is None else 1, 10), generator=gen)
    labels = roll_labels(ids, seq_dim=1, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    expected = torch.full_like(ids, ignore_index)
    for start, end in sequences(cu_seqlens, 10):
        expected[:, start : end - 1] = ids[:, start + 1 : end]
    assert torch.equal(labels, expected)
    assert torch.equal(ids, ids.clone())  # the input is left alone (roll returns a new tensor)


@pytest.mark.parametrize(("cp_size", "cu_seqlens"), LAYOUTS, ids=LAYOUT_IDS)
def test_roll_after_split_differs_exactly_at_chunk_boundaries(cp_size, cu_seqlens):
    """Regression (seed bug): rolling the local shard pairs each chunk's last token with the wrong successor.

    With distinct token ids, the correct labels (roll the global sequence, then split) and the
    naive ones (split, then roll the rank's shard within each local sequence) must differ at
    exactly the positions that end a global chunk, and agree everywhere else. Two chunk ends
    are not boundaries in this sense: the sequence's last position (ignore_index either way),
    and the end of chunk cp-1, whose successor chunk cp is held by the same rank right after it.
    """
    gen = generator(next_seed())
    total = total_length(cp_size, cu_seqlens)
    batch = 2 if cu_seqlens is None else 1
    ids = torch.randperm(10_000, generator=gen)[: batch * total].view(batch, total)  # distinct ids
    boundaries = set()
    for start, end in sequences(cu_seqlens, total):
        chunk = (end - start) // (2 * cp_size)
        boundaries |= {start + (k + 1) * chunk - 1 for k in range(2 * cp_size - 1) if k != cp_size - 1}
        assert chunk > 0
    seen = set()
    for r in range(cp_size):
        pos = positions(cp_size, r, cu_seqlens, total)
        correct = roll_and_split_labels(ids, cp_size, r, seq_dim=1, cu_seqlens=cu_seqlens)
        local_ids = split_for_cp(ids, cp_size, r, seq_dim=1, cu_seqlens=cu_seqlens)
        naive = roll_labels(local_ids, seq_dim=1, cu_seqlens=local_cu_seqlens(cu_seqlens, cp_size))
        # The correct labels are the global successors.
        successor = torch.full_like(correct, IGNORE_INDEX)
        for i, p in enumerate(pos.tolist()):
            if not any(p == end - 1 for _, end in sequences(cu_seqlens, total)):
                successor[:, i] = ids[:, p + 1]
        assert torch.equal(correct, successor), f"rank {r}: labels are not the global next tokens"
        differ = correct != naive
        assert torch.equal(differ, differ[:1].expand_as(differ)), "every row of a padded batch splits alike"
        differ_positions = set(pos[differ[0]].tolist())
        assert differ_positions == boundaries & set(pos.tolist()), f"rank {r}"
        seen |= differ_positions
    assert seen == boundaries, "every chunk boundary must be corrupted by the naive roll"
    assert len(boundaries) == (2 * cp_size - 2) * len(sequences(cu_seqlens, total))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("cp_size", "cu_seqlens"), LAYOUTS, ids=LAYOUT_IDS)
def test_head_cp_path_equals_cp1(cp_size, cu_seqlens, dtype):
    """Every CP rank's head output and d_hidden, reassembled, equal the cp=1 run; d_weight sums to it."""
    backend = TorchBackend(TorchConfig(token_chunk=5, vocab_chunk=7))
    gen = generator(next_seed())
    vocab, h = 61, 16
    total = total_length(cp_size, cu_seqlens)
    batch = 2 if cu_seqlens is None else 1
    hidden = (torch.randn(total, batch, h, generator=gen) * 3).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen) / math.sqrt(h)).to(dtype)
    ids = torch.randint(0, vocab, (batch, total), generator=gen)
    ids[:, 1], ids[:, -1] = 0, vocab - 1  # first and last vocab id among the labels
    g, e = torch.randn(batch, total, generator=gen), torch.randn(batch, total, generator=gen)

    def run(hidden_part, labels, g_part, e_part, leaf_hidden, leaf_weight):
        lp, ent = mcore_ppo.fused_log_probs_and_entropy(
            hidden_part, leaf_weight, labels, temperature=0.7, backend=backend
        )
        check_invariants(lp, ent, labels, vocab)
        ((lp * g_part).sum() + (ent * e_part).sum()).backward()
        return lp.detach(), ent.detach()

    # cp = 1: the whole sequence, labels rolled globally.
    full_hidden, full_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    labels = roll_labels(ids, seq_dim=1, cu_seqlens=cu_seqlens)
    lp1, ent1 = run(full_hidden, labels, g, e, full_hidden, full_weight)

    # cp ranks one after another; gradients of the split views accumulate into shared leaves.
    cp_hidden, cp_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp_cp, ent_cp = torch.full_like(lp1, torch.nan), torch.full_like(ent1, torch.nan)
    for r in range(cp_size):
        split = dict(cp_size=cp_size, cp_rank=r, cu_seqlens=cu_seqlens)
        local_hidden = split_for_cp(cp_hidden, seq_dim=0, **split)
        local_labels = roll_and_split_labels(ids, seq_dim=1, **split)
        lp_r, ent_r = run(
            local_hidden,
            local_labels,
            split_for_cp(g, seq_dim=1, **split),
            split_for_cp(e, seq_dim=1, **split),
            cp_hidden,
            cp_weight,
        )
        index = positions(cp_size, r, cu_seqlens, total)  # inverse of the split: scatter back
        lp_cp[:, index], ent_cp[:, index] = lp_r, ent_r

    # Per-token math: identical up to fp32 rounding of differently blocked GEMMs, and (bf16) the
    # final cast of each token's d_hidden row (2^-9 relative each side).
    bf16 = dtype == torch.bfloat16
    for name, cp_val, ref_val in (
        ("log_prob", lp_cp, lp1),
        ("entropy", ent_cp, ent1),
        ("d_hidden", cp_hidden.grad, full_hidden.grad),
    ):
        assert_close(cp_val, ref_val, name=name, dtype=dtype, rtol=1e-5, elementwise_rtol=2.0**-8 * bf16, track=False)
    # d_weight is a sum over tokens: cp partial sums, each cast to bf16 and added in bf16 (cp casts,
    # cp-1 adds), against one cast of the total: 2·cp roundings of at most half an ulp each, and
    # bf16's half ulp is up to 2^-8 of the value (8 significant bits), of partials of the size of
    # the total (random data), hence relative to the tensor's max. (2^-9 per rounding, the value
    # at the top of a binade, was one ulp short: a seed hit |diff| 0.125 at -21.25.)
    rtol = 2 * cp_size * 2.0**-8 if bf16 else 1e-5
    assert_close(cp_weight.grad, full_weight.grad, name="d_weight", dtype=dtype, rtol=rtol, track=False)
    # And cp=1 itself against the fp64 reference, so the comparison above is not vacuous.
    ref = reference(hidden, weight, labels, 0.7, g, e)
    assert_close(lp1, ref["log_prob"], name="log_prob[cp]", dtype=dtype, rtol=1e-5, track=False)
    assert_close(ent1, ref["entropy"], name="entropy[cp]", dtype=dtype, rtol=1e-5, track=False)
