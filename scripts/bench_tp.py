"""Per-rank time of the head on real vocab shards under TP over NCCL (one GPU per rank).

    torchrun --standalone --nproc_per_node TP scripts/bench_tp.py [--hidden 3584 --vocab 152064 --tokens 16384]

Every rank holds its shard ``[V/tp, h]`` of one global weight and the same hidden states and
labels (SP off: hidden replicated, ``d_hidden`` all-reduced). Reported per rank (medians of CUDA
event timings): forward (no grad), forward+backward, the same collectives the head issues
(all-reduce MAX of ``[N]`` fp32, all-reduce SUM of ``[3, N]`` fp32, and the ``d_hidden``
all-reduce ``[N, h]``) timed on their own, peak memory, and rank 0's TP 1 time on the whole
vocab, for the scaling ratio ``t_tp / (t_tp1 / tp)`` (goal ≤ 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# `python scripts/bench_tp.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo_testing.bench import time_ms
from mcore_ppo_testing.reports import DefaultsHelpFormatter


def head_timings(hidden, weight, labels, group, repeats):
    def forward():
        with torch.no_grad():
            fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, tp_group=group, backend="triton")

    x = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def forward_backward():
        log_probs, entropy = fused_log_probs_and_entropy(
            x, w, labels, temperature=0.7, tp_group=group, backend="triton"
        )
        (log_probs.sum() + 0.01 * entropy.sum()).backward()
        x.grad = w.grad = None

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd = time_ms(forward, repeats, warmup=2)
    fwd_bwd = time_ms(forward_backward, repeats, warmup=2)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return fwd, fwd_bwd, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=3584, help="hidden size")
    parser.add_argument("--vocab", type=int, default=152064, help="vocab size (split over the ranks)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON report ($OUT if set)")
    args = parser.parse_args()

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(1234)  # same data on every rank
    n, h, vocab = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    full_weight = (torch.randn(vocab, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    shard = full_weight.chunk(tp)[rank].contiguous()

    fwd, fwd_bwd, peak = head_timings(hidden, shard, labels, group, args.repeats)

    stats_max = torch.zeros(n, device="cuda")
    stats_sum = torch.zeros(3, n, device="cuda")
    d_hidden = torch.zeros(n, h, device="cuda", dtype=torch.bfloat16)

    def forward_collectives():
        dist.all_reduce(stats_max, op=dist.ReduceOp.MAX)
        dist.all_reduce(stats_sum)

    fwd_comm = time_ms(forward_collectives, 20, warmup=2)
    bwd_comm = time_ms(lambda: dist.all_reduce(d_hidden), 20, warmup=2)

    result = {
        "rank": rank,
        "tp": tp,
        "shape": {"tokens": n, "hidden": h, "vocab": vocab, "dtype": "bfloat16", "temperature": 0.7},
        "fwd_ms": fwd,
        "fwd_bwd_ms": fwd_bwd,
        "collectives_fwd_ms": fwd_comm,
        "collectives_fwd_bwd_ms": fwd_comm + bwd_comm,
        "collective_share_fwd_bwd": (fwd_comm + bwd_comm) / fwd_bwd,
        "peak_extra_gib": peak,
    }
    dist.barrier()
    if rank == 0:
        del shard
        tp1_fwd, tp1_fwd_bwd, _ = head_timings(hidden, full_weight, labels, None, args.repeats)
        result.update(
            tp1_fwd_ms=tp1_fwd,
            tp1_fwd_bwd_ms=tp1_fwd_bwd,
            scaling_fwd=fwd / (tp1_fwd / tp),
            scaling_fwd_bwd=fwd_bwd / (tp1_fwd_bwd / tp),
        )
    dist.barrier()
    results = [None] * tp
    dist.all_gather_object(results, result)
    if rank == 0:
        print(json.dumps(results, indent=1))
        with open(os.path.join(args.out, f"bench_tp{tp}_h{h}_v{vocab}.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
