"""The NeMo-RL adapter under TP (SP on and off) and CP, padded and packed, against NeMo-RL's
logits-path contract computed on the whole sequence and vocab (``mcore_ppo_testing.nemo_rl_reference``).

Each rank gets what NeMo-RL's Megatron forward hands it: the hidden states of its CP part
(Megatron's load-balanced chunks of every sequence), sequence-sharded over TP under SP, its
vocab shard, and the *whole* unshifted target. Outputs must equal the reference on every rank.
Gradients follow NeMo-RL's CP convention (its ``AllGatherCPTensor`` sums the upstream gradients
over CP): this rank's ``d_hidden`` is ``cp ×`` the reference's at its positions, and ``d_W``
summed over CP is ``cp ×`` the reference's shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import DEVICE, fitting, shared_seed, tp_cp_groups
from head_cases import BACKEND

from mcore_ppo.integrations.nemo_rl import from_parallel_hidden_states_to_logprobs
from mcore_ppo_testing.nemo_rl_reference import logits_path_logprobs
from parallel import split_for_cp

VOCAB, H, TEMPERATURE = 64, 16, 0.8
# (tp, cp, sp); the last three need a world of 8.
LAYOUTS = (
    (2, 1, True), (2, 1, False), (1, 2, False), (2, 2, True), (4, 1, True), (8, 1, True), (4, 2, True), (2, 4, True),
)  # fmt: skip


def _cases():
    """(name, global hidden [S, b, h], target, cu_seqlens or None, unpacked_seqlen)."""
    gen = torch.Generator().manual_seed(shared_seed())
    padded = torch.randn(16, 2, H, dtype=torch.float64, generator=gen)
    padded_target = torch.randint(0, VOCAB, (2, 14), generator=gen)  # CP-padded by the model to 16
    packed = torch.randn(24, 1, H, dtype=torch.float64, generator=gen)
    packed_target = torch.randint(0, VOCAB, (1, 24), generator=gen)
    return [
        ("padded", padded, padded_target, None, None),
        ("packed", packed, packed_target, [0, 8, 16, 24], 12),
    ]


def test_nemo_rl_adapter_layouts(check):
    torch.manual_seed(shared_seed())
    weight = torch.randn(VOCAB, H, dtype=torch.float64)
    kind = "nemo_rl adapter vs logits path"
    for name, hidden, target, bounds, unpacked in _cases():
        ref_x, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kwargs = {} if bounds is None else {"cu_seqlens_padded": bounds, "unpacked_seqlen": unpacked}
        ref_lp, ref_ent = logits_path_logprobs(ref_x, ref_w, target, TEMPERATURE, **kwargs)
        g_lp, g_ent = torch.randn_like(ref_lp), torch.randn_like(ref_lp)
        ref_dx, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_x, ref_w))
        for tp, cp, sp in fitting(LAYOUTS, lambda lay: lay[0] * lay[1], lambda lay: f"TP{lay[0]}xCP{lay[1]}"):
            layout = tp_cp_groups(tp, cp)
            if layout.tp_group is None and layout.cp_group is None:
                continue
            check.case(f"{name} tp={tp} cp={cp} sp={sp}")
            local = split_for_cp(hidden, cp, layout.cp_rank, seq_dim=0, cu_seqlens=bounds)
            local_dx = split_for_cp(ref_dx, cp, layout.cp_rank, seq_dim=0, cu_seqlens=bounds)
            if sp:
                local, local_dx = local.chunk(tp)[layout.tp_rank], local_dx.chunk(tp)[layout.tp_rank]
            x = local.clone().to(DEVICE).requires_grad_()
            w = weight.chunk(tp)[layout.tp_rank].clone().to(DEVICE).requires_grad_()
            shard = VOCAB // tp
            extra = {}
            if bounds is not None:
                extra = {"cu_seqlens_padded": torch.tensor(bounds, device=DEVICE), "unpacked_seqlen": unpacked}
            lp, ent = from_parallel_hidden_states_to_logprobs(
                x, w, None, target.to(DEVICE), layout.tp_rank * shard, (layout.tp_rank + 1) * shard,
                layout.tp_group, cp_group=layout.cp_group, temperature=TEMPERATURE, sequence_parallel=sp,
                return_entropy=True, backend=BACKEND, **extra,
            )  # fmt: skip
            check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
            check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
            ((lp * g_lp.to(DEVICE)).sum() + (ent * g_ent.to(DEVICE)).sum()).backward()
            check.close("d_hidden (x cp)", x.grad, cp * local_dx, tol=1e-12, kind=kind)
            dw = w.grad.clone()
            if layout.cp_group is not None:
                dist.all_reduce(dw, group=layout.cp_group)
            check.close("d_weight (sum over cp)", dw, cp * ref_dw.chunk(tp)[layout.tp_rank], tol=1e-12, kind=kind)
    check.done()
