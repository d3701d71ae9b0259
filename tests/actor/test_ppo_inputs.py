"""Bad inputs of the PPO loss helpers and the rollout batching, found by fuzzing.

Before, each of these gave a silent wrong answer (a negative ``log_ratio_clamp`` pinned every
log-ratio to a constant, a NaN ``clip_ratio_high`` made every loss NaN, float ``seq_index`` was
truncated, a negative count or mask was dropped as "masked out", ``kl_k3`` broadcast mismatched
shapes, float ``cu_seqlens`` were truncated, ``micro_batch_size=2.5`` was taken, bool tokens
were accepted) or an error that did not name the argument (AttributeError on a list, IndexError,
ZeroDivisionError for ``align=0``, a bare comparison TypeError). Now: TypeError for types and
dtypes, ValueError for values and shapes, naming the argument. Sequence ids out of range and
negative/NaN masks are a ValueError for CPU tensors; on CUDA (no host sync on the actor's hot
path) they make the weights NaN instead, tested here by faking the device check.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo.actor import ppo_loss
from mcore_ppo.actor.batching import PackedRollout, make_micro_batches, pack_micro_batch
from mcore_ppo.actor.ppo_loss import (
    agg_loss,
    aggregate,
    check_loss_agg_mode,
    compute_policy_loss,
    kl_k3,
    loss_weights,
    schedule_loss_scale,
    sequence_token_counts,
)

X = torch.zeros(2, 4)
MASK = torch.ones(2, 4, dtype=torch.bool)
SEQ = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])


# --- the policy loss -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clip_ratio_low": "0.2"}, TypeError, r"^clip_ratio_low must be a number, got str"),
        ({"clip_ratio_high": None}, TypeError, r"^clip_ratio_high must be a number"),
        ({"clip_ratio_c": True}, TypeError, r"^clip_ratio_c must be a number, got bool"),
        ({"log_ratio_clamp": torch.tensor(20.0)}, TypeError, r"^log_ratio_clamp must be a number"),
        ({"clip_ratio_high": math.nan}, ValueError, r"^clip_ratio_high must not be NaN"),
        ({"clip_ratio_c": math.nan}, ValueError, r"^clip_ratio_c must not be NaN"),
        ({"log_ratio_clamp": -1.0}, ValueError, r"^log_ratio_clamp must be > 0"),
        ({"log_ratio_clamp": 0}, ValueError, r"^log_ratio_clamp must be > 0"),
    ],
)
def test_policy_loss_scalars(kwargs, error, match):
    with pytest.raises(error, match=match):
        compute_policy_loss(X, X, X, **kwargs)


def test_policy_loss_without_upper_clip():
    """clip_ratio_high = inf is a legitimate "no upper clip"."""
    log_prob, old = torch.tensor([1.0, -1.0]), torch.zeros(2)
    terms = compute_policy_loss(log_prob, old, torch.ones(2), clip_ratio_high=math.inf)
    # A > 0: the ratio e is not clipped at 1.2; the ratio 1/e below 0.8 is not either (pessimistic max).
    torch.testing.assert_close(terms.pg_losses, -torch.exp(log_prob))


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((X.tolist(), X, X), TypeError, r"^log_prob must be a torch.Tensor, got list"),
        ((X, X.long(), X), TypeError, r"^old_log_prob must be a floating-point tensor, got dtype torch.int64"),
        ((X, X, X.bool()), TypeError, r"^advantages must be a floating-point tensor"),
        ((X, X, X[0]), ValueError, r"must have the same shape, got \(2, 4\), \(2, 4\), \(4,\)"),
    ],
)
def test_policy_loss_tensors(args, error, match):
    with pytest.raises(error, match=match):
        compute_policy_loss(*args)


def test_kl_k3_no_silent_broadcast():
    with pytest.raises(ValueError, match=r"sample_log_prob and other_log_prob must have the same shape"):
        kl_k3(X, X[0])
    with pytest.raises(TypeError, match=r"^other_log_prob must be a floating-point tensor"):
        kl_k3(X, X.long())


# --- aggregation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [3, None, b"token-mean"])
def test_loss_agg_mode_type(mode):
    with pytest.raises(TypeError, match=r"^loss_agg_mode must be a str"):
        check_loss_agg_mode(mode)
    with pytest.raises(TypeError, match=r"^loss_agg_mode must be a str"):
        agg_loss(X, MASK, mode)


def test_agg_loss_tensors():
    with pytest.raises(TypeError, match=r"^mask must be a torch.Tensor, got list"):
        agg_loss(X, MASK.tolist(), "token-mean")
    with pytest.raises(TypeError, match=r"^mask must be a bool, integer or floating-point tensor"):
        agg_loss(X, MASK.to(torch.complex64), "token-mean")
    with pytest.raises(TypeError, match=r"^values must be a floating-point tensor"):
        agg_loss(X.long(), MASK, "token-mean")
    with pytest.raises(ValueError, match=r"^values and weights must have the same shape"):
        aggregate(X, torch.ones(3))


@pytest.mark.parametrize("bad", [-1.0, math.nan], ids=["negative", "nan"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_negative_or_nan_mask(bad, mode):
    mask = MASK.float()
    mask[1, 2] = bad
    with pytest.raises(ValueError, match=r"^mask must be >= 0 \(0/1, or per-token weights\), found"):
        agg_loss(X, mask, mode)


def test_sequence_index_checks():
    with pytest.raises(TypeError, match=r"^seq_index must be an integer tensor, got dtype torch.float32"):
        sequence_token_counts(MASK, SEQ.float(), 2)
    with pytest.raises(ValueError, match=r"^mask and seq_index must have the same shape"):
        loss_weights(MASK, SEQ[:, :3], "token-mean", seq_token_counts=torch.ones(2), num_tokens=8, num_seqs=2)
    for bad in (2, -1):
        seq = SEQ.clone()
        seq[0, 1] = bad
        with pytest.raises(ValueError, match=rf"^seq_index must hold sequence ids in \[0, 2\), found {bad}"):
            sequence_token_counts(MASK, seq, 2)
        with pytest.raises(ValueError, match=rf"^seq_index must hold sequence ids in \[0, 2\), found {bad}"):
            loss_weights(MASK, seq, "seq-mean-token-mean", seq_token_counts=torch.ones(2), num_tokens=8, num_seqs=2)
    with pytest.raises(TypeError, match=r"^num_seqs must be an int, got float"):
        sequence_token_counts(MASK, SEQ, 2.0)
    with pytest.raises(ValueError, match=r"^num_seqs must be >= 0, got -1"):
        sequence_token_counts(MASK, SEQ, -1)


def test_counts_of_loss_weights():
    kwargs = {"seq_token_counts": torch.ones(2), "num_seqs": 2}
    with pytest.raises(ValueError, match=r"^num_tokens must be >= 0, got -3"):
        loss_weights(MASK, SEQ, "token-mean", num_tokens=-3, **kwargs)
    with pytest.raises(TypeError, match=r"^num_tokens must be a number, got str"):
        loss_weights(MASK, SEQ, "token-mean", num_tokens="8", **kwargs)


def test_on_cuda_bad_ids_and_masks_poison_instead_of_syncing(monkeypatch):
    """The CUDA path reads no value back (a host sync): what a bad id or mask value
    touches becomes NaN (the loss is NaN), never an indexing assert and never a dropped token."""
    monkeypatch.setattr(ppo_loss, "_values_checked", lambda tensor: False)  # as for CUDA tensors
    seq = SEQ.clone()
    seq[0, 1] = 5
    mask = MASK.float()
    mask[1, 3] = -1.0
    counts = sequence_token_counts(MASK, seq, 2)
    weights = loss_weights(mask, SEQ, "token-mean", seq_token_counts=torch.ones(2), num_tokens=8, num_seqs=2)
    by_seq = loss_weights(MASK, seq, "seq-mean-token-mean", seq_token_counts=counts, num_tokens=8, num_seqs=2)
    assert counts[1].isnan() and weights[1, 3].isnan() and by_seq[0, 1].isnan()
    assert not weights[0].isnan().any()


def test_schedule_loss_scale_bool():
    with pytest.raises(ValueError, match=r"^num_microbatches must be a positive int, got True"):
        schedule_loss_scale(num_microbatches=True, cp_size=1, dp_cp_size=1)


# --- batching ------------------------------------------------------------------------------------

TOKENS = torch.arange(10)
CU = torch.tensor([0, 4, 10])
RESPONSE = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cu_seqlens": [0, 4.5, 10]}, TypeError, r"^cu_seqlens must hold ints, got float 4.5"),
        ({"cu_seqlens": torch.tensor([0.0, 4.0, 10.0])}, TypeError, r"^cu_seqlens must be a 1-D integer tensor"),
        ({"tokens": TOKENS > 3}, TypeError, r"^tokens must be an integer tensor, got dtype torch.bool"),
        ({"tokens": TOKENS.tolist()}, TypeError, r"^tokens must be a torch.Tensor, got list"),
        ({"advantages": torch.ones(10, dtype=torch.long)}, TypeError, r"^advantages must be a floating-point tensor"),
        ({"old_log_probs": [0.0] * 10}, TypeError, r"^old_log_probs must be a torch.Tensor, got list"),
    ],
)
def test_packed_rollout_inputs(kwargs, error, match):
    args = {"tokens": TOKENS, "cu_seqlens": CU, "response_mask": RESPONSE, **kwargs}
    with pytest.raises(error, match=match):
        PackedRollout(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"micro_batch_size": 2.5}, TypeError, r"^micro_batch_size must be an int, got float"),
        ({"micro_batch_size": True}, TypeError, r"^micro_batch_size must be an int, got bool"),
        ({"max_tokens": "4"}, TypeError, r"^max_tokens must be an int, got str"),
        ({"micro_batch_size": 2, "align": 0}, ValueError, r"^align must be >= 1, got 0"),
        ({"max_tokens": 8, "seq_lengths": [3, -4]}, ValueError, r"sequence length in seq_lengths must be >= 0"),
    ],
)
def test_make_micro_batches_inputs(kwargs, error, match):
    kwargs = {"seq_lengths": [3, 4, 5], **kwargs}
    with pytest.raises(error, match=match):
        make_micro_batches(**kwargs)


@pytest.mark.parametrize(
    ("seq_ids", "kwargs", "error", "match"),
    [
        ([0, 1], {"align": 0}, ValueError, r"^align must be >= 1, got 0"),
        ([0, 1], {"align": 2.0}, TypeError, r"^align must be an int, got float"),
        ([0, 5], {"align": 2}, ValueError, r"^seq_ids must be ids of the rollout's 2 sequences, got 5"),
        ([-1], {"align": 2}, ValueError, r"^every id in seq_ids must be >= 0, got -1"),
        ([], {"align": 2}, ValueError, r"^seq_ids must name at least one sequence"),
        ([0, 1], {"align": 2, "pad_to": 14.0}, TypeError, r"^pad_to must be an int, got float"),
        ([0, 1], {"align": 2, "ignore_index": -100.0}, TypeError, r"^ignore_index must be an int, got float"),
    ],
)
def test_pack_micro_batch_inputs(seq_ids, kwargs, error, match):
    rollout = PackedRollout(TOKENS, CU, RESPONSE)
    with pytest.raises(error, match=match):
        pack_micro_batch(rollout, seq_ids, **kwargs)
    with pytest.raises(TypeError, match=r"^rollout must be a PackedRollout"):
        pack_micro_batch(TOKENS, [0], align=2)
