"""Labels narrower than int64: compared with ``ignore_index`` and the vocab in int64.

Before: the comparison ran in the labels' own dtype, so ``ignore_index`` wrapped (-100 is 156 in
uint8, 2**32 is 0 in int32): real tokens were silently ignored (or the label-range check
flagged valid ones), in the head on both backends and in ``roll_and_split_labels``; and the
error message listed dtypes that were not the accepted ones. Now every dtype of
:data:`mcore_ppo.validation.LABEL_DTYPES` gives exactly what int64 labels give, the message
lists exactly those, and the CP label helpers refuse an ``ignore_index`` their dtype cannot hold.
"""

from __future__ import annotations

import pytest
import torch
from head_checks import TRITON_ON_CPU

import mcore_ppo
from mcore_ppo.parallel import roll_and_split_labels, roll_labels, split_for_cp
from mcore_ppo.validation import LABEL_DTYPES
from mcore_ppo_testing.reference import reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

BACKENDS = [
    "torch",
    pytest.param("triton", marks=TRITON_ON_CPU),
]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in LABEL_DTYPES]


def make(n=12, h=8, v=100):
    gen = generator(next_seed())
    return torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen), torch.randint(0, v, (n,), generator=gen)


def outputs_and_grads(hidden, weight, labels, backend, **kwargs):
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, backend=backend, **kwargs)
    (logp.sum() + ent.sum()).backward()
    return logp, ent, x.grad, w.grad


def ignore_for(dtype: torch.dtype) -> int:
    """An ignore_index the dtype can hold (and that is no vocab id): -100, or the dtype's max."""
    return -100 if torch.iinfo(dtype).min < 0 else torch.iinfo(dtype).max


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LABEL_DTYPES, ids=DTYPE_IDS)
def test_every_accepted_dtype_equals_int64(backend, dtype):
    hidden, weight, labels = make()
    ignore = ignore_for(dtype)
    labels[::4] = ignore
    expected = outputs_and_grads(hidden, weight, labels, backend, ignore_index=ignore)
    got = outputs_and_grads(hidden, weight, labels.to(dtype), backend, ignore_index=ignore)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert (got[0][::4] == 0).all() and (got[0][1::4] != 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_uint8_token_156_is_not_the_ignore_index(backend):
    """-100 wraps to 156 in uint8: token 156 must count, with the value of the fp64 reference."""
    hidden, weight, labels = make(v=200)
    labels[3] = 156
    logp, ent = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels.to(torch.uint8), backend=backend)
    ref = reference(hidden, weight, labels, 1.0)
    assert logp[3] != 0 and ent[3] != 0
    torch.testing.assert_close(logp.double(), ref["log_prob"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref["entropy"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_token_0_is_not_ignore_index_2_pow_32(backend):
    """2**32 wraps to 0 in int32: token 0 must count."""
    hidden, weight, labels = make()
    labels[0] = 0
    logp, _ = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels.to(torch.int32), ignore_index=2**32, backend=backend
    )
    expected, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, ignore_index=2**32, backend=backend)
    assert logp[0] != 0
    assert torch.equal(logp, expected)


def test_label_range_check_does_not_wrap():
    """uint8 labels and V = 300: `labels >= 300` in uint8 compared against 44 and flagged valid ids."""
    hidden, weight, labels = make(v=300)
    labels[:] = torch.arange(200, 212)
    logp, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels.to(torch.uint8))
    assert (logp < 0).all()
    # And a real out-of-range id of a narrow dtype is still reported, with its own value.
    with pytest.raises(ValueError, match=r"labels must be in \[0, 200\).*found 255"):
        mcore_ppo.fused_log_probs_and_entropy(hidden, weight[:200], torch.full((12,), 255, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint64, torch.bool, torch.float16, torch.complex64])
def test_rejected_dtypes_list_the_accepted_ones(dtype):
    hidden, weight, labels = make()
    accepted = ", ".join(DTYPE_IDS)
    with pytest.raises(TypeError, match=rf"labels must be an integer tensor \({accepted}\), got dtype {dtype}"):
        mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels.to(dtype))


def test_verl_entry_with_int16_labels():
    hidden, weight, labels = make()
    labels[1] = -100
    got = mcore_ppo.linear_cross_entropy(hidden, weight, labels.to(torch.int16))
    expected = mcore_ppo.linear_cross_entropy(hidden, weight, labels)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --- the CP label helpers -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_roll_refuses_an_ignore_index_the_dtype_cannot_hold(dtype):
    ids = torch.arange(8, dtype=dtype)[None]
    bad = -100 if dtype == torch.uint8 else 200
    for call in (
        lambda: roll_labels(ids, seq_dim=1, ignore_index=bad),
        lambda: roll_and_split_labels(ids, 2, 0, seq_dim=1, ignore_index=bad),
    ):
        with pytest.raises(ValueError, match=rf"ignore_index={bad} does not fit input_ids' dtype {dtype}"):
            call()


@pytest.mark.parametrize("dtype", LABEL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cu_seqlens", [None, [0, 4, 8]], ids=["padded", "packed"])
def test_roll_and_split_keeps_the_dtype_and_equals_int64(dtype, cu_seqlens):
    ids = torch.arange(10, 18)[None]
    ignore = ignore_for(dtype)
    got = roll_and_split_labels(ids.to(dtype), 2, 1, seq_dim=1, cu_seqlens=cu_seqlens, ignore_index=ignore)
    expected = roll_and_split_labels(ids, 2, 1, seq_dim=1, cu_seqlens=cu_seqlens, ignore_index=ignore)
    assert got.dtype == dtype
    assert torch.equal(got.long(), expected)
    assert torch.equal(
        split_for_cp(ids.to(dtype), 2, 1, seq_dim=1, cu_seqlens=cu_seqlens).long(),
        split_for_cp(ids, 2, 1, seq_dim=1, cu_seqlens=cu_seqlens),
    )
