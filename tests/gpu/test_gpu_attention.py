"""SdpaAttention's flash varlen path on a GPU against exact causal attention (marked ``gpu``).

The varlen path (bf16/fp16 on CUDA) runs every segment in one ``torch.nn.attention.varlen``
call, with causal masks aligned to the bottom right when a CP query chunk attends to a longer
key prefix. Its CP index plans are emulated on one GPU: the CP all-gather is the concatenation of
every rank's local keys (:func:`mcore_ppo.parallel.context_parallel.cp_token_index` order). Reference:
causal attention of each whole sequence in fp32, split the way CP splits it. Outputs and the
gradients of q, k, v (through the gather) must agree to bf16 rounding. Skipped without CUDA.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from mcore_ppo.parallel.context_parallel import cp_token_index
from mcore_ppo_testing.attention import _plan, _segments_sdpa, _segments_varlen, _uses_varlen, _varlen_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, KV_HEADS, DIM = 8, 2, 64


def _causal_reference(q, k, v, bounds, scale):
    """fp32 causal attention of every whole sequence (GQA by repetition); [t, heads, d]."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    outs = []
    for a, b in itertools.pairwise(bounds):
        if b > a:
            qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_varlen_matches_exact_causal_attention(cp_size):
    if _varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    seed = int(os.environ.get("MCORE_PPO_TEST_SEED", "1234"))
    gen = torch.Generator().manual_seed(seed + cp_size)
    unit = 2 * cp_size
    lengths = [unit * int(n) for n in torch.randint(1, 64, (7,), generator=gen)] + [0, unit]
    bounds = tuple(itertools.accumulate([0, *lengths]))
    total = bounds[-1]
    q = torch.randn(total, HEADS, DIM, generator=gen).cuda().bfloat16().requires_grad_()
    k = torch.randn(total, KV_HEADS, DIM, generator=gen).cuda().bfloat16().requires_grad_()
    v = torch.randn(total, KV_HEADS, DIM, generator=gen).cuda().bfloat16().requires_grad_()
    grad = torch.randn(total, HEADS, DIM, generator=gen).cuda()
    scale = DIM**-0.5

    ref = _causal_reference(q, k, v, bounds, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)

    # Every CP rank: its local queries (cp_token_index order), the keys "all-gathered" rank by rank.
    order = [cp_token_index(bounds, cp_size, r) for r in range(cp_size)]
    gathered = torch.tensor([p for rank in order for p in rank], device="cuda")
    k_all, v_all = k.index_select(0, gathered), v.index_select(0, gathered)
    outs = torch.zeros(total, HEADS, DIM, device="cuda")
    for rank in range(cp_size):
        local = torch.tensor(order[rank], device="cuda")
        q_local = q.index_select(0, local)
        plan = _plan(bounds, cp_size, rank)
        keys, values = (k_all, v_all) if cp_size > 1 else (k.index_select(0, local), v.index_select(0, local))
        assert _uses_varlen(q_local, 0.0)
        out = _segments_varlen(q_local, keys, values, plan, scale)
        loop = _segments_sdpa(q_local.float(), keys.float(), values.float(), plan, scale, 0.0)
        torch.testing.assert_close(out.float(), loop, atol=2e-2, rtol=2e-2)
        outs = outs.index_add(0, local, out.float())
    torch.testing.assert_close(outs, ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(outs, (q, k, v), grad)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        err = (g.float() - r.float()).norm() / r.float().norm()
        assert err < 2e-2, f"d{name}: relative error {err:.2e}"
