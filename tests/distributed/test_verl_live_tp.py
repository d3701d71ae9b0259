"""The verl plugin's ``linear_cross_entropy`` under TP: ``d_hidden`` comes out complete in both of
verl's call patterns (its ``fused_output_processor``, ``_fused_GPTModel_forward`` and 1F1B
``_postprocess`` all do the same):

- SP on: verl gathers the hidden states with Megatron's ``gather_from_sequence_parallel_region``
  and calls the kernel; the gather's backward reduce-scatters, so the kernel must return the
  partial (as verl's does) and each rank's sequence shard gets the full gradient;
- SP off: verl calls the kernel on the replicated hidden states and nothing sums the partials
  (verl's own kernel leaves them incomplete): the plugin all-reduces, every rank gets the full
  gradient.
"""

from __future__ import annotations

import contextlib

import torch
from conftest import DEVICE, fitting, shared_seed, tp_cp_groups
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from mcore_ppo.integrations.verl import linear_cross_entropy
from mcore_ppo_testing.cpu_shims import cpu_shims
from mcore_ppo_testing.reference import outputs_from_logits


def _reference(hidden, weight, labels, temperature):
    """verl's flat pairing: token i of hidden [..., h] with labels.reshape(-1)[i]."""
    return outputs_from_logits(hidden.reshape(-1, hidden.shape[-1]) @ weight.t(), labels.reshape(-1), temperature)


def test_verl_plugin_d_hidden_complete_with_and_without_sp(check):
    torch.manual_seed(shared_seed())
    t, h, vocab, temperature = 8, 16, 64, 0.7
    hidden = torch.randn(t, 1, h, dtype=torch.float64)  # verl's packed THD layout
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (1, t))
    g_lp, g_ent = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, temperature)
    ref_dh, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_h, ref_w))
    hidden, weight, labels, g_lp, g_ent = (x.to(DEVICE) for x in (hidden, weight, labels, g_lp, g_ent))
    kind = "verl plugin vs fp64"
    # Megatron's SP gather allocates on torch.cuda.current_device(): the CPU shims map it to the CPU.
    shims = cpu_shims() if DEVICE.type == "cpu" else contextlib.nullcontext()
    with shims:
        for tp in fitting((2, 4, 8), lambda tp: tp, lambda tp: f"TP{tp}"):
            layout = tp_cp_groups(tp)
            if layout.tp_group is None:
                continue
            shard = weight.chunk(tp)[layout.tp_rank]
            for sp in (True, False):
                check.case(f"tp={tp} sp={sp}")
                w = shard.clone().requires_grad_()
                if sp:
                    local = hidden.chunk(tp, dim=0)[layout.tp_rank].clone().requires_grad_()
                    x = gather_from_sequence_parallel_region(local, group=layout.tp_group)
                else:
                    local = x = hidden.clone().requires_grad_()
                lp, ent = linear_cross_entropy(x, w, labels, temperature, "none", layout.tp_group)
                check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
                check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
                ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
                expected = ref_dh.chunk(tp, dim=0)[layout.tp_rank] if sp else ref_dh
                check.close("d_hidden", local.grad, expected, tol=1e-12, kind=kind)
                check.close("d_weight", w.grad, ref_dw.chunk(tp)[layout.tp_rank], tol=1e-12, kind=kind)
    check.done()
