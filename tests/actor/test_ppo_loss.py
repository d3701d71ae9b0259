"""Unit tests of the PPO loss, its aggregation modes and the actor's batching (single process).

References are hand-written scalar Python (``math``) or fp64 torch on fresh seeded data.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mcore_ppo.actor.batching import PackedRollout, block_causal_mask, make_micro_batches, pack_micro_batch
from mcore_ppo.actor.ppo_loss import (
    agg_loss,
    aggregate,
    compute_policy_loss,
    kl_k3,
    loss_weights,
    schedule_loss_scale,
    sequence_token_counts,
)
from mcore_ppo.parallel.context_parallel import split_for_cp
from mcore_ppo_testing.seeds import next_seed


def _scalar_ppo_loss(lp: float, old: float, adv: float, lo: float, hi: float, c: float | None) -> float:
    """One token of PPO-clip (+ dual-clip), written out by hand."""
    ratio = math.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - lo), 1 + hi)
    loss = max(unclipped, clipped)
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_policy_loss_matches_hand_computation(clip_ratio_c):
    # Cases chosen to hit every branch: inside the trust region, clipped above/below for A>0
    # and A<0, and a huge ratio with A<0 where only dual-clip bounds the loss.
    lp = [-1.0, -0.5, -2.0, -0.1, -3.0, -0.2, -1.5]
    old = [-1.1, -1.0, -1.0, -2.5, -1.0, -0.2, -1.0]
    adv = [0.7, 1.3, 0.9, -0.8, -2.0, 0.5, -1.5]
    lo, hi = 0.2, 0.28
    terms = compute_policy_loss(
        torch.tensor(lp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_ratio_low=lo,
        clip_ratio_high=hi,
        clip_ratio_c=clip_ratio_c,
    )
    expected = [_scalar_ppo_loss(a, b, c, lo, hi, clip_ratio_c) for a, b, c in zip(lp, old, adv, strict=True)]
    torch.testing.assert_close(terms.pg_losses, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=1e-14)
    ratios = [math.exp(a - b) for a, b in zip(lp, old, strict=True)]
    # clipped indicator: the clamp changed the (larger) loss.
    expected_clip = [float(-c * min(max(r, 1 - lo), 1 + hi) > -c * r) for r, c in zip(ratios, adv, strict=True)]
    assert terms.clipped.tolist() == expected_clip
    assert sum(expected_clip) >= 3  # the cases really exercise clipping
    if clip_ratio_c is not None:
        # token 3: ratio e^2.4 ≈ 11 with A = -0.8 -> bounded by -A·c = 2.4.
        assert terms.pg_losses[3].item() == pytest.approx(0.8 * 3.0, abs=1e-14)
        assert terms.dual_clipped.tolist() == [0, 0, 0, 1, 0, 0, 0]
    else:
        assert terms.pg_losses[3].item() == pytest.approx(0.8 * math.exp(2.4), rel=1e-14)
        assert terms.dual_clipped.sum().item() == 0


def test_policy_loss_gradient():
    # d loss / d log_prob = -A·ratio where the unclipped branch is active, 0 where clipped or dual-clipped.
    gen = torch.Generator().manual_seed(next_seed())
    n = 64
    lp = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    old = torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    terms = compute_policy_loss(lp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=2.0)
    (grad,) = torch.autograd.grad(terms.pg_losses.sum(), lp)
    ratio = torch.exp(lp.detach() - old)
    active = (terms.clipped == 0) & (terms.dual_clipped == 0)
    # The clamp is inactive only when the ratio lies strictly inside the region or the
    # unclipped branch wins (max picks it): exactly `clipped == 0`.
    expected = torch.where(active, -adv * ratio, torch.zeros_like(ratio))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert 0 < int(active.sum()) < n


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        compute_policy_loss(x, torch.zeros(4), x)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(x, x, x, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        compute_policy_loss(x, x, x, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-sum")


def test_kl_k3_matches_hand_computation_and_estimates_kl():
    old = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64)
    new = torch.tensor([-1.5, -1.0, -0.3], dtype=torch.float64)
    expected = [math.exp(b - a) - 1 - (b - a) for a, b in zip(old.tolist(), new.tolist(), strict=True)]
    torch.testing.assert_close(kl_k3(old, new), torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    # Unbiased for KL(q || p) over samples of q: the q-weighted mean over a whole (small) vocab
    # equals the exact KL.
    gen = torch.Generator().manual_seed(next_seed())
    log_q = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    log_p = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    exact = (log_q.exp() * (log_q - log_p)).sum()
    torch.testing.assert_close((log_q.exp() * kl_k3(log_q, log_p)).sum(), exact, rtol=1e-12, atol=1e-14)
    assert bool((kl_k3(log_q, log_p) >= 0).all())


def test_agg_loss_modes_match_hand_computation():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    # token-mean: (2+3+4+10+20)/5; seq-mean-token-sum: (9 + 30)/2 (empty row left out);
    # seq-mean-token-mean: (9/3 + 30/2)/2.
    assert agg_loss(values, mask, "token-mean").item() == pytest.approx(39 / 5, rel=1e-7)
    assert agg_loss(values, mask, "seq-mean-token-sum").item() == pytest.approx(39 / 2, rel=1e-7)
    assert agg_loss(values, mask, "seq-mean-token-mean").item() == pytest.approx((3 + 15) / 2, rel=1e-7)
    empty = torch.zeros_like(mask)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        out = agg_loss(values, empty, mode)
        assert out.item() == 0.0 and not torch.isnan(out)


def test_schedule_loss_scale():
    assert schedule_loss_scale(num_microbatches=3, cp_size=2, dp_cp_size=4) == 6.0
    assert schedule_loss_scale(num_microbatches=1, cp_size=1, dp_cp_size=1) == 1.0
    with pytest.raises(ValueError, match="multiple"):
        schedule_loss_scale(num_microbatches=1, cp_size=2, dp_cp_size=3)


def _random_rollout(gen: torch.Generator, num_seqs: int, vocab: int = 50) -> PackedRollout:
    lengths = torch.randint(3, 17, (num_seqs,), generator=gen).tolist()
    cu = [0]
    masks = []
    for n in lengths:
        cu.append(cu[-1] + n)
        prompt = int(torch.randint(1, n - 1, (1,), generator=gen))
        m = torch.zeros(n, dtype=torch.bool)
        m[prompt:] = True
        masks.append(m)
    total = cu[-1]
    return PackedRollout(
        tokens=torch.randint(0, vocab, (total,), generator=gen),
        cu_seqlens=torch.tensor(cu),
        response_mask=torch.cat(masks),
        advantages=torch.randn(total, generator=gen, dtype=torch.float64),
        old_log_probs=-torch.rand(total, generator=gen, dtype=torch.float64) * 3,
    )


def _padded_view(rollout: PackedRollout, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token`` [T] and the response mask as padded ``[b, s_max]`` rows (verl's layout)."""
    lengths = rollout.seq_lengths
    out = torch.zeros(len(lengths), max(lengths), dtype=per_token.dtype)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for i, (a, b) in enumerate(itertools.pairwise(rollout.bounds)):
        out[i, : b - a] = per_token[a:b]
        mask[i, : b - a] = rollout.response_mask[a:b]
    return out, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_same_over_micro_batches_and_cp_ranks(mode):
    """Σ over micro-batches × CP ranks × DP ranks of the schedule-scaled loss, run through
    Megatron's 2-tuple scaling (×cp/num_microbatches) and DP×CP gradient averaging, gives the
    whole-batch loss and its gradient, for every split."""
    gen = torch.Generator().manual_seed(next_seed())
    rollout = _random_rollout(gen, num_seqs=7)
    per_token = torch.randn(rollout.tokens.shape[0], generator=gen, dtype=torch.float64).requires_grad_()
    padded, mask = _padded_view(rollout, per_token)
    reference = agg_loss(padded, mask, mode)
    (ref_grad,) = torch.autograd.grad(reference, per_token)

    for cp, dp, mbs in [(1, 1, 7), (1, 1, 2), (2, 1, 3), (4, 1, 1), (2, 2, 2), (1, 2, 3)]:
        # DP: sequences dealt round-robin over data-parallel ranks; CP: each rank a shard.
        dp_seqs = [list(range(d, rollout.num_seqs, dp)) for d in range(dp)]
        parts = {}  # (d, c, m) -> micro-batch
        for d in range(dp):
            for m, mb_local in enumerate(
                make_micro_batches([rollout.seq_lengths[s] for s in dp_seqs[d]], micro_batch_size=mbs)
            ):
                seqs = [dp_seqs[d][i] for i in mb_local]
                for c in range(cp):
                    parts[d, c, m] = pack_micro_batch(rollout, seqs, align=2 * cp, cp_size=cp, cp_rank=c)
        # Global counts, as the actor forms them: per-sequence counts summed over CP shards
        # (an all-reduce over CP), token/sequence totals summed over DP (an all-reduce over DP).
        counts = {}
        for (d, _c, m), mb in parts.items():
            local = sequence_token_counts(mb.loss_mask, mb.seq_index, len(mb.seq_ids))
            counts[d, m] = counts.get((d, m), 0) + local
        num_tokens = sum(float(v.sum()) for v in counts.values())
        num_seqs = sum(float((v > 0).sum()) for v in counts.values())
        num_mb = {d: 1 + max(m for (dd, _, m) in parts if dd == d) for d in range(dp)}

        total = torch.zeros((), dtype=torch.float64)
        for (d, _c, m), mb in parts.items():
            w = loss_weights(
                mb.loss_mask,
                mb.seq_index,
                mode,
                seq_token_counts=counts[d, m],
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            safe = mb.token_index.clamp(min=0)
            values = torch.where(mb.token_index >= 0, per_token[safe], torch.zeros((), dtype=torch.float64))
            scale = schedule_loss_scale(num_microbatches=num_mb[d], cp_size=cp, dp_cp_size=dp * cp)
            returned = aggregate(values, w.to(torch.float64)) * scale
            # Megatron: ×cp / num_microbatches; DDP: average over the dp·cp ranks.
            total = total + returned * cp / num_mb[d] / (dp * cp)
        (grad,) = torch.autograd.grad(total, per_token)
        torch.testing.assert_close(total, reference, rtol=1e-6, atol=1e-7, msg=f"cp={cp} dp={dp} mbs={mbs}")
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7, msg=f"cp={cp} dp={dp} mbs={mbs}")


def test_make_micro_batches():
    assert make_micro_batches([5, 3, 8, 2, 7], micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    # align 4: padded sizes 8, 4, 8, 4, 8; budget 12.
    assert make_micro_batches([5, 3, 8, 2, 7], max_tokens=12, align=4) == [[0, 1], [2, 3], [4]]
    assert make_micro_batches([30, 2], max_tokens=8) == [[0], [1]]  # too long: alone
    with pytest.raises(ValueError, match="exactly one"):
        make_micro_batches([1], micro_batch_size=1, max_tokens=4)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_pack_micro_batch_labels_and_cp_split(cp):
    gen = torch.Generator().manual_seed(next_seed())
    rollout = _random_rollout(gen, num_seqs=4)
    seqs = [3, 1, 2]
    align = 2 * cp
    full = pack_micro_batch(rollout, seqs, align=align)
    # Global layout: each sequence padded to a multiple of align, labels = next token on the
    # response, ignore elsewhere, positions restart per sequence.
    cu = full.cu_seqlens_padded
    assert all((b - a) % align == 0 for a, b in itertools.pairwise(cu))
    for k, s in enumerate(seqs):
        a, n = rollout.bounds[s], rollout.seq_lengths[s]
        start = cu[k]
        assert full.input_ids[0, start : start + n].tolist() == rollout.tokens[a : a + n].tolist()
        assert full.position_ids[0, start : cu[k + 1]].tolist() == list(range(cu[k + 1] - start))
        for i in range(cu[k + 1] - start):
            is_resp = i + 1 < n and bool(rollout.response_mask[a + i + 1])
            assert bool(full.loss_mask[0, start + i]) == is_resp
            expected = int(rollout.tokens[a + i + 1]) if is_resp else -100
            assert int(full.labels[0, start + i]) == expected
            if is_resp:
                assert full.old_log_probs[0, start + i].item() == rollout.old_log_probs[a + i + 1].item()
                assert int(full.token_index[0, start + i]) == a + i + 1
    # CP shards: label fields are split like Megatron splits the tokens (roll first).
    for r in range(cp):
        part = pack_micro_batch(rollout, seqs, align=align, cp_size=cp, cp_rank=r)
        for name in ("labels", "loss_mask", "seq_index", "token_index", "advantages", "old_log_probs"):
            expected = split_for_cp(getattr(full, name), cp, r, seq_dim=1, cu_seqlens=cu)
            assert torch.equal(getattr(part, name), expected), name
        assert torch.equal(part.input_ids, full.input_ids)  # model sees the whole sequence (CP at the head)
        model_cp = pack_micro_batch(rollout, seqs, align=align, cp_size=cp, cp_rank=r, model_cp_size=cp)
        assert torch.equal(model_cp.input_ids, split_for_cp(full.input_ids, cp, r, seq_dim=1, cu_seqlens=cu))
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_micro_batch(rollout, seqs, align=3, cp_size=2, cp_rank=0)


def test_block_causal_mask():
    mask = block_causal_mask([0, 2, 5])
    allowed = ~mask[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def test_packed_rollout_validation():
    tokens = torch.arange(5)
    with pytest.raises(ValueError, match="first token"):
        PackedRollout(tokens, torch.tensor([0, 2, 5]), torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedRollout(tokens, torch.tensor([0, 2, 4]), torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="response_mask"):
        PackedRollout(tokens, torch.tensor([0, 5]), torch.zeros(5))
