"""The fused Triton top-k (``fused_topk(impl="triton")``) on a GPU, against the torch path and float64.

Run on the lent H200 (``pytest tests/gpu/test_gpu_topk.py -m gpu``); skipped without CUDA.
Shapes near the benchmark's (a TP 8 shard of a 152k vocab, a ragged shard, a TP 1 vocab on
fewer tokens), bf16 and fp32 inputs. The fp64 reference is computed on the GPU from the same
(rounded) inputs for a subsample of tokens. Random data: the log-probs at the returned ids
equal fp64's to 1e-5 norm-wise relative (1e-4 absolute each), and the returned ids are the
fp64 top-k up to swaps of values within fp32 accumulation error (two logits ~1e-5 apart may
come in either order: at k = 128 about one token in ten has such a pair, so the fraction of
tokens with identical id lists is printed, and only checked to be most of them); integer-valued
logits (exact ties everywhere): the ids equal fp64's exactly. A per-token temperature (per-sample
runs, as verl passes them): the kernel's per-row ``1/T_i`` against the torch path and fp64.
Other ``TopKConfig`` settings (candidates, key order, tiles and splits, token chunks) against
fp64 and the defaults.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mcore_ppo.distill import TopKConfig, fused_topk
from mcore_ppo.distill.topk_config import GPU_TILES
from mcore_ppo_testing.seeds import next_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHECK_ROWS = 512
REL_TOL = 1e-5  # norm-wise, log-probs against fp64
# Per entry: fp32 accumulation of h bf16 products against fp64 (a few 1e-6 typical); a near-tie
# decided the other way swaps two entries at most this far apart.
ABS_TOL = 1e-4


def make(n, h, v, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    return x, w


def fp64_top(x, w, k, temperature, rows):
    lp = torch.log_softmax((x[rows].double() @ w.double().t()) / temperature, dim=-1)
    vals, ids = lp.sort(dim=-1, descending=True, stable=True)
    return ids[:, :k], vals[:, :k], torch.logsumexp(vals[:, k:], dim=-1), lp


def check(out, x, w, k, temperature, rows):
    ref_ids, ref_vals, ref_tail, full = fp64_top(x, w, k, temperature, rows)
    ids, logp, tail = out.ids[rows], out.log_probs[rows].double(), out.tail_log_mass[rows].double()
    assert ids.dtype == torch.int64 and out.log_probs.dtype == torch.float32
    at_ids = full.gather(1, ids)
    assert ((logp - at_ids).norm() / at_ids.norm()).item() <= REL_TOL
    assert (logp - at_ids).abs().max().item() <= ABS_TOL
    assert (at_ids - ref_vals).abs().max().item() <= ABS_TOL  # the fp64 top-k, up to near-ties
    assert (logp[:, 1:] <= logp[:, :-1]).all()
    assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()
    assert (tail - ref_tail).abs().max().item() <= ABS_TOL
    same = (ids == ref_ids).all(dim=-1).double().mean().item()
    print(f"tokens whose {ids.shape[1]} ids equal fp64's, in order: {same:.4f}")
    return same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("n", "h", "v", "k"),
    [(4096, 3584, 18992, 128), (3000, 1024, 40000 + 77, 64), (1024, 3584, 151936, 8), (1024, 3584, 151936, 128)],
    ids=["tp8-shard-k128", "ragged-k64", "tp1-vocab-k8", "tp1-vocab-k128"],  # C: 5, then 3 for the rest
)
def test_triton_matches_torch_and_fp64(n, h, v, k, dtype):
    x, w = make(n, h, v, dtype, next_seed())
    rows = torch.randperm(n, device="cuda")[:CHECK_ROWS]
    fused = fused_topk(x, w, k, temperature=0.7, impl="triton")
    again = fused_topk(x, w, k, temperature=0.7, impl="triton")
    for a, b in zip(fused, again, strict=True):  # atomic slot order varies; the results do not
        assert torch.equal(a, b)
    chunked = fused_topk(x, w, k, temperature=0.7, impl="torch")
    assert check(fused, x, w, k, 0.7, rows) >= 0.5
    assert check(chunked, x, w, k, 0.7, rows) >= 0.5
    # The two paths differ only in the accumulation order of the fp32 logits.
    same = (fused.ids == chunked.ids).all(dim=-1).double().mean().item()
    print(f"tokens whose ids equal the torch path's, in order: {same:.4f}")
    assert same >= 0.5
    torch.testing.assert_close(fused.tail_log_mass, chunked.tail_log_mass, rtol=0, atol=ABS_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [8, 128])
def test_exact_ties_and_ignored_tokens(dtype, k):
    """Logits that are small integers (entries in {-1, 0, 1}): ties everywhere, across tiles and
    splits; ids equal fp64's exactly. Ignored tokens get ignore_index / 0."""
    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    n, h, v = 1500, 24, 30000
    x = torch.randint(-1, 2, (n, h), device="cuda", generator=gen).to(dtype)
    w = torch.randint(-1, 2, (v, h), device="cuda", generator=gen).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[::7] = -100
    out = fused_topk(x, w, k, labels=labels, impl="triton")
    rows = torch.arange(n, device="cuda")
    ref_ids, ref_vals, ref_tail, _ = fp64_top(x, w, k, 1.0, rows)
    valid = labels != -100
    assert torch.equal(out.ids[valid], ref_ids[valid])
    assert (out.ids[~valid] == -100).all() and (out.log_probs[~valid] == 0).all()
    torch.testing.assert_close(out.log_probs[valid].double(), ref_vals[valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.tail_log_mass[valid].double(), ref_tail[valid], rtol=0, atol=1e-5)
    assert torch.equal(out.ids, fused_topk(x, w, k, labels=labels, impl="torch").ids)


def test_all_equal_logits():
    """Every logit equal: every tile's candidates tie with the k-th value, and the first
    ``k // C`` tiles are recomputed whole; the ids are still 0..k-1 and the tail exact."""
    v, k = 5000, 64
    x = torch.zeros(300, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, 128, device="cuda").to(torch.bfloat16)
    out = fused_topk(x, w, k, impl="triton")
    assert torch.equal(out.ids, torch.arange(k, device="cuda").expand(300, k))
    torch.testing.assert_close(out.log_probs, torch.full_like(out.log_probs, -math.log(v)))
    torch.testing.assert_close(out.tail_log_mass, torch.full_like(out.tail_log_mass, math.log((v - k) / v)))


@pytest.mark.parametrize(
    "config",
    [
        TopKConfig(candidates=3),
        TopKConfig(candidates=5, sort_keys=False),
        TopKConfig(tiles=replace(GPU_TILES, block_n=128), splits=8),
        TopKConfig(scratch_bytes=16 * 2**20),
    ],
    ids=["3-candidates", "5-candidates-by-count", "tiles-of-128-8-splits", "token-chunks"],
)
def test_configs_keep_the_results(config):
    """Other :class:`TopKConfig` settings (candidates per tile, the merge's key order, narrower
    tiles over forced vocab splits, a scratch that forces token chunks): against fp64 as the
    defaults are, and the defaults' ids for most tokens (only fp32 near-ties may differ)."""
    x, w = make(4096, 1024, 18992, torch.bfloat16, next_seed())
    rows = torch.randperm(4096, device="cuda")[:CHECK_ROWS]
    default = fused_topk(x, w, 64, temperature=0.7, impl="triton")
    other = fused_topk(x, w, 64, temperature=0.7, impl="triton", config=config)
    assert check(other, x, w, 64, 0.7, rows) >= 0.5
    same = (other.ids == default.ids).all(dim=-1).double().mean().item()
    print(f"tokens whose ids equal the default config's: {same:.4f}")
    assert same >= 0.5
    torch.testing.assert_close(other.tail_log_mass, default.tail_log_mass, rtol=0, atol=ABS_TOL)


def test_auto_picks_triton_on_cuda(monkeypatch):
    """impl="auto" on bf16 CUDA tensors runs the kernel (dispatch by device and dtype)."""
    from mcore_ppo.distill import topk_triton

    calls = []
    original = topk_triton.shard_topk_triton
    monkeypatch.setattr(topk_triton, "shard_topk_triton", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    x, w = make(64, 256, 1000, torch.bfloat16, next_seed())
    fused_topk(x, w, 8)
    assert calls == [1]
    fused_topk(x.double(), w.double(), 8)  # fp64: the torch path
    assert calls == [1]


def fp64_top_rows(x, w, k, temperature, rows):
    """:func:`fp64_top` with a per-token temperature ``[n]`` (its values taken exactly)."""
    logits = (x[rows].double() @ w.double().t()) / temperature[rows].double()[:, None]
    lp = torch.log_softmax(logits, dim=-1)
    vals, ids = lp.sort(dim=-1, descending=True, stable=True)
    return ids[:, :k], vals[:, :k], torch.logsumexp(vals[:, k:], dim=-1), lp


@pytest.mark.gpu_heavy  # peaks of 9 GiB and more: the card to itself
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("n", "h", "v", "k"), [(4096, 3584, 18992, 128), (3000, 1024, 40077, 64)],
                         ids=["tp8-shard-k128", "ragged-k64"])  # fmt: skip
def test_per_token_temperature(n, h, v, k, dtype):
    """A per-token temperature ``[n]`` (log-uniform in [0.25, 4], per sample: runs of 500 tokens
    share one, as verl spreads them): the kernel's ``1/T_i`` rows against the torch path and
    fp64 with the same temperatures; bitwise equal on a second call; a constant tensor equals
    the float; ignored tokens give ignore_index / 0."""
    seed = next_seed()
    x, w = make(n, h, v, dtype, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    samples = -(-n // 500)
    per_sample = torch.exp((torch.rand(samples, device="cuda", generator=gen) * 2 - 1) * math.log(4.0))
    temperature = per_sample.repeat_interleave(500)[:n].contiguous()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[::9] = -100
    valid = labels != -100
    rows = torch.randperm(n, device="cuda", generator=gen)[:CHECK_ROWS]
    rows = rows[valid[rows]]
    fused = fused_topk(x, w, k, temperature=temperature, labels=labels, impl="triton")
    again = fused_topk(x, w, k, temperature=temperature, labels=labels, impl="triton")
    for a, b in zip(fused, again, strict=True):
        assert torch.equal(a, b)
    chunked = fused_topk(x, w, k, temperature=temperature, labels=labels, impl="torch")
    assert (fused.ids[~valid] == -100).all() and (fused.log_probs[~valid] == 0).all()
    assert (fused.tail_log_mass[~valid] == 0).all()
    for out in (fused, chunked):
        ref_ids, ref_vals, ref_tail, full = fp64_top_rows(x, w, k, temperature, rows)
        ids, logp, tail = out.ids[rows], out.log_probs[rows].double(), out.tail_log_mass[rows].double()
        at_ids = full.gather(1, ids)
        assert ((logp - at_ids).norm() / at_ids.norm()).item() <= REL_TOL
        # Per entry: fp32 accumulation error, scaled by 1/T (up to 4x at T = 0.25).
        assert (logp - at_ids).abs().max().item() <= 4 * ABS_TOL
        assert (at_ids - ref_vals).abs().max().item() <= 4 * ABS_TOL
        assert (tail - ref_tail).abs().max().item() <= 4 * ABS_TOL
        assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()
        same = (ids == ref_ids).all(dim=-1).double().mean().item()
        print(f"tokens whose {k} ids equal fp64's, in order: {same:.4f}")
        assert same >= 0.5
    same = (fused.ids[valid] == chunked.ids[valid]).all(dim=-1).double().mean().item()
    print(f"tokens whose ids equal the torch path's, in order: {same:.4f}")
    assert same >= 0.5
    torch.testing.assert_close(fused.tail_log_mass, chunked.tail_log_mass, rtol=0, atol=4 * ABS_TOL)
    # 0.75 is exact in fp32: the row's 1/T and the scalar's are the same fp32 number.
    constant = fused_topk(x, w, k, temperature=torch.full((n,), 0.75, device="cuda"), labels=labels, impl="triton")
    number = fused_topk(x, w, k, temperature=0.75, labels=labels, impl="triton")
    assert torch.equal(constant.ids, number.ids)
    torch.testing.assert_close(constant.log_probs, number.log_probs, rtol=0, atol=1e-6)


@pytest.mark.gpu_heavy  # peaks of 9 GiB and more: the card to itself
@pytest.mark.parametrize(("world", "k"), [(8, 8), (8, 128), (2, 64)])
def test_rank_merge_kernel_matches_the_reference_selection(world, k):
    """The ranks' merge through the selection kernel (``topk_triton.select_merged``, the Triton
    path's at TP > 1) against ``select_topk_lse`` on the GPU, at the TP 8 merge's width
    (``world · k`` candidates per token): each rank's candidates in the tie rule's order, ids
    above the previous rank's, rounded values (ties within and across ranks). Same ids and
    values in order; the dropped entries' log-sum-exp to fp32 rounding."""
    from mcore_ppo.distill import topk_triton
    from mcore_ppo.parallel.topk import select_topk_lse

    seed = next_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, shard = 2048, 18992
    values = (torch.randn(world, n, k, device="cuda", generator=gen) * 8).round() / 4
    ids = torch.rand(world, n, shard, device="cuda", generator=gen).argsort(dim=-1)[..., :k]
    ids = ids + torch.arange(world, device="cuda")[:, None, None] * shard
    order = ids.sort(dim=-1).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    # As the all-gather leaves them: [world, 2, n, k], fp32 values beside their ids' int32 bits.
    gathered = torch.stack([values, ids.to(torch.int32).view(torch.float32)], 1).permute(1, 2, 0, 3)
    side_by_side = (gathered[0], gathered[1].view(torch.int32))
    got = topk_triton.select_merged(*side_by_side, k)
    want = select_topk_lse(*side_by_side, k)
    assert torch.equal(got[1], want[1]), f"seed {seed}: ids"
    assert torch.equal(got[0], want[0]), f"seed {seed}: values"
    torch.testing.assert_close(got[2], want[2], rtol=2e-6, atol=0, msg=f"seed {seed}: dropped lse")
