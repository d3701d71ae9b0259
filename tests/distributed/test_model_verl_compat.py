"""verl's contract under TP: ``linear_cross_entropy`` with a TP group returns the full-vocab values on
every rank, and a *partial* ``d_hidden`` (this rank's vocab shard's contribution) that the
caller reduces over TP (verl's Megatron path does it with the SP gather's reduce-scatter)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import DEVICE, fitting, shared_seed, tp_cp_groups
from head_cases import BACKEND

from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from parallel.mappings import gather_sequence_parallel


def _reference(hidden, weight, labels, temperature):
    log_softmax = torch.log_softmax(hidden.reshape(-1, hidden.shape[-1]) @ weight.t() / temperature, dim=-1)
    lp = log_softmax.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    return lp, -(log_softmax.exp() * log_softmax).sum(-1)


def test_verl_compat_tp_values_and_partial_d_hidden(check):
    torch.manual_seed(shared_seed())
    s, b, h, vocab, temperature = 8, 2, 16, 64, 0.8
    hidden = torch.randn(s, b, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (s, b))
    g_lp, g_ent = torch.randn(s * b, dtype=torch.float64), torch.randn(s * b, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, temperature)
    ref_dh, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_h, ref_w))
    hidden, weight, labels, g_lp, g_ent = (t.to(DEVICE) for t in (hidden, weight, labels, g_lp, g_ent))
    kind = "verl linear_cross_entropy vs fp64"
    for tp in fitting((2, 4, 8), lambda tp: tp, lambda tp: f"TP{tp}"):
        layout = tp_cp_groups(tp)
        if layout.tp_group is None:
            continue
        check.case(f"tp={tp}")
        x = hidden.clone().requires_grad_()
        shard = weight.chunk(tp)[layout.tp_rank].clone().requires_grad_()
        lp, ent = linear_cross_entropy(x, shard, labels, temperature, "none", layout.tp_group, backend=BACKEND)
        check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
        check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        check.close("d_weight", shard.grad, ref_dw.chunk(tp)[layout.tp_rank], tol=1e-12, kind=kind)
        partial = x.grad.clone()
        if torch.allclose(partial.cpu(), ref_dh):
            check.fail("d_hidden came back reduced over TP; verl's contract is the partial")
        dist.all_reduce(partial, group=layout.tp_group)
        check.close("d_hidden (partial, all-reduced)", partial, ref_dh, tol=1e-12, kind=kind)

        # verl's Megatron usage with SP: the SP gather's reduce-scatter completes d_hidden.
        local = hidden.chunk(tp, dim=0)[layout.tp_rank].clone().requires_grad_()
        gathered = gather_sequence_parallel(local, layout.tp_group)  # verl: gather_from_sequence_parallel_region
        lp, ent = linear_cross_entropy(
            gathered, shard.detach(), labels, temperature, "none", layout.tp_group, backend=BACKEND
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        check.close("d_hidden (SP)", local.grad, ref_dh.chunk(tp, dim=0)[layout.tp_rank], tol=1e-12, kind=kind)
    check.done()
