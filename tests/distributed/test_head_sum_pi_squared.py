"""Σπ² (``return_sum_pi_squared=True``) over TP 2 and 4 (SP off and on, every layout) and
TP 2 × CP 2 (padded and packed, SP off and on), against the single-rank result on the same data
(same dtype) and, for fp32, against the fp64 full-softmax reference.

Σπ² is combined in the head's one all-reduce SUM (``Q = Σ_r q_r·e^(2(m_r − M))``) and divided
by ``S²``: a missing or wrong rescale of ``q`` shows at every token whose shard maxima differ.
Labels cover the first and last id of every vocab shard (``head_cases.draw_ids``); the torch
backend runs with small vocab chunks (``head_cases.small_chunks_backend``), so the chunk merge
inside a rank (the same squared factor) is exercised too. Entropy on and off and per-token /
float temperatures alternate over the cases. The log-probs and the entropy are compared too (the
option must not change them), and a backward of ``Σ g·log_prob`` runs through the Function.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, shared_seed, tp_cp_groups
from head_cases import (
    BACKEND,
    LAYOUT_SHAPES,
    TOL_FP32_VS_FP64,
    TOL_SAME_DTYPE,
    dtype_name,
    make_case,
    small_chunks_backend,
)
from test_head_context_parallel import make_cp_case

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo_testing.reference import sum_pi_squared_reference
from parallel import split_for_cp, split_temperature_for_cp

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

# (dtype, temperature kind, return_entropy): both dtypes meet both kinds and both entropy settings.
COMBOS = (
    (torch.float64, "token", True),
    (torch.float64, "float", False),
    (torch.float32, "token", False),
    (torch.float32, "float", True),
)


def _temperature(labels: torch.Tensor, kind: str) -> float | torch.Tensor:
    return 0.7 if kind == "float" else 0.4 + 1.6 * torch.rand(labels.shape)


def run(hidden, weight, labels, temperature, g, *, return_entropy, tp_group=None, sp=False, single=False) -> dict:
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


def _compare(check, actual: dict, expected: dict, expected64: torch.Tensor | None, dtype, suite: str) -> None:
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


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sp_sum_pi_squared(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in COMBOS:
        for name in LAYOUT_SHAPES:
            case = make_case(name, dtype)
            temperature = _temperature(case.labels, kind)
            args = (case.hidden, case.weight, case.labels, temperature, case.grad_log_prob)
            ref = run(*args, return_entropy=return_entropy, single=True)
            ref64 = None
            if dtype == torch.float32:
                ref64 = sum_pi_squared_reference(case.hidden, case.weight, case.labels, temperature)
            if layout.tp_group is None:
                continue
            weight = case.weight.chunk(tp, dim=0)[layout.tp_rank]
            for sp in (False, True):
                check.case(f"tp={tp} sp={sp} {name} T {kind} entropy={return_entropy} {dtype}")
                hidden = case.hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else case.hidden
                out = run(
                    hidden, weight, case.labels, temperature, case.grad_log_prob, return_entropy=return_entropy,
                    tp_group=layout.tp_group, sp=sp,
                )  # fmt: skip
                _compare(check, out, ref, ref64, dtype, f"TP{tp} sum_pi_squared")
    check.done()


@pytest.mark.parametrize(("tp", "cp"), [(2, 2)])
def test_tp_cp_sum_pi_squared(tp, cp, check):
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    for dtype, kind, return_entropy in COMBOS:
        for packed in (False, True):
            case, _, cu_seqlens = make_cp_case(packed, cp, dtype)
            temperature = _temperature(case.labels, kind)
            args = (case.hidden, case.weight, case.labels, temperature, case.grad_log_prob)
            ref = run(*args, return_entropy=return_entropy, single=True)
            ref64 = None
            if dtype == torch.float32:
                ref64 = sum_pi_squared_reference(case.hidden, case.weight, case.labels, temperature)
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
                out = run(
                    hidden, case.weight.chunk(tp, dim=0)[layout.tp_rank], split(case.labels, 1), rank_temperature,
                    split(case.grad_log_prob, 1), return_entropy=return_entropy, tp_group=layout.tp_group, sp=sp,
                )  # fmt: skip
                _compare(check, out, want, want64, dtype, f"TP{tp}xCP{cp} sum_pi_squared")
    dist.barrier()
    check.done()
