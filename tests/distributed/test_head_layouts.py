"""The head under TP 2, 4 and 8 (8 where the world has 8 ranks), SP off and on, in every layout,
against the single-rank result; and under ``precision="fp32_faithful"`` / ``"ieee"`` with an fp32
weight and an fp32 or bf16 hidden (the triton backend's fp16 parts on NCCL runs).

For each TP size, dtype (fp64, fp32) and layout ([s,b,h]+[b,s] with b=3, packed [t,1,h]+[1,t],
[n,h]+[n]), every rank computes the single-rank result on the global data, then runs the head
on its vocab shard (and, with SP, its sequence shard of hidden) and compares log_prob, entropy,
d_hidden (the SP shard under SP) and its weight shard's gradient. Labels cover the first and
last id of every shard, ignored labels are sprinkled, upstream gradients are per token and of
both signs, T = 0.7. fp32 results are also compared with the fp64 result on the same data.
"""

import dataclasses

import pytest
import torch
from conftest import shared_seed, tp_cp_groups
from head_cases import (
    BACKEND,
    DTYPES,
    LAYOUT_SHAPES,
    NH,
    SBH,
    THD,
    TP_SIZES,
    GlobalCase,
    compare,
    compare_with_fp64,
    make_case,
    reference,
    run_head,
    small_chunks_backend,
    tp_part,
    upcast,
)

from mcore_ppo import execution, head_call

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tp_sp_layouts_match_single_rank(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    suite = f"TP{tp}"
    for dtype in DTYPES:
        for name in LAYOUT_SHAPES:
            case = make_case(name, dtype)
            ref = reference(case)
            ref64 = reference(upcast(case)) if dtype == torch.float32 else None
            if layout.tp_group is None:  # ranks outside this TP group only drew the data
                continue
            weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
            for sp in (False, True):
                check.case(f"tp={tp} sp={sp} layout={name} {dtype}")
                hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
                out = run_head(
                    hidden,
                    weight,
                    case.labels,
                    case.grad_log_prob,
                    case.grad_entropy,
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                )
                compare(check, out, tp_part(ref, tp, layout.tp_rank, sp), dtype, suite)
                if ref64 is not None:
                    compare_with_fp64(check, out, tp_part(ref64, tp, layout.tp_rank, sp), suite)
    check.done()


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tp_only_log_prob_used(tp, check):
    """Entropy unused (its upstream gradient None): the SP scatter / TP reduction still happen once."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for dtype in DTYPES:
        case = make_case(SBH, dtype)
        ref = reference(case, use_entropy=False)
        if layout.tp_group is None:
            continue
        weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
        for sp in (False, True):
            check.case(f"tp={tp} sp={sp} layout={SBH} {dtype} log_prob only")
            hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
            args = (hidden, weight, case.labels, case.grad_log_prob, None)
            out = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            compare(check, out, tp_part(ref, tp, layout.tp_rank, sp), dtype, f"TP{tp} log_prob only")
    check.done()


@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_head_matches_single_rank(tp, check):
    """``torch.compile(fused_log_probs_and_entropy, fullgraph=True)`` with default options (one
    graph: the TP collectives run inside the head's ops) at TP 1 and TP 2, SP off and on, equals
    the single-rank result in outputs and gradients."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    torch._dynamo.reset()
    case = make_case(SBH, torch.float32)
    ref = reference(case)
    if layout.tp_group is None:  # ranks outside this TP group only drew the data
        check.done()
        return
    weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
    for sp in (False, True) if tp > 1 else (False,):
        check.case(f"tp={tp} sp={sp} layout={SBH} float32 compiled")
        hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
        args = (hidden, weight, case.labels, case.grad_log_prob, case.grad_entropy)
        out = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp, compiled=True)
        compare(check, out, tp_part(ref, tp, layout.tp_rank, sp), torch.float32, f"TP{tp} compiled")
    check.done()


def test_tp_deterministic(check):
    """The same call twice gives bitwise equal outputs and gradients (TP 4 with and without SP)."""
    tp = 4
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for name in LAYOUT_SHAPES:
        case = make_case(name, torch.float32)
        if layout.tp_group is None:  # ranks past the first 4 of a larger world
            continue
        weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
        for sp in (False, True):
            check.case(f"tp={tp} sp={sp} layout={name} float32 twice")
            hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
            args = (hidden, weight, case.labels, case.grad_log_prob, case.grad_entropy)
            first = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            second = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            for output, value in first.as_dict().items():
                check.equal(output, second.as_dict()[output], value)
    check.done()


# Fewer tokens of the same layout (every sequence length still divides by 8, for SP at TP 8).
SHORTER = {SBH: 8, THD: 16, NH: 24}


def _shorter(case: GlobalCase) -> GlobalCase:
    """The case's first tokens, in its own layout."""
    keep = SHORTER[case.layout]
    if case.labels.dim() == 1:
        return GlobalCase(case.layout, case.hidden[:keep], case.weight, *(t[:keep] for t in _per_token(case)))
    return GlobalCase(case.layout, case.hidden[:keep], case.weight, *(t[:, :keep] for t in _per_token(case)))


def _per_token(case: GlobalCase) -> tuple[torch.Tensor, ...]:
    return case.labels, case.grad_log_prob, case.grad_entropy


@pytest.mark.parametrize("tp", TP_SIZES)
def test_prepared_calls_match_single_rank(tp, check, monkeypatch):
    """With ``validate=False`` the verdict is shared once per group and call signature, so a later
    call of a signature is prepared (``execution.Prepared``: no checks, no collective before the
    head's own): each layout, SP off and on, called with its tokens, then fewer, then again with
    its tokens, every call equal to the single-rank result."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    monkeypatch.setattr(execution, "_PREPARED", {})
    checked: list[int] = []
    check_call = head_call.check_call
    monkeypatch.setattr(head_call, "check_call", lambda *a, **k: checked.append(1) or check_call(*a, **k))
    backend = small_chunks_backend(BACKEND)  # one object: one options object, one signature
    for name in LAYOUT_SHAPES:
        case = make_case(name, torch.float32)
        cases = (case, _shorter(case), case)
        refs = [reference(each) for each in cases]
        if layout.tp_group is None:  # ranks outside this TP group only drew the data
            continue
        weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
        for sp in (False, True):
            execution._PREPARED.clear()  # [s, b, h] and packed share a signature: b is a token count
            before = len(checked)
            for step, (each, ref) in enumerate(zip(cases, refs, strict=True)):
                check.case(f"tp={tp} sp={sp} layout={name} float32 call {step} prepared")
                hidden = each.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else each.hidden
                args = (hidden, weight, each.labels, each.grad_log_prob, each.grad_entropy)
                out = run_head(
                    *args, tp_group=layout.tp_group, sequence_parallel=sp, backend=backend, small_chunks=False,
                    validate=False,
                )  # fmt: skip
                compare(check, out, tp_part(ref, tp, layout.tp_rank, sp), torch.float32, f"TP{tp} prepared")
            check.equal("checked calls", torch.tensor(len(checked) - before), torch.tensor(1))
    check.done()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sp_precisions_match_single_rank(tp, check):
    """fp32 weight with an fp32 or a bf16 hidden (upcast once before the op) under
    ``fp32_faithful`` and ``ieee``, SP off and on, every layout: against the single-rank result
    of the same inputs and precision, and against the fp64 result of the same values."""
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    suite = f"TP{tp} precision"
    for precision in ("fp32_faithful", "ieee"):
        for hidden_dtype in (torch.float32, torch.bfloat16):
            for name in LAYOUT_SHAPES:
                case = make_case(name, torch.float32)
                case = dataclasses.replace(case, hidden=case.hidden.to(hidden_dtype))
                ref = reference(case, precision=precision)
                ref64 = reference(upcast(case))
                if layout.tp_group is None:
                    continue
                weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
                for sp in (False, True):
                    check.case(f"tp={tp} sp={sp} layout={name} hidden {hidden_dtype} precision={precision}")
                    hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
                    out = run_head(
                        hidden, weight, case.labels, case.grad_log_prob, case.grad_entropy,
                        tp_group=layout.tp_group, sequence_parallel=sp, precision=precision,
                    )  # fmt: skip
                    assert out.d_hidden.dtype == hidden_dtype and out.d_weight.dtype == torch.float32
                    want, want64 = tp_part(ref, tp, layout.tp_rank, sp), tp_part(ref64, tp, layout.tp_rank, sp)
                    for key, value in out.as_dict().items():
                        # A bf16 d_hidden is the fp32 sum rounded once: one bf16 ulp where sums differ.
                        tol = 1e-2 if key == "d_hidden" and hidden_dtype == torch.bfloat16 else 1e-5
                        check.close(key, value, want.as_dict()[key], tol=tol, kind=f"{suite}: vs single-rank")
                        check.close(key, value, want64.as_dict()[key], tol=tol, kind=f"{suite}: vs fp64")
    check.done()
