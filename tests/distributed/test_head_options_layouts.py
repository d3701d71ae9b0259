"""Per-token / per-sequence temperature tensors and ``return_entropy=False`` under TP 4 (SP off
and on, every layout) and TP 2 × CP 2 (padded and packed, SP off and on), against the
single-rank result of the same dtype and against the fp64 reference.

The temperature tensor covers the same tokens as the labels: the whole gathered sequence under
SP (it is not sharded with hidden), this rank's CP part under CP, split like the labels
(:func:`mcore_ppo.parallel.split_temperature_for_cp`; a ``[b, 1]`` per-sequence tensor is the same on
every CP rank). Labels cover the first and last id of every vocab shard; the CP data force
distinct labels at every chunk boundary (``test_head_context_parallel.make_cp_case``), and the
per-token temperatures are drawn at random (distinct everywhere), so a temperature paired with
the wrong token shows. With the entropy off, the output is None and the gradients are those of
``Σ g·log_prob`` alone.

Σπ² (``return_sum_pi_squared=True``) under TP 2 and 4 (SP off and on, every layout) and TP 2 ×
CP 2 (padded and packed, SP off and on), against the single-rank result (same dtype) and, for
fp32, the fp64 full-softmax reference: it is combined in the head's one all-reduce SUM
(``Q = Σ_r q_r·e^(2(m_r − M))``), so a missing or wrong rescale of ``q`` shows at every token
whose shard maxima differ; the torch backend's small vocab chunks exercise the same squared
factor inside a rank. Entropy on/off and per-token/float temperatures alternate; the log-probs
and the entropy are compared too (the option must not change them), and a backward of
``Σ g·log_prob`` runs through the Function.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, shared_seed, tp_cp_groups
from head_cases import (
    BACKEND,
    LAYOUT_SHAPES,
    SBH,
    TOL_FP32_VS_FP64,
    TOL_SAME_DTYPE,
    dtype_name,
    make_case,
    small_chunks_backend,
)
from test_head_context_parallel import make_cp_case

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.parallel import split_for_cp, split_temperature_for_cp
from mcore_ppo_testing.reference import reference as fp64_reference
from mcore_ppo_testing.reference import sum_pi_squared_reference

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

# (dtype, temperature kind, return_entropy): each dtype meets both kinds and both entropy
# settings, in four calls per layout instead of eight (2 busy cores, 4 ranks).
COMBOS = (
    (torch.float64, "token", True),
    (torch.float64, "sequence", False),
    (torch.float32, "token", False),
    (torch.float32, "sequence", True),
)


def draw_temperature(labels: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 temperatures in [0.4, 2.0]: ``token`` shaped like labels, ``sequence`` one per row
    (``[b, 1]``; ``[1]`` for ``[n]`` labels)."""
    shape = tuple(labels.shape) if kind == "token" else (*labels.shape[:-1], 1)
    return 0.4 + 1.6 * torch.rand(shape)


def run(hidden, weight, labels, temperature, g, e, *, return_entropy, tp_group=None, sp=False, single=False):
    """Forward + backward through the public API; ``single``: the one-rank torch oracle on the CPU."""
    device = torch.device("cpu") if single else DEVICE
    h = hidden.detach().clone().to(device).requires_grad_(True)
    w = weight.detach().clone().to(device).requires_grad_(True)
    log_prob, entropy = fused_log_probs_and_entropy(
        h,
        w,
        labels.to(device),
        temperature=temperature.to(device),
        tp_group=tp_group,
        sequence_parallel=sp,
        backend=small_chunks_backend("torch" if single else BACKEND),
        return_entropy=return_entropy,
    )
    outputs, grads = [log_prob], [g.to(device=device, dtype=torch.float32)]
    if entropy is not None:
        outputs.append(entropy)
        grads.append(e.to(device=device, dtype=torch.float32))
    torch.autograd.backward(outputs, grads)
    result = {"log_prob": log_prob.detach(), "d_hidden": h.grad, "d_weight": w.grad}
    if entropy is not None:
        result["entropy"] = entropy.detach()
    return result


def exact(hidden, weight, labels, temperature, g, e, *, return_entropy):
    """The fp64 reference (per-token temperature; no entropy term when it is off)."""
    out = fp64_reference(
        hidden.double(), weight.double(), labels, temperature, g.double(), e.double() if return_entropy else None
    )
    keys = ("log_prob", "entropy", "d_hidden", "d_weight") if return_entropy else ("log_prob", "d_hidden", "d_weight")
    return {k: out[k] for k in keys}


def compare(check, actual: dict, expected: dict, tol: float, kind: str) -> None:
    if set(actual) != set(expected):
        check.fail(f"{kind}: outputs {sorted(actual)} != {sorted(expected)} (entropy returned when off?)")
    for name, value in expected.items():
        if name in actual:
            check.close(name, actual[name], value, tol=tol, kind=kind)


@pytest.mark.parametrize("tp", [4])
def test_tp_sp_temperature_tensor_and_entropy_off(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in COMBOS:
        for name in LAYOUT_SHAPES:
            case = make_case(name, dtype)
            temperature = draw_temperature(case.labels, kind)
            args = (case.hidden, case.weight, case.labels, temperature, case.grad_log_prob, case.grad_entropy)
            ref = run(*args, return_entropy=return_entropy, single=True)
            ref64 = exact(*args, return_entropy=return_entropy) if dtype == torch.float32 else None
            if layout.tp_group is None:
                continue
            weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
            for sp in (False, True):
                check.case(f"tp={tp} sp={sp} {name} T per {kind} entropy={return_entropy} {dtype}")
                hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
                out = run(
                    hidden,
                    weight,
                    case.labels,
                    temperature,
                    case.grad_log_prob,
                    case.grad_entropy,
                    return_entropy=return_entropy,
                    tp_group=layout.tp_group,
                    sp=sp,
                )
                suite = f"TP{tp} T tensor{'' if return_entropy else ', entropy off'}"
                for expected, tol, what in (
                    (ref, TOL_SAME_DTYPE[dtype], f"{dtype_name(dtype)} vs single-rank"),
                    (ref64, TOL_FP32_VS_FP64, "float32 vs fp64 reference"),
                ):
                    if expected is not None:
                        compare(check, out, _tp_part(expected, tp, layout.tp_rank, sp), tol, f"{suite}: {what}")
    check.done()


def _tp_part(result: dict, tp: int, tp_rank: int, sp: bool) -> dict:
    part = dict(result)
    part["d_weight"] = result["d_weight"].chunk(tp, dim=0)[tp_rank]
    if sp:
        part["d_hidden"] = result["d_hidden"].chunk(tp, dim=0)[tp_rank]
    return part


@pytest.mark.parametrize(("tp", "cp"), [(2, 2)])
def test_tp_cp_temperature_tensor_and_entropy_off(tp, cp, check):
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in COMBOS:
        for packed in (False, True):
            case, _, cu_seqlens = make_cp_case(packed, cp, dtype)
            if packed and kind == "sequence":
                # One per packed sequence, expanded over its tokens ([1, t]), then split like them.
                lengths = torch.tensor([b - a for a, b in itertools.pairwise(cu_seqlens)])
                temperature = (0.4 + 1.6 * torch.rand(len(lengths))).repeat_interleave(lengths).view(1, -1)
            else:
                temperature = draw_temperature(case.labels, kind)
            args = (case.hidden, case.weight, case.labels, temperature, case.grad_log_prob, case.grad_entropy)
            ref = run(*args, return_entropy=return_entropy, single=True)
            ref64 = exact(*args, return_entropy=return_entropy) if dtype == torch.float32 else None
            if layout.cp_group is None:
                continue
            for sp in (False, True):
                check.case(f"tp={tp} cp={cp} sp={sp} packed={packed} T per {kind} entropy={return_entropy} {dtype}")
                out = _run_cp_rank(case, temperature, cu_seqlens, layout, sp, return_entropy)
                suite = f"TP{tp}xCP{cp} T tensor{'' if return_entropy else ', entropy off'}"
                for expected, tol, what in (
                    (ref, TOL_SAME_DTYPE[dtype], f"{dtype_name(dtype)} vs single-rank"),
                    (ref64, TOL_FP32_VS_FP64, "float32 vs fp64 reference"),
                ):
                    if expected is not None:
                        want = _cp_part(expected, layout, cu_seqlens, sp)
                        compare(check, out, want, tol, f"{suite}: {what}")
    check.done()


def _run_cp_rank(case, temperature, cu_seqlens, layout, sp: bool, return_entropy: bool) -> dict:
    """This rank's call on its CP part (everything split like the tokens); d_weight summed over CP."""
    cp, r = layout.cp_size, layout.cp_rank

    def split(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return split_for_cp(t, cp, r, seq_dim=seq_dim, cu_seqlens=cu_seqlens)

    hidden = split(case.hidden, 0)
    if sp:
        hidden = hidden.chunk(layout.tp_size, dim=0)[layout.tp_rank]
    out = run(
        hidden,
        case.weight.chunk(layout.tp_size, dim=0)[layout.tp_rank],
        split(case.labels, 1),
        split_temperature_for_cp(temperature, cp, r, seq_dim=1, cu_seqlens=cu_seqlens),
        split(case.grad_log_prob, 1),
        split(case.grad_entropy, 1),
        return_entropy=return_entropy,
        tp_group=layout.tp_group,
        sp=sp,
    )
    dist.all_reduce(out["d_weight"], group=layout.cp_group)
    return out


def _cp_part(result: dict, layout, cu_seqlens, sp: bool) -> dict:
    def split(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return split_for_cp(t, layout.cp_size, layout.cp_rank, seq_dim=seq_dim, cu_seqlens=cu_seqlens)

    part = {name: split(value, 1) for name, value in result.items() if name in ("log_prob", "entropy")}
    d_hidden = split(result["d_hidden"], 0)
    part["d_hidden"] = d_hidden.chunk(layout.tp_size, dim=0)[layout.tp_rank] if sp else d_hidden
    part["d_weight"] = result["d_weight"].chunk(layout.tp_size, dim=0)[layout.tp_rank]
    return part


def test_sbh_temperature_paired_with_the_wrong_token_is_caught(check):
    """The data can catch a temperature transposed against the labels ([b, s] read as [s, b])."""
    torch.manual_seed(shared_seed())
    case = make_case(SBH, torch.float64)
    temperature = draw_temperature(case.labels, "token")
    args = (case.hidden, case.weight, case.labels)
    right = run(*args, temperature, case.grad_log_prob, case.grad_entropy, return_entropy=True, single=True)
    wrong_t = temperature.t().reshape(case.labels.shape)
    wrong = run(*args, wrong_t, case.grad_log_prob, case.grad_entropy, return_entropy=True, single=True)
    if torch.allclose(right["log_prob"], wrong["log_prob"]):
        check.fail("a mis-paired temperature gives the same log-probs: the data cannot catch it")
    check.done()


# (dtype, temperature kind, return_entropy): both dtypes meet both kinds and both entropy settings.
SP_COMBOS = (
    (torch.float64, "token", True),
    (torch.float64, "float", False),
    (torch.float32, "token", False),
    (torch.float32, "float", True),
)


def _sp_temperature(labels: torch.Tensor, kind: str) -> float | torch.Tensor:
    return 0.7 if kind == "float" else 0.4 + 1.6 * torch.rand(labels.shape)


def run_sp(hidden, weight, labels, temperature, g, *, return_entropy, tp_group=None, sp=False, single=False) -> dict:
    """Forward with Σπ² and a backward of ``Σ g·log_prob``; ``single``: the one-rank torch oracle on the CPU."""
    device = torch.device("cpu") if single else DEVICE
    h = hidden.detach().clone().to(device).requires_grad_(True)
    w = weight.detach().clone().to(device).requires_grad_(True)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device)
    log_prob, entropy, sum_pi_squared = fused_log_probs_and_entropy(
        h, w, labels.to(device), temperature=temperature, tp_group=tp_group, sequence_parallel=sp,
        backend=small_chunks_backend("torch" if single else BACKEND), return_entropy=return_entropy,
        return_sum_pi_squared=True,
    )  # fmt: skip
    assert not sum_pi_squared.requires_grad
    (log_prob * g.to(device=device, dtype=log_prob.dtype)).sum().backward()
    out = {"log_prob": log_prob.detach(), "sum_pi_squared": sum_pi_squared}
    if entropy is not None:
        out["entropy"] = entropy.detach()
    return out


def _compare_sp(check, actual: dict, expected: dict, expected64: torch.Tensor | None, dtype, suite: str) -> None:
    if set(actual) != set(expected):
        check.fail(f"{suite}: outputs {sorted(actual)} != {sorted(expected)}")
    for name, value in expected.items():
        if name in actual:
            check.close(
                name,
                actual[name],
                value,
                tol=TOL_SAME_DTYPE[dtype],
                kind=f"{suite}: {dtype_name(dtype)} vs single-rank",
            )
    if expected64 is not None:
        check.close(
            "sum_pi_squared", actual["sum_pi_squared"], expected64, tol=TOL_FP32_VS_FP64,
            kind=f"{suite}: float32 vs fp64 reference",
        )  # fmt: skip


def _single_rank_references(case, temperature, dtype, return_entropy):
    """The single-rank outputs of ``case`` and, for fp32 inputs, the fp64 Σπ² from the full logits."""
    args = (case.hidden, case.weight, case.labels, temperature, case.grad_log_prob)
    ref = run_sp(*args, return_entropy=return_entropy, single=True)
    ref64 = None
    if dtype == torch.float32:
        ref64 = sum_pi_squared_reference(case.hidden, case.weight, case.labels, temperature)
    return ref, ref64


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sp_sum_pi_squared(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in SP_COMBOS:
        for name in LAYOUT_SHAPES:
            case = make_case(name, dtype)
            temperature = _sp_temperature(case.labels, kind)
            ref, ref64 = _single_rank_references(case, temperature, dtype, return_entropy)
            if layout.tp_group is None:
                continue
            weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
            for sp in (False, True):
                check.case(f"tp={tp} sp={sp} {name} T {kind} entropy={return_entropy} {dtype}")
                hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
                out = run_sp(
                    hidden, weight, case.labels, temperature, case.grad_log_prob, return_entropy=return_entropy,
                    tp_group=layout.tp_group, sp=sp,
                )  # fmt: skip
                _compare_sp(check, out, ref, ref64, dtype, f"TP{tp} sum_pi_squared")
    check.done()


@pytest.mark.parametrize(("tp", "cp"), [(2, 2)])
def test_tp_cp_sum_pi_squared(tp, cp, check):
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in SP_COMBOS:
        for packed in (False, True):
            case, _, cu_seqlens = make_cp_case(packed, cp, dtype)
            temperature = _sp_temperature(case.labels, kind)
            ref, ref64 = _single_rank_references(case, temperature, dtype, return_entropy)
            if layout.cp_group is None:
                continue

            def split(t, seq_dim: int, cu_seqlens=cu_seqlens):
                return split_for_cp(t, cp, layout.cp_rank, seq_dim=seq_dim, cu_seqlens=cu_seqlens)

            want = {name: split(value, 1) for name, value in ref.items()}
            want64 = None if ref64 is None else split(ref64, 1)
            for sp in (False, True):
                check.case(f"tp={tp} cp={cp} sp={sp} packed={packed} T {kind} entropy={return_entropy} {dtype}")
                hidden = split(case.hidden, 0)
                if sp:
                    hidden = hidden.chunk(tp, dim=0)[layout.tp_rank]
                rank_temperature = temperature
                if isinstance(temperature, torch.Tensor):
                    rank_temperature = split_temperature_for_cp(
                        temperature, cp, layout.cp_rank, seq_dim=1, cu_seqlens=cu_seqlens
                    )
                out = run_sp(
                    hidden, case.weight.chunk(tp, dim=0)[layout.tp_rank], split(case.labels, 1), rank_temperature,
                    split(case.grad_log_prob, 1), return_entropy=return_entropy, tp_group=layout.tp_group, sp=sp,
                )  # fmt: skip
                _compare_sp(check, out, want, want64, dtype, f"TP{tp}xCP{cp} sum_pi_squared")
    dist.barrier()
    check.done()
