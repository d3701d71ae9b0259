"""The head's values against the float64 reference, on seeded random data: every layout × dtype ×
temperature × chunking, ignored and custom-ignored labels, extreme and equal logits. Cases and
tolerances: ``head_checks.py``; gradients in corner cases: ``test_head_gradients.py``."""

from __future__ import annotations

import math

import pytest
import torch
from head_checks import DTYPES, LAYOUTS, OUT_RTOL, chunked_torch, compare, make_case, run_head

import mcore_ppo
from mcore_ppo.backends import torch_backend
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants, error_table, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread


@pytest.fixture(scope="module", autouse=True)
def _report_errors(summary_section):
    """After this module: the largest relative error seen per output and dtype, in the run's
    summary (tests/conftest.py), not among the progress dots."""
    yield
    summary_section("head vs the float64 reference: largest relative error", error_table().splitlines())


# (token_chunk, vocab_chunk, vocab): chunks that do not divide the token count or the vocab.
CHUNKINGS = [(5, 7, 53), (3, 64, 131), (2048, 4096, 300)]


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=lambda c: f"tc{c[0]}-vc{c[1]}-V{c[2]}")
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(layout, dtype, temperature, chunking, monkeypatch):
    """Values and both gradients, every layout × dtype × T × chunking, ignored labels sprinkled."""
    token_chunk, vocab_chunk, vocab = chunking
    backend = chunked_torch(token_chunk, vocab_chunk)
    case = make_case(layout, dtype, vocab, 24, 23, generator(next_seed()))
    out = run_head(case, temperature, backend=backend)
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], case["e"])
    compare(out, ref, dtype)


def test_chunking_is_exercised(monkeypatch):
    """The monkeypatched chunk sizes really drive the loop: ⌈n/tc⌉·⌈V/vc⌉ logit blocks per pass."""
    backend = chunked_torch(5, 7)
    calls = []
    original = torch_backend._tempered_logits

    def spy(x, w, temperature):
        calls.append((x.shape[0], w.shape[0]))
        return original(x, w, temperature)

    monkeypatch.setattr(torch_backend, "_tempered_logits", spy)
    case = make_case("2d", torch.float32, 37, 8, 23, generator(next_seed()))
    run_head(case, 1.0, backend=backend)
    blocks = math.ceil(23 / 5) * math.ceil(37 / 7)
    assert len(calls) == 2 * blocks  # forward statistics + backward recompute
    assert {n for n, _ in calls} == {5, 3} and {v for _, v in calls} == {7, 2}  # ragged tails seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_ignored(layout, dtype, monkeypatch):
    """Every token ignored: outputs and gradients exactly zero, nothing NaN."""
    backend = chunked_torch(5, 7)
    case = make_case(layout, dtype, 29, 16, 17, generator(next_seed()))
    case["labels"].fill_(IGNORE_INDEX)
    out = run_head(case, 0.7, backend=backend)
    for name in ("log_prob", "entropy", "d_hidden", "d_weight"):
        assert out[name] is not None and torch.isfinite(out[name]).all(), name
        assert (out[name] == 0).all(), f"{name} must be exactly zero when every label is ignored"


@pytest.mark.parametrize("ignore_index", [-1, 5])
def test_custom_ignore_index(ignore_index, monkeypatch):
    """A non-default ignore_index (even one inside the vocab) is honoured; -100 is then a bad label."""
    backend = chunked_torch(5, 7)
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, 31, 16, 24, gen, ignore_fraction=0.0)
    labels = case["labels"]
    labels[labels == ignore_index] = 0
    labels.view(-1)[torch.rand(labels.numel(), generator=gen) < 0.3] = ignore_index
    out = run_head(case, 1.3, ignore_index=ignore_index, backend=backend)
    ref = reference(case["hidden"], case["weight"], labels, 1.3, case["g"], case["e"], ignore_index=ignore_index)
    compare(out, ref, torch.float32)


def test_int32_labels(monkeypatch):
    """int32 labels (as some data loaders produce) give the same answer as int64."""
    backend = chunked_torch(5, 7)
    case = make_case("packed", torch.float32, 53, 16, 19, generator(next_seed()))
    case["labels"] = case["labels"].to(torch.int32)
    out = run_head(case, 0.7, backend=backend)
    ref = reference(case["hidden"], case["weight"], case["labels"].long(), 0.7, case["g"], case["e"])
    compare(out, ref, torch.float32)


LOGIT_SCALE = 1e4
# The fp32 GEMM producing logits of size ~LOGIT_SCALE from an h=16 dot product is off by up to
# ~h·eps32·scale ≈ 1e-6·scale in the worst case (≈ sqrt(h)·eps32·scale typically), before the
# head does anything; log_prob, entropy and the gradients are Lipschitz in the logits with
# constants O(1) (O(|x|, |w|) for the gradients), so they inherit an absolute error ~1e-6·scale.
# 4e-6·scale leaves a small margin for the head's own fp32 rounding.
SCALE_ATOL = 4e-6 * LOGIT_SCALE


@pytest.mark.parametrize("mode", ["spread", "shift_up", "shift_down"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_logits(mode, dtype, monkeypatch):
    """Logits of size ~1e4: spread (±1e4, near one-hot) or shifted by ±1e4 (O(1) spread).

    Shifting every logit of a token by the same constant leaves the exact answer unchanged, so
    the shifted cases test that the head never forms exp of a large number.
    """
    backend = chunked_torch(5, 7)
    gen = generator(next_seed())
    h = 16
    case = make_case("3d", dtype, 41, h, 21, gen, logit_std=1.0)
    hidden, weight = case["hidden"].float(), case["weight"].float()
    if mode == "spread":
        hidden = hidden * (LOGIT_SCALE / math.sqrt(h))  # z = x·w ~ N(0, scale²)
    else:
        # Coordinate 0 carries a constant: x_0 = ±100, w_j0 = 100 for every row → z_j ± 1e4.
        sign = 1.0 if mode == "shift_up" else -1.0
        hidden[..., 0] = sign * 100.0
        weight[:, 0] = 100.0
    case["hidden"], case["weight"] = hidden.to(dtype), weight.to(dtype)
    out = run_head(case, 1.0, backend=backend)
    ref = reference(case["hidden"], case["weight"], case["labels"], 1.0, case["g"], case["e"])
    # A logit error δz moves p_j by ≲ 2·δz·p_j (z_j and lse both move), so each gradient is off
    # by ≲ 2·δz times the magnitude of the terms it sums (see mcore_ppo_testing.reference._gradient_term_magnitudes).
    # Error table: outputs relative to the logit scale, gradients relative to their largest term
    # magnitude (the max-norm relative error means little where a coordinate cancels to ~0).
    compare(
        out,
        ref,
        dtype,
        rtol=OUT_RTOL,
        atol=SCALE_ATOL,
        grad_rtol=OUT_RTOL + 2 * SCALE_ATOL,
        tag="[logits 1e4, err/1e4]",
        grad_tag="[logits 1e4, err/max term]",
        track_scale=LOGIT_SCALE,
    )
    if mode != "spread":
        # Shift invariance, independent of the reference: the shifted outputs are O(1).
        assert out["log_prob"].abs().max() < 100 and out["entropy"].max() <= math.log(41) + 1e-6


@pytest.mark.parametrize("how", ["zero_hidden", "equal_rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_equal_logits(how, dtype, monkeypatch):
    """All logits of a token equal: entropy = log V and log p = -log V (to fp32 rounding)."""
    backend = chunked_torch(5, 7)
    vocab = 97
    case = make_case("2d", dtype, vocab, 16, 22, generator(next_seed()))
    if how == "zero_hidden":
        case["hidden"] = torch.zeros_like(case["hidden"])
    else:
        case["weight"] = case["weight"][:1].expand(vocab, -1).contiguous()
    out = run_head(case, 0.7, backend=backend)
    valid = case["labels"] != IGNORE_INDEX
    log_v = math.log(vocab)
    assert_close(out["entropy"][valid], torch.full((int(valid.sum()),), log_v), name="entropy", dtype=dtype, rtol=1e-6)
    assert_close(
        out["log_prob"][valid], torch.full((int(valid.sum()),), -log_v), name="log_prob", dtype=dtype, rtol=1e-6
    )
    ref = reference(case["hidden"], case["weight"], case["labels"], 0.7, case["g"], case["e"])
    # With equal rows d_hidden = w·Σ_j dz_j = 0 exactly: its max-norm relative error is meaningless.
    compare(out, ref, dtype, tag="[equal logits]", track_grads=how == "zero_hidden")


@pytest.mark.parametrize("vocab", [256, 257, 300])
def test_near_uniform_entropy_never_exceeds_log_vocab(vocab, monkeypatch):
    """Regression: near-uniform logits must not give an entropy above log V (it came out 1 ulp over).

    ``H = log S - U/S`` rounds to within an ulp of log V there; the head must round it onto the
    right side of the bound, here checked exactly (fp64 comparison with the real log V).
    """
    backend = chunked_torch(64, 7)
    gen = generator(next_seed())
    h = 8
    weight = torch.randn(1, h, generator=gen).expand(vocab, h) + 1e-7 * torch.randn(vocab, h, generator=gen)
    hidden = torch.randn(64, h, generator=gen) * 3
    labels = torch.randint(0, vocab, (64,), generator=gen)
    with torch.no_grad():
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend=backend)
    check_invariants(log_prob, entropy, labels, vocab)  # entropy <= log V, exactly
    assert_close(entropy, torch.full((64,), math.log(vocab)), name="entropy", dtype=torch.float32, rtol=1e-6)
