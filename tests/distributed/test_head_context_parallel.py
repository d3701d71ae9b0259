"""The head under CP 2, TP 2 × CP 2, and (8 ranks) TP 4 × CP 2 and TP 2 × CP 4, padded and packed,
against the single-rank result.

The global batch (input ids, hidden) is drawn on every rank; the reference runs the head on it
with ``labels = roll_labels(input_ids)``. Each CP rank keeps ``split_for_cp(hidden)`` and
``roll_and_split_labels(input_ids)`` (Megatron's load-balanced split: chunks r and 2cp-1-r of
every sequence), takes its TP weight shard (and SP sequence shard within the TP group), and its
outputs and d_hidden must equal ``split_for_cp`` of the reference's. Weight gradients of the
CP ranks are summed over the CP group (as Megatron's gradient reduction does) and must equal
the reference's shard.

The labels on both sides of every chunk boundary are forced distinct, so rolling after the
split (the bug CP users hit) would change them; the test checks that it would. TP 2 × CP 2 also
runs under ``precision="fp32_faithful"`` and ``"ieee"`` with an fp32 weight.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import layout_id, shared_seed, tp_cp_groups
from head_cases import (
    DTYPES,
    HIDDEN,
    VOCAB,
    GlobalCase,
    HeadResult,
    compare,
    compare_with_fp64,
    draw_ids,
    reference,
    run_head,
    signed_grads,
    upcast,
)

from mcore_ppo.parallel import roll_and_split_labels, roll_labels, split_for_cp

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

PADDED_BATCH, PADDED_SEQ = 2, 16
CP_LAYOUTS = [(1, 2), (2, 2), (4, 2), (2, 4)]  # (tp, cp); the last two need a world of 8


def packed_lengths(cp: int) -> tuple[int, ...]:
    """Packed sequences of different lengths, each a multiple of 2·cp, one of exactly 2·cp
    (CP 2: 8, 4, 12 tokens); the padded rows (16) divide by 2·cp up to CP 4."""
    return (4 * cp, 2 * cp, 6 * cp)


def sequence_bounds(packed: bool, cp: int) -> list[tuple[int, int]]:
    """(start, end) of every sequence in the flattened [b·s] / [t] positions of input_ids."""
    if packed:
        lengths = packed_lengths(cp)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return [(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    return [(r * PADDED_SEQ, (r + 1) * PADDED_SEQ) for r in range(PADDED_BATCH)]


def make_cp_case(packed: bool, cp: int, dtype: torch.dtype) -> tuple[GlobalCase, torch.Tensor, list[int] | None]:
    """Global data of a CP case: the case (labels = rolled input ids), input_ids, cu_seqlens."""
    bounds = sequence_bounds(packed, cp)
    num = bounds[-1][1]
    distinct, starts = [], []
    for start, end in bounds:
        chunk = (end - start) // (2 * cp)
        starts.append(start)
        for k in range(1, 2 * cp):
            # ids at these positions are the labels of the last token of chunk k-1 and of the
            # first token of chunk k.
            distinct.extend(p for p in (start + k * chunk, start + k * chunk + 1) if p < end)
    # A sequence's first id is nobody's label: shard boundary ids must go elsewhere.
    ids = draw_ids(num, distinct_at=distinct, unusable=starts)
    if packed:
        input_ids = ids.view(1, num)
        cu_seqlens = [0] + [end for _, end in bounds]
        hidden = torch.randn(num, 1, HIDDEN, dtype=torch.float64)
    else:
        input_ids = ids.view(PADDED_BATCH, PADDED_SEQ)
        cu_seqlens = None
        hidden = torch.randn(PADDED_SEQ, PADDED_BATCH, HIDDEN, dtype=torch.float64)
    weight = 0.5 * torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    labels = roll_labels(input_ids, seq_dim=1, cu_seqlens=cu_seqlens)
    shape = tuple(input_ids.shape)
    case = GlobalCase(
        "thd" if packed else "sbh",
        hidden.to(dtype),
        weight.to(dtype),
        labels,
        signed_grads(shape, dtype),
        signed_grads(shape, dtype),
    )
    return case, input_ids, cu_seqlens


def cp_part(result: HeadResult, layout, cu_seqlens, sequence_parallel: bool) -> HeadResult:
    """What rank (cp_rank, tp_rank) should hold of the global result (d_weight: its TP shard of
    the full gradient, to be compared with the CP-summed one)."""

    def split(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return split_for_cp(t, layout.cp_size, layout.cp_rank, seq_dim=seq_dim, cu_seqlens=cu_seqlens)

    d_hidden = split(result.d_hidden, 0)
    if sequence_parallel:
        d_hidden = d_hidden.chunk(layout.tp_size, dim=0)[layout.tp_rank]
    return HeadResult(
        split(result.log_prob, 1),
        split(result.entropy, 1),
        d_hidden,
        result.d_weight.chunk(layout.tp_size, dim=0)[layout.tp_rank],
    )


def run_cp_rank(
    case: GlobalCase, input_ids, cu_seqlens, layout, sequence_parallel: bool, precision: str | None = None
) -> HeadResult:
    """This rank's head call on its CP part (``precision`` None: the API's default); d_weight
    summed over the CP group."""
    cp, r = layout.cp_size, layout.cp_rank
    hidden = split_for_cp(case.hidden, cp, r, seq_dim=0, cu_seqlens=cu_seqlens)
    if sequence_parallel:
        hidden = hidden.chunk(layout.tp_size, dim=0)[layout.tp_rank]
    labels = roll_and_split_labels(input_ids, cp, r, seq_dim=1, cu_seqlens=cu_seqlens)
    grad_log_prob = split_for_cp(case.grad_log_prob, cp, r, seq_dim=1, cu_seqlens=cu_seqlens)
    grad_entropy = split_for_cp(case.grad_entropy, cp, r, seq_dim=1, cu_seqlens=cu_seqlens)
    weight = case.weight.chunk(layout.tp_size, dim=0)[layout.tp_rank]
    out = run_head(
        hidden,
        weight,
        labels,
        grad_log_prob,
        grad_entropy,
        tp_group=layout.tp_group,
        sequence_parallel=sequence_parallel,
        **({} if precision is None else {"precision": precision}),
    )
    dist.all_reduce(out.d_weight, group=layout.cp_group)
    return out


@pytest.mark.parametrize(("tp", "cp"), CP_LAYOUTS, ids=[layout_id(*layout) for layout in CP_LAYOUTS])
def test_cp_matches_single_rank(tp, cp, check):
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    suite = f"TP{tp}xCP{cp}" if tp > 1 else f"CP{cp}"
    for dtype in DTYPES:
        for packed in (False, True):
            case, input_ids, cu_seqlens = make_cp_case(packed, cp, dtype)
            ref = reference(case)
            ref64 = reference(upcast(case)) if dtype == torch.float32 else None
            if layout.cp_group is None:
                continue
            # The data must be able to catch a roll after the split.
            local_ids = split_for_cp(input_ids, cp, layout.cp_rank, seq_dim=1, cu_seqlens=cu_seqlens)
            local_cu = None if cu_seqlens is None else [c // cp for c in cu_seqlens]
            wrong = roll_labels(local_ids, seq_dim=1, cu_seqlens=local_cu)
            right = roll_and_split_labels(input_ids, cp, layout.cp_rank, seq_dim=1, cu_seqlens=cu_seqlens)
            if torch.equal(wrong, right):
                check.fail("rolling after the split gives the same labels: the data cannot catch that bug")
            for sp in (False, True) if tp > 1 else (False,):
                check.case(f"tp={tp} cp={cp} sp={sp} packed={packed} {dtype}")
                out = run_cp_rank(case, input_ids, cu_seqlens, layout, sp)
                compare(check, out, cp_part(ref, layout, cu_seqlens, sp), dtype, suite)
                if ref64 is not None:
                    compare_with_fp64(check, out, cp_part(ref64, layout, cu_seqlens, sp), suite)
    check.done()


def test_tp_cp_precisions_match_single_rank(check):
    """TP 2 × CP 2, padded and packed, SP off and on: an fp32 weight with an fp32 or a bf16
    hidden (upcast once before the op) under ``fp32_faithful`` and ``ieee``, against the
    single-rank result of the same inputs and precision and the fp64 result of the same values."""
    layout = tp_cp_groups(2, 2)
    torch.manual_seed(shared_seed())
    suite = "TP2xCP2 precision"
    for precision in ("fp32_faithful", "ieee"):
        for hidden_dtype in (torch.float32, torch.bfloat16):
            for packed in (False, True):
                case, input_ids, cu_seqlens = make_cp_case(packed, 2, torch.float32)
                case = dataclasses.replace(case, hidden=case.hidden.to(hidden_dtype))
                ref = reference(case, precision=precision)
                ref64 = reference(upcast(case))
                if layout.cp_group is None:
                    continue
                for sp in (False, True):
                    check.case(f"tp=2 cp=2 sp={sp} packed={packed} hidden {hidden_dtype} precision={precision}")
                    out = run_cp_rank(case, input_ids, cu_seqlens, layout, sp, precision)
                    assert out.d_hidden.dtype == hidden_dtype and out.d_weight.dtype == torch.float32
                    want, want64 = cp_part(ref, layout, cu_seqlens, sp), cp_part(ref64, layout, cu_seqlens, sp)
                    for key, value in out.as_dict().items():
                        # A bf16 d_hidden is the fp32 sum rounded once: one bf16 ulp where sums differ.
                        tol = 1e-2 if key == "d_hidden" and hidden_dtype == torch.bfloat16 else 1e-5
                        check.close(key, value, want.as_dict()[key], tol=tol, kind=f"{suite}: vs single-rank")
                        check.close(key, value, want64.as_dict()[key], tol=tol, kind=f"{suite}: vs fp64")
    check.done()


def test_cp_deterministic(check):
    """TP 2 × CP 2, packed, SP on and off, fp32: the same call twice is bitwise equal."""
    layout = tp_cp_groups(2, 2)
    if layout.cp_group is None:  # a rank outside this layout
        check.done()
        return
    torch.manual_seed(shared_seed())
    case, input_ids, cu_seqlens = make_cp_case(True, 2, torch.float32)
    for sp in (False, True):
        check.case(f"tp=2 cp=2 sp={sp} packed float32 twice")
        first = run_cp_rank(case, input_ids, cu_seqlens, layout, sp)
        second = run_cp_rank(case, input_ids, cu_seqlens, layout, sp)
        for output, value in first.as_dict().items():
            check.equal(output, second.as_dict()[output], value)
    check.done()
