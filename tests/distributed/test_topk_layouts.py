"""``fused_topk`` under TP 4 (SP off and on) in every layout, and TP 2 × CP 2 (padded and packed),
against the single-rank result and the fp64 full-logits reference.

Every rank draws the global data (``shared_seed``), computes the single-rank result (full weight,
``tp_group=None``, default chunks) and the fp64 reference, then runs on its vocab shard (vocab
shards of 24 or 48 rows in 16-row chunks, token chunks of 10) and, with SP, its sequence shard,
and under CP its load-balanced part. Two kinds of data:

- random (fp64, fp32): log-probs and tails to the single-rank result and to fp64; fp64 ids equal;
  fp32 ids checked through the fp64 log-prob at each id (a near-tie that fp32 rounding decides
  the other way cannot fail the test, a wrong id does);
- integer logits (entries of hidden and weight in {-1, 0, 1}): exact in fp32, most logits tie
  across shards and chunks, so the ids must equal the reference's bitwise (ties to the smaller id).

k ∈ {1, 8, 64, 96 = V} (96 is more than a shard holds: the merge needs every rank's candidates).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, layout_id, shared_seed, tp_cp_groups
from head_cases import HIDDEN, IGNORE, LAYOUT_SHAPES, TEMPERATURE, VOCAB, draw_ids

from mcore_ppo import fused_topk
from mcore_ppo.distill import topk as topk_module
from mcore_ppo_testing.topk_reference import topk_reference
from parallel import roll_and_split_labels, roll_labels, split_for_cp

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

KS = (1, 8, 64, VOCAB)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
KINDS = (("random", torch.float64), ("random", torch.float32), ("integer", torch.float32))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(topk_module, "TOKEN_CHUNK", 10)
    monkeypatch.setattr(topk_module, "VOCAB_CHUNK", 16)


def draw(kind: str, dtype: torch.dtype, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "integer":
        hidden = torch.randint(-1, 2, (*lead, 4)).to(dtype)
        return hidden, torch.randint(-1, 2, (VOCAB, 4)).to(dtype)
    hidden = torch.randn(*lead, HIDDEN, dtype=torch.float64).to(dtype)
    return hidden, (0.5 * torch.randn(VOCAB, HIDDEN, dtype=torch.float64)).to(dtype)


def single_rank(hidden, weight, k, labels, temperature):
    """The one-rank call with the default chunks (one block here)."""
    saved = topk_module.TOKEN_CHUNK, topk_module.VOCAB_CHUNK
    topk_module.TOKEN_CHUNK, topk_module.VOCAB_CHUNK = 2048, 4096
    try:
        return fused_topk(hidden, weight, k, temperature=temperature, labels=labels, tp_group=None)
    finally:
        topk_module.TOKEN_CHUNK, topk_module.VOCAB_CHUNK = saved


def compare(check, out, single, ref, part, kind: str, dtype: torch.dtype, suite: str) -> None:
    """``out`` against the single-rank result and the fp64 reference, both cut to this rank's part."""
    tol = TOL[dtype]
    ids, log_probs, tail = (t.cpu() for t in out)
    single_ids, single_lp, single_tail = (part(t) for t in single)
    ref_ids, ref_lp, ref_tail = part(ref.ids), part(ref.log_probs), part(ref.tail_log_mass)
    check.equal("ids dtype int64", torch.tensor(ids.dtype == torch.int64), torch.tensor(True))
    if kind == "integer" or dtype == torch.float64:
        check.equal("ids vs single-rank", ids, single_ids)
        check.equal("ids vs fp64", ids, ref_ids)
    else:
        # The reference's log-prob at each returned id equals the returned one.
        valid = part(ref.valid)
        safe = torch.where(valid[..., None], ids, torch.zeros_like(ids))
        at_ids = part(ref.full_log_probs).gather(-1, safe)
        at_ids = torch.where(valid[..., None], at_ids, torch.zeros_like(at_ids))
        check.close("fp64 log p at the ids", log_probs.double(), at_ids, tol=tol, kind=f"{suite}: vs fp64")
        check.equal("ignored where the reference is", ids == IGNORE, ref_ids == IGNORE)
    check.close("log_probs", log_probs, single_lp, tol=tol, kind=f"{suite}: vs single-rank")
    check.close("log_probs", log_probs.double(), ref_lp, tol=tol, kind=f"{suite}: vs fp64")
    finite = torch.isfinite(ref_tail)
    check.equal("tail finite where the reference's is", torch.isfinite(tail), finite)
    zero = torch.zeros((), dtype=tail.dtype)
    check.close(
        "tail_log_mass",
        torch.where(finite, tail, zero),
        torch.where(finite, single_tail, zero),
        tol=tol,
        kind=f"{suite}: vs single-rank",
    )
    check.close(
        "tail_log_mass",
        torch.where(finite, tail, zero).double(),
        torch.where(finite, ref_tail, 0.0),
        tol=tol,
        kind=f"{suite}: vs fp64",
    )


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_tp4_layouts_match_single_rank_and_fp64(sp, check):
    tp = 4
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for name, (seq, batch) in LAYOUT_SHAPES.items():
        lead = (seq,) if batch is None else (seq, batch)
        label_shape = (seq,) if batch is None else (batch, seq)
        for kind, dtype in KINDS:
            hidden, weight = draw(kind, dtype, lead)
            labels = draw_ids(seq * (batch or 1)).view(label_shape)
            temperature = 1.0 if kind == "integer" else TEMPERATURE
            for k in KS:
                single = single_rank(hidden, weight, k, labels, temperature)
                ref = topk_reference(hidden, weight, k, temperature, labels, IGNORE)
                if layout.tp_group is None:  # ranks outside the TP group only drew the data
                    continue
                check.case(f"tp={tp} sp={sp} layout={name} {kind} {dtype} k={k}")
                local_hidden = hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else hidden
                out = fused_topk(
                    local_hidden.to(DEVICE),
                    weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                    k,
                    temperature=temperature,
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                    labels=labels.to(DEVICE),
                )
                compare(check, out, single, ref, lambda t: t, kind, dtype, f"TP{tp} sp={sp}")
    check.done()


CP_LAYOUTS = [(2, 2)]


@pytest.mark.parametrize(("tp", "cp"), CP_LAYOUTS, ids=[layout_id(*layout) for layout in CP_LAYOUTS])
def test_tp_cp_match_single_rank_and_fp64(tp, cp, check):
    """Each CP rank holds its load-balanced part of hidden and labels (rolled before the split);
    its outputs are that part of the single-rank outputs on the whole sequence."""
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    for packed in (False, True):
        if packed:
            lengths = (4 * cp, 2 * cp, 6 * cp)
            cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            lead, ids_shape = (cu_seqlens[-1], 1), (1, cu_seqlens[-1])
        else:
            cu_seqlens, lead, ids_shape = None, (16, 2), (2, 16)
        for kind, dtype in KINDS:
            hidden, weight = draw(kind, dtype, lead)
            input_ids = draw_ids(ids_shape[0] * ids_shape[1]).view(ids_shape)
            labels = roll_labels(input_ids, seq_dim=1, cu_seqlens=cu_seqlens)
            temperature = 1.0 if kind == "integer" else TEMPERATURE
            for k in KS:
                single = single_rank(hidden, weight, k, labels, temperature)
                ref = topk_reference(hidden, weight, k, temperature, labels, IGNORE)
                if layout.cp_group is None:
                    continue
                r = layout.cp_rank

                def part(t: torch.Tensor, r=r, cu_seqlens=cu_seqlens) -> torch.Tensor:
                    return split_for_cp(t, cp, r, seq_dim=1, cu_seqlens=cu_seqlens)

                local_hidden = split_for_cp(hidden, cp, r, seq_dim=0, cu_seqlens=cu_seqlens)
                local_labels = roll_and_split_labels(input_ids, cp, r, seq_dim=1, cu_seqlens=cu_seqlens)
                for sp in (False, True):
                    check.case(f"tp={tp} cp={cp} sp={sp} packed={packed} {kind} {dtype} k={k}")
                    shard = local_hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else local_hidden
                    out = fused_topk(
                        shard.to(DEVICE),
                        weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                        k,
                        temperature=temperature,
                        tp_group=layout.tp_group,
                        sequence_parallel=sp,
                        labels=local_labels.to(DEVICE),
                    )
                    compare(check, out, single, ref, part, kind, dtype, f"TP{tp}xCP{cp} sp={sp}")
    check.done()


def test_bad_k_raises_on_every_rank(check):
    """A k over the global vocab (96 = 4 shards of 24) or below 1 raises, naming k, on every TP rank."""
    layout = tp_cp_groups(4)
    torch.manual_seed(shared_seed())
    hidden = torch.randn(8, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN).chunk(4, dim=0)[layout.tp_rank]
    if layout.tp_group is not None:
        check.case("tp=4 k > V")
        check.raises(
            ValueError,
            "k must be <= the global vocab size 96",
            fused_topk,
            hidden,
            weight,
            97,
            tp_group=layout.tp_group,
        )
        check.case("tp=4 k = 0")
        check.raises(ValueError, "k must be in", fused_topk, hidden, weight, 0, tp_group=layout.tp_group)
    check.done()
