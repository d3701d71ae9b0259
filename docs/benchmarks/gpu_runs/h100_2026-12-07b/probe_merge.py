"""Probe: the ranks' top-k merge on one GPU, old route vs new, at n 16384, world 8."""

import torch

from mcore_ppo.distill import topk_triton
from mcore_ppo.parallel.topk import select_topk_lse


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


torch.manual_seed(0)
n, world, shard = 16384, 8, 18992
for k in (8, 128):
    vals = torch.randn(world, n, k, device="cuda").sort(dim=-1, descending=True).values * 3
    ids = (
        torch.randint(0, shard, (world, n, k), device="cuda")
        + torch.arange(world, device="cuda")[:, None, None] * shard
    )
    W = world * k

    def old_pack(vals=vals, ids=ids, W=W):
        packed = torch.stack([vals.to(torch.float64), ids.to(torch.float64)], 1)  # as gathered
        g = packed.permute(1, 2, 0, 3).reshape(2, n, W)
        return g[0].to(torch.float32), g[1].to(torch.int64)

    def new_pack(vals=vals, ids=ids, W=W):
        packed = torch.stack([vals, ids.to(torch.int32).view(torch.float32)], 1)
        g = packed.permute(1, 2, 0, 3).reshape(2, n, W)
        return g[0], g[1].view(torch.int32).to(torch.int64)

    cv, cc = new_pack()
    ov, oc = old_pack()
    assert torch.equal(cv, ov) and torch.equal(cc, oc)
    t_old_pack, t_new_pack = timed(old_pack), timed(new_pack)
    t_torch = timed(lambda cv=cv, cc=cc, k=k: select_topk_lse(cv, cc, k))
    t_kernel = timed(lambda cv=cv, cc=cc, k=k: topk_triton.select_merged(cv, cc, k))
    a, b = select_topk_lse(cv, cc, k), topk_triton.select_merged(cv, cc, k)
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    lse_err = ((a[2] - b[2]).abs() / a[2].abs().clamp_min(1e-30)).max().item()
    print(
        f"k={k} W={W}: pack old {t_old_pack:.3f} new {t_new_pack:.3f} ms | select torch {t_torch:.3f} "
        f"kernel {t_kernel:.3f} ms | same top {same}, dropped-lse rel err {lse_err:.1e}"
    )
