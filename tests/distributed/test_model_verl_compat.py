"""verl's contract under TP: ``linear_cross_entropy`` with a TP group returns the full-vocab values on
every rank, and a *partial* ``d_hidden`` (this rank's vocab shard's contribution) that the
caller reduces over TP (verl's Megatron path does it with the SP gather's reduce-scatter)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import shared_seed, tp_cp_groups

from mcore_ppo.verl_compat import linear_cross_entropy
from parallel.mappings import gather_sequence_parallel


def _reference(hidden, weight, labels, temperature):
    log_softmax = torch.log_softmax(hidden.reshape(-1, hidden.shape[-1]) @ weight.t() / temperature, dim=-1)
    lp = log_softmax.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    return lp, -(log_softmax.exp() * log_softmax).sum(-1)


def test_verl_compat_tp_values_and_partial_d_hidden():
    torch.manual_seed(shared_seed())
    s, b, h, vocab, temperature = 8, 2, 16, 64, 0.8
    hidden = torch.randn(s, b, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (s, b))
    g_lp, g_ent = torch.randn(s * b, dtype=torch.float64), torch.randn(s * b, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, temperature)
    ref_dh, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_h, ref_w))
    for tp in (2, 4):
        layout = tp_cp_groups(tp)
        if layout.tp_group is None:
            continue
        x = hidden.clone().requires_grad_()
        shard = weight.chunk(tp)[layout.tp_rank].clone().requires_grad_()
        lp, ent = linear_cross_entropy(x, shard, labels, temperature, "none", layout.tp_group)
        torch.testing.assert_close(lp, ref_lp)
        torch.testing.assert_close(ent, ref_ent)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        torch.testing.assert_close(shard.grad, ref_dw.chunk(tp)[layout.tp_rank])
        partial = x.grad.clone()
        assert not torch.allclose(partial, ref_dh)  # not reduced inside, as in verl
        dist.all_reduce(partial, group=layout.tp_group)
        torch.testing.assert_close(partial, ref_dh)

        # verl's Megatron usage with SP: the SP gather's reduce-scatter completes d_hidden.
        local = hidden.chunk(tp, dim=0)[layout.tp_rank].clone().requires_grad_()
        gathered = gather_sequence_parallel(local, layout.tp_group)  # verl: gather_from_sequence_parallel_region
        lp, ent = linear_cross_entropy(gathered, shard.detach(), labels, temperature, "none", layout.tp_group)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        torch.testing.assert_close(local.grad, ref_dh.chunk(tp, dim=0)[layout.tp_rank])
    dist.barrier()
