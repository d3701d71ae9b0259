"""Smoke test of the multi-rank harness: TP 2 and 4 against the single-rank result."""

import torch
import torch.distributed as dist
from conftest import shared_seed, tp_cp_groups

from mcore_ppo import fused_log_probs_and_entropy


def test_tp_matches_single_rank():
    torch.manual_seed(shared_seed())
    n, h, vocab = 24, 16, 64
    hidden = torch.randn(n, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,))
    ref_lp, ref_ent = fused_log_probs_and_entropy(hidden, weight, labels, backend="torch")
    for tp in (2, 4):
        layout = tp_cp_groups(tp)
        if layout.tp_group is None:
            continue
        shard = weight.chunk(tp)[layout.tp_rank]
        lp, ent = fused_log_probs_and_entropy(hidden, shard, labels, tp_group=layout.tp_group, backend="torch")
        torch.testing.assert_close(lp, ref_lp)
        torch.testing.assert_close(ent, ref_ent)
    dist.barrier()
