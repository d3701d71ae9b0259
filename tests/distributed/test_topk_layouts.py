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

A per-token temperature (a tensor like the labels) under TP 2 (SP off and on) and TP 2 × CP 2
(padded and packed), k ∈ {8, 96}.

The head's statistics from the top-k's own pass (``topk_and_statistics``: verl's top-k
distillation route) under TP 2 and 4 (SP off and on) and TP 2 × CP 2, both shard passes.

The student side (``fused_log_probs_at``: log-probs at k ids per token, with gradients) under
TP 2 (SP off and on) and TP 2 × CP 2 is at the end of the file.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, shared_seed, tp_cp_groups
from head_cases import (
    HIDDEN,
    IGNORE,
    LAYOUT_SHAPES,
    NH,
    TEMPERATURE,
    TOL_FP32_VS_FP64,
    TOL_SAME_DTYPE,
    VOCAB,
    draw_ids,
)

from mcore_ppo import TopKConfig, TorchBackend, TorchConfig, TritonBackend, TritonConfig, fused_log_probs_at, fused_topk
from mcore_ppo.distill import topk_triton
from mcore_ppo.parallel import roll_and_split_labels, roll_labels, split_for_cp
from mcore_ppo.statistics import Statistics
from mcore_ppo.verdict import PEER_REFUSED
from mcore_ppo_testing.student_fold import record_folds
from mcore_ppo_testing.student_reference import student_reference
from mcore_ppo_testing.topk_reference import full_pairs, topk_reference

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

KS = (1, 8, 64, VOCAB)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
KINDS = (("random", torch.float64), ("random", torch.float32), ("integer", torch.float32))


#: The ranks' torch shard pass in small blocks: 10 tokens × 16 vocab rows (several per shard).
SMALL = TopKConfig(token_chunk=10, vocab_chunk=16)


def draw(kind: str, dtype: torch.dtype, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "integer":
        hidden = torch.randint(-1, 2, (*lead, 4)).to(dtype)
        return hidden, torch.randint(-1, 2, (VOCAB, 4)).to(dtype)
    hidden = torch.randn(*lead, HIDDEN, dtype=torch.float64).to(dtype)
    return hidden, (0.5 * torch.randn(VOCAB, HIDDEN, dtype=torch.float64)).to(dtype)


def single_rank(hidden, weight, k, labels, temperature):
    """The one-rank call with the default chunks (one block here)."""
    return fused_topk(hidden, weight, k, temperature=temperature, labels=labels, tp_group=None)


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


# A per-token temperature is a [b, s] ([1, t], [n]) tensor like the labels: the whole sequence
# under SP, this rank's tokens under CP, cut like the labels.
TEMPERATURE_KS = (8, VOCAB)
# (tp, per-token temperature): the float temperature at TP 4, a per-token one at TP 2.
TP_CASES = [(4, False), (2, True)]


def token_temperatures(shape: tuple[int, ...]) -> torch.Tensor:
    """Log-uniform in [0.25, 4], a different value per token (from the shared generator)."""
    return torch.exp((torch.rand(shape, dtype=torch.float64) * 2 - 1) * math.log(4.0)).float()


def case_temperature(kind: str, shape: tuple[int, ...], per_token: bool) -> float | torch.Tensor:
    """A per-token tensor shaped like the labels (drawn after the data), or the float one."""
    if per_token:
        return token_temperatures(shape)
    return 1.0 if kind == "integer" else TEMPERATURE


def local_temperature(temperature: float | torch.Tensor, cut) -> float | torch.Tensor:
    """This rank's temperature argument: a tensor cut like its labels, on its device."""
    return cut(temperature).to(DEVICE) if isinstance(temperature, torch.Tensor) else temperature


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
@pytest.mark.parametrize(("tp", "per_token"), TP_CASES, ids=["tp4", "tp2-per-token-T"])
def test_tp_layouts_match_single_rank_and_fp64(tp, per_token, sp, check):
    """Every layout, SP off and on: against the single-rank call (with the same temperature
    tensor, when per token) and fp64."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    prefix = "per-token T " if per_token else ""
    for name, (seq, batch) in LAYOUT_SHAPES.items():
        lead = (seq,) if batch is None else (seq, batch)
        label_shape = (seq,) if batch is None else (batch, seq)
        for kind, dtype in KINDS:
            hidden, weight = draw(kind, dtype, lead)
            labels = draw_ids(seq * (batch or 1)).view(label_shape)
            temperature = case_temperature(kind, label_shape, per_token)
            for k in TEMPERATURE_KS if per_token else KS:
                single = single_rank(hidden, weight, k, labels, temperature)
                ref = topk_reference(hidden, weight, k, temperature, labels, IGNORE)
                if layout.tp_group is None:  # ranks outside the TP group only drew the data
                    continue
                check.case(f"{prefix}tp={tp} sp={sp} layout={name} {kind} {dtype} k={k}")
                local_hidden = hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else hidden
                out = fused_topk(
                    local_hidden.to(DEVICE),
                    weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                    k,
                    temperature=local_temperature(temperature, lambda t: t),
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                    labels=labels.to(DEVICE),
                    config=SMALL,
                )
                compare(check, out, single, ref, lambda t: t, kind, dtype, f"{prefix}TP{tp} sp={sp}")
    check.done()


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_triton_path_tp2_matches_single_rank_and_fp64(sp, check, monkeypatch):
    """The fused kernels' path (``impl="triton"``: the default on GPUs; Triton's interpreter on
    CPU) under TP 2, ``[n, h]``: each rank's presorted top merged over the ranks. Integer logits
    (ties across the shards), random fp32 logits, and random ones with vocab rows 40..59 (across
    the shards' boundary at 48) boosted so that tiles fill (their whole-tile recompute on both
    ranks); k 8, 24 and 96 = V, against the single-rank torch call and fp64."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the triton path runs CPU tensors only under TRITON_INTERPRET=1")
    recompute = topk_triton._recompute_full_tiles
    full = []  # (row, tile) pairs each call recomputed whole

    def counted(tokens, weight, flags, *args):
        full.append(len(full_pairs(flags)))
        return recompute(tokens, weight, flags, *args)

    monkeypatch.setattr(topk_triton, "_recompute_full_tiles", counted)
    tp, seq = 2, LAYOUT_SHAPES[NH][0]
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for kind, dtype in (("integer", torch.float32), ("random", torch.float32), ("boosted", torch.float32)):
        hidden, weight = draw("random" if kind == "boosted" else kind, dtype, (seq,))
        if kind == "boosted":
            weight[40:60] *= 4.0
        labels = draw_ids(seq)
        temperature = 1.0 if kind == "integer" else TEMPERATURE
        for k in (8, 24, VOCAB):
            single = single_rank(hidden, weight, k, labels, temperature)
            ref = topk_reference(hidden, weight, k, temperature, labels, IGNORE)
            if layout.tp_group is None:
                continue
            check.case(f"triton path tp={tp} sp={sp} {kind} k={k}")
            full.clear()
            out = fused_topk(
                (hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else hidden).to(DEVICE),
                weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                k,
                temperature=temperature,
                tp_group=layout.tp_group,
                sequence_parallel=sp,
                labels=labels.to(DEVICE),
                impl="triton",
            )
            compare(check, out, single, ref, lambda t: t, "integer" if kind == "integer" else "random", dtype,
                    f"triton TP{tp} sp={sp}")  # fmt: skip
            if kind == "boosted" and k == 8:
                check.equal("whole tiles recomputed on this rank", torch.tensor(sum(full) > 0), torch.tensor(True))
    check.done()


def statistics_reference(hidden, weight, temperature) -> dict[str, torch.Tensor]:
    """fp64 ``lse``, entropy and Σπ² per token of ``[n, h]`` rows (``temperature`` a float or ``[n]``)."""
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    z = hidden.double() @ weight.double().t() / t
    lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    return {"lse": lse, "entropy": lse - (p * z).sum(dim=1), "sum_pi_squared": p.square().sum(dim=1)}


#: What the student's top-k pass reduces beside its top-k on verl's route with entropy and Σπ² on.
STUDENT_STATISTICS = Statistics.named(["entropy", "sum_pi_squared"])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("tp", "sp", "cp"), [(2, False, 1), (2, True, 1), (4, False, 1), (4, True, 1), (2, False, 2)],
                         ids=["tp2", "tp2-sp", "tp4", "tp4-sp", "tp2xcp2"])  # fmt: skip
def test_statistics_of_the_topk_pass_match_single_rank_and_fp64(impl, tp, sp, cp, check):
    """``topk_and_statistics``: the head's statistics (``lse``, entropy, Σπ²) reduced by the
    top-k's own pass on each vocab shard and combined over TP, per-token temperature, ``[n, h]``
    rows (under CP each rank's load-balanced part of a packed sequence): against the single-rank
    call on the same rows and fp64; the top-k as ``fused_topk``'s on the same rank."""
    from mcore_ppo.distill.topk import topk_and_statistics

    if impl == "triton":
        pytest.importorskip("triton")
        if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("the triton path runs CPU tensors only under TRITON_INTERPRET=1")
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    seq = 8 * tp * cp
    hidden, weight = draw("random", torch.float32, (seq,))
    hidden[3] *= 30  # a nearly one-hot row
    temperature = token_temperatures((seq,))
    config = SMALL if impl == "torch" else None
    kwargs = dict(statistics=STUDENT_STATISTICS, impl=impl, config=config)
    single_top, single = topk_and_statistics(hidden, weight, 8, temperature=temperature, **kwargs)
    if layout.tp_group is None or (cp > 1 and layout.cp_group is None):
        check.done()
        return
    rows = torch.arange(seq)
    if cp > 1:
        rows = split_for_cp(rows[None], cp, layout.cp_rank, seq_dim=1, cu_seqlens=[0, seq // 2, seq])[0]
    local_hidden, local_t = hidden[rows], temperature[rows]
    check.case(f"{impl} tp={tp} sp={sp} cp={cp}")
    top, finished = topk_and_statistics(
        (local_hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else local_hidden).to(DEVICE),
        weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE), 8, temperature=local_t.to(DEVICE),
        tp_group=layout.tp_group, sequence_parallel=sp, **kwargs,
    )  # fmt: skip
    ref = statistics_reference(local_hidden, weight, local_t)
    for i, name in enumerate(("lse", "entropy", "sum_pi_squared")):
        check.close(
                name, finished[i].cpu(), single[i][rows], tol=TOL_SAME_DTYPE[torch.float32],
                kind=f"topk-pass {name} vs single-rank",
            )  # fmt: skip
        check.close(
                name, finished[i].cpu().double(), ref[name], tol=TOL_FP32_VS_FP64, kind=f"topk-pass {name} vs fp64"
            )  # fmt: skip
    check.equal("ids vs single-rank", top.ids.cpu(), single_top.ids[rows])
    check.done()


@pytest.mark.parametrize("per_token", [False, True], ids=["float-T", "per-token-T"])
def test_tp2_cp2_match_single_rank_and_fp64(per_token, check):
    """TP 2 × CP 2, padded and packed, SP off and on: each CP rank holds its load-balanced part of
    hidden and labels (rolled before the split), and of a per-token temperature, cut like its
    labels; its outputs are that part of the single-rank outputs on the whole sequence."""
    tp, cp = 2, 2
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    prefix = "per-token T " if per_token else ""
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
            temperature = case_temperature(kind, ids_shape, per_token)
            for k in TEMPERATURE_KS if per_token else KS:
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
                    check.case(f"{prefix}tp={tp} cp={cp} sp={sp} packed={packed} {kind} {dtype} k={k}")
                    shard = local_hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else local_hidden
                    out = fused_topk(
                        shard.to(DEVICE),
                        weight.chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                        k,
                        temperature=local_temperature(temperature, part),
                        tp_group=layout.tp_group,
                        sequence_parallel=sp,
                        labels=local_labels.to(DEVICE),
                        config=SMALL,
                    )
                    compare(check, out, single, ref, part, kind, dtype, f"{prefix}TP{tp}xCP{cp} sp={sp}")
    check.done()


def test_bad_temperature_on_one_rank_raises_on_every_rank(check):
    """A temperature tensor of the wrong shape, or with a bad value, on TP rank 1 only: that rank
    raises its own error naming temperature, the other one that another rank rejected its inputs
    (nobody waits in the merge's collectives for a rank that has left)."""
    layout = tp_cp_groups(2)
    torch.manual_seed(shared_seed())
    hidden = torch.randn(8, 2, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN)
    labels = draw_ids(16).view(2, 8)
    if layout.tp_group is None:
        check.done()
        return
    shard = weight.chunk(2, dim=0)[layout.tp_rank]
    good = token_temperatures((2, 8))
    bad_value = good.clone()
    bad_value[1, 3] = float("nan")
    for what, bad, message in (
        ("shape", good.t(), "temperature must be shaped like labels (2, 8)"),
        ("value", bad_value, "temperature values must be finite and >= 0.0001"),
    ):
        check.case(f"tp=2 bad temperature {what} on rank 1")
        mine = bad if layout.tp_rank == 1 else good
        expected = message if layout.tp_rank == 1 else PEER_REFUSED
        check.raises(ValueError, expected, fused_topk, hidden, shard, 8, temperature=mine, labels=labels,
                     tp_group=layout.tp_group, validate=True)  # fmt: skip
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


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
@pytest.mark.parametrize("tp", [2, 4])
def test_bad_argument_on_one_rank_raises_on_every_rank(tp, sp, check):
    """One bad argument on the last TP rank only (k, impl, config, a temperature's shape or
    values, the labels' shape or values, the hidden size, an option or flag): that rank raises
    its own error naming it, every other rank a ValueError that a peer refused its inputs;
    nobody waits in a collective for a rank that has left. A good call afterwards still matches
    the single-rank result on every rank (the group's collectives stay aligned)."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    seq, batch = 8, 2
    hidden = torch.randn(seq, batch, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN)
    labels = draw_ids(seq * batch).view(batch, seq)
    good_t = token_temperatures((batch, seq))
    single = single_rank(hidden, weight, 8, labels, good_t)
    if layout.tp_group is None:
        check.done()
        return
    bad_rank = layout.tp_rank == tp - 1
    local_hidden = hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else hidden
    shard = weight.chunk(tp, dim=0)[layout.tp_rank]
    out_of_vocab = labels.clone()
    out_of_vocab[1, 2] = VOCAB
    nan_t = good_t.clone()
    nan_t[0, 5] = float("nan")
    cases = [
        ("k = 0", dict(k=0), ValueError, "k must be in [1, 128]"),
        ("k > V", dict(k=VOCAB + 1), ValueError, f"k must be <= the global vocab size {VOCAB}"),
        ("k a float", dict(k=8.0), TypeError, "k must be an int"),
        ("impl unknown", dict(impl="cuda"), ValueError, "impl must be one of"),
        ("impl not a str", dict(impl=1), TypeError, "impl must be a str"),
        ("config not a TopKConfig", dict(config="small"), TypeError, "config must be a"),
        ("temperature shape", dict(temperature=good_t.t()), ValueError, "temperature must be shaped like labels"),
        ("temperature value", dict(temperature=nan_t), ValueError, "temperature values must be finite"),
        ("labels shape", dict(labels=labels[:1]), ValueError, "labels must have shape"),
        ("labels value", dict(labels=out_of_vocab), ValueError, f"labels must be in [0, {VOCAB})"),
        ("hidden size", dict(hidden=local_hidden[..., :-1]), ValueError, "hidden size"),
        ("ignore_index not an int", dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (
            "sequence_parallel not a bool",
            dict(sequence_parallel=int(sp)),
            TypeError,
            "sequence_parallel must be a bool",
        ),
        ("validate not a bool", dict(validate="yes"), TypeError, "validate must be a bool or None"),
    ]
    for name, bad, error, message in cases:
        check.case(f"tp={tp} sp={sp} bad {name} on rank {tp - 1}")
        # Value checks on: the verdict is shared on every device (NCCL included).
        args = dict(hidden=local_hidden, weight=shard, k=8, labels=labels, temperature=good_t, validate=True,
                    sequence_parallel=sp)  # fmt: skip
        if bad_rank:
            args |= bad
        check.raises(error if bad_rank else ValueError, message if bad_rank else PEER_REFUSED, fused_topk,
                     args.pop("hidden"), args.pop("weight"), args.pop("k"), tp_group=layout.tp_group,
                     **args)  # fmt: skip
    check.case(f"tp={tp} sp={sp} a good call after the refusals")
    out = fused_topk(local_hidden, shard, 8, temperature=good_t, labels=labels, tp_group=layout.tp_group,
                     sequence_parallel=sp, config=SMALL)  # fmt: skip
    ref = topk_reference(hidden, weight, 8, good_t, labels, IGNORE)
    compare(check, out, single, ref, lambda t: t, "random", torch.float32, f"after refusals TP{tp} sp={sp}")
    check.done()


# --- The student's log-probs at k ids per token (fused_log_probs_at), with gradients ------------
#
# The same global data on every rank; the single-rank call (full weight, tp_group=None) and the
# fp64 full-logits reference (mcore_ppo_testing.student_reference) on the whole batch; then this
# rank's vocab shard (and SP sequence shard, CP part). The ids cover the first and last id of every
# shard (head_cases.draw_ids) with a quarter of the slots ignored; outputs, d_hidden (this rank's
# part) and d_weight (this rank's rows; under CP summed over the CP ranks) are compared.

STUDENT_KS = (8, 64)
STUDENT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def student_case(dtype: torch.dtype, lead: tuple[int, ...], token_shape: tuple[int, ...], k: int) -> dict:
    hidden = torch.randn(*lead, HIDDEN, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(VOCAB, HIDDEN, dtype=torch.float64)).to(dtype)
    count = math.prod(token_shape)
    ids = draw_ids(count * k).view(*token_shape, k)
    g = torch.randn(ids.shape, dtype=torch.float64)
    e = torch.randn(token_shape, dtype=torch.float64)
    return {"hidden": hidden, "weight": weight, "ids": ids, "g": g, "e": e}


def student_run(hidden, weight, ids, g, e, **kwargs) -> dict:
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    log_q, entropy = fused_log_probs_at(hidden, weight, ids, temperature=TEMPERATURE, **kwargs)
    ((log_q * g.to(log_q)).sum() + (entropy * e.to(entropy)).sum()).backward()
    return {"log_q": log_q, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}


def student_compare(check, out: dict, single: dict, ref: dict, dtype: torch.dtype, suite: str) -> None:
    tol = STUDENT_TOL[dtype]
    for name in ("log_q", "entropy", "d_hidden", "d_weight"):
        actual = out[name].detach().cpu()
        check.close(name, actual, single[name].detach(), tol=tol, kind=f"{suite}: vs single-rank")
        check.close(name, actual.double(), ref[name], tol=max(tol, 1e-5 if dtype != torch.float64 else tol),
                    kind=f"{suite}: vs fp64")  # fmt: skip


#: The ranks' backend: on the CPU the torch backend in small blocks (10 tokens × 16 vocab rows)
#: with k-id gathers of fewer than 3 tokens' 64 ids (several chunks per shard and call); on GPUs
#: the default one.
RANK_BACKEND = (
    TorchBackend(TorchConfig(token_chunk=10, vocab_chunk=16, gather_elements=3 * 64 * HIDDEN - 1))
    if DEVICE.type == "cpu"
    else "auto"
)


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_student_tp2_matches_single_rank_and_fp64(sp, check):
    """TP 2 in every layout, SP off and on, fp64 and fp32, k ∈ {8, 64} (64 > a 48-row shard)."""
    tp = 2
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for name, (seq, batch) in LAYOUT_SHAPES.items():
        lead = (seq,) if batch is None else (seq, batch)
        token_shape = (seq,) if batch is None else (batch, seq)
        for dtype in (torch.float64, torch.float32):
            for k in STUDENT_KS:
                case = student_case(dtype, lead, token_shape, k)
                single = student_run(**case, tp_group=None, backend="torch")
                ref = student_reference(case["hidden"], case["weight"], case["ids"], TEMPERATURE, case["g"], case["e"])
                if layout.tp_group is None:
                    continue
                check.case(f"student tp={tp} sp={sp} layout={name} {dtype} k={k}")
                r = layout.tp_rank
                local_hidden = case["hidden"].chunk(tp, dim=0)[r] if sp else case["hidden"]
                out = student_run(
                    local_hidden.to(DEVICE),
                    case["weight"].chunk(tp, dim=0)[r].to(DEVICE),
                    case["ids"].to(DEVICE),
                    case["g"].to(DEVICE),
                    case["e"].to(DEVICE),
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                    backend=RANK_BACKEND,
                )
                for result in (single, ref):
                    if sp:
                        result["d_hidden"] = result["d_hidden"].chunk(tp, dim=0)[r]
                    result["d_weight"] = result["d_weight"].chunk(tp, dim=0)[r]
                student_compare(check, out, single, ref, dtype, f"student TP{tp} sp={sp}")
    check.done()


@pytest.mark.parametrize("mode", ["recompute", "buffer"])
def test_student_fold_on_the_triton_backend_tp2(mode, check, monkeypatch):
    """The triton backend (the default on GPUs; Triton's interpreter on CPU) folds each rank's
    one-hot gradients, at its shard's local ids, into its own ``dz``: TP 2, SP off and on,
    ``[n, h]``, fp32, k 8 with ids at every shard's edges, against the single-rank torch result
    and fp64. The fold must run on every rank."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the triton backend runs CPU tensors only under TRITON_INTERPRET=1")
    folds = record_folds(monkeypatch)
    backend = (
        TritonBackend(TritonConfig(workspace_bytes=1, buffer_budget_bytes=0)) if mode == "recompute"
        else TritonBackend(TritonConfig(buffer_budget_bytes=1 << 30))
    )  # fmt: skip
    tp, k = 2, 8
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    seq = 12
    case = student_case(torch.float32, (seq,), (seq,), k)
    single = student_run(**case, tp_group=None, backend="torch")
    ref = student_reference(case["hidden"], case["weight"], case["ids"], TEMPERATURE, case["g"], case["e"])
    if layout.tp_group is not None:
        r = layout.tp_rank
        for sp in (False, True):
            check.case(f"student fold ({mode}) tp={tp} sp={sp} fp32 k={k}")
            folds.clear()
            out = student_run(
                case["hidden"].chunk(tp, dim=0)[r] if sp else case["hidden"],
                case["weight"].chunk(tp, dim=0)[r],
                case["ids"],
                case["g"],
                case["e"],
                tp_group=layout.tp_group,
                sequence_parallel=sp,
                backend=backend,
            )
            check.equal("the fold ran", torch.tensor(bool(folds)), torch.tensor(True))
            expected = []
            for result in (single, ref):
                local = dict(result)
                local["d_hidden"] = result["d_hidden"].chunk(tp, dim=0)[r] if sp else result["d_hidden"]
                local["d_weight"] = result["d_weight"].chunk(tp, dim=0)[r]
                expected.append(local)
            student_compare(check, out, *expected, torch.float32, f"student fold TP{tp} sp={sp}")
    check.done()


def test_student_tp2_cp2_matches_single_rank_and_fp64(check):
    """TP 2 × CP 2, padded [s, b, h] and packed THD, SP off and on: each CP rank passes its
    load-balanced part of the tokens (and of their ids); d_weight is summed over CP."""
    tp, cp = 2, 2
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    for packed in (False, True):
        if packed:
            lengths = (4 * cp, 2 * cp, 6 * cp)
            cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            lead, token_shape = (cu_seqlens[-1], 1), (1, cu_seqlens[-1])
        else:
            cu_seqlens, lead, token_shape = None, (16, 2), (2, 16)
        for dtype in (torch.float64, torch.float32):
            k = 8
            case = student_case(dtype, lead, token_shape, k)
            single = student_run(**case, tp_group=None, backend="torch")
            ref = student_reference(case["hidden"], case["weight"], case["ids"], TEMPERATURE, case["g"], case["e"])
            if layout.cp_group is None:
                continue
            r = layout.cp_rank

            def part(t: torch.Tensor, r=r, cu_seqlens=cu_seqlens, seq_dim=1) -> torch.Tensor:
                return split_for_cp(t, cp, r, seq_dim=seq_dim, cu_seqlens=cu_seqlens)

            local_hidden = part(case["hidden"], seq_dim=0)
            for sp in (False, True):
                check.case(f"student tp={tp} cp={cp} sp={sp} packed={packed} {dtype} k={k}")
                shard = local_hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else local_hidden
                out = student_run(
                    shard.to(DEVICE),
                    case["weight"].chunk(tp, dim=0)[layout.tp_rank].to(DEVICE),
                    part(case["ids"]).to(DEVICE),
                    part(case["g"]).to(DEVICE),
                    part(case["e"]).to(DEVICE),
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                    backend=RANK_BACKEND,
                )
                dist.all_reduce(out["d_weight"], group=layout.cp_group)
                expected = []
                for result in (single, ref):
                    local = dict(result)
                    local["log_q"], local["entropy"] = part(result["log_q"]), part(result["entropy"])
                    d_hidden = part(result["d_hidden"], seq_dim=0)
                    local["d_hidden"] = d_hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else d_hidden
                    local["d_weight"] = result["d_weight"].chunk(tp, dim=0)[layout.tp_rank]
                    expected.append(local)
                student_compare(check, out, *expected, dtype, f"student TP{tp}xCP{cp} sp={sp}")
    check.done()
