"""The head against the float64 reference (:mod:`mcore_ppo_testing.reference`), on seeded random data.

Tolerances, and why (``rtol`` is relative to the tensor's largest reference value, see
:func:`mcore_ppo_testing.reference.assert_close`):

* Every output is fp32 and every backend statistic is accumulated in fp32, whatever the input
  dtype (bf16 inputs are compared with the fp64 reference of the *same* bf16 values upcast, so
  only the head's own arithmetic is measured). With h ≤ 32 and V ≤ 300, fp32 rounding of the
  GEMM, the exp-sums and the log gives errors of a few 1e-7 relative: ``rtol = 1e-5`` for the
  outputs and for fp32 gradients.
* Gradients of bf16 inputs are accumulated in fp32 and cast to bf16 once at the end; that cast
  alone is a relative error of up to 2^-9 per element, so they get ``elementwise_rtol = 2^-8``
  (a factor 2 of margin) on top of the fp32 ``rtol``. Overall ~1e-2 relative at worst.
* Logits scaled to ~1e4 (see :func:`test_extreme_logits`): the fp32 GEMM that produces the
  logits is itself off by ~scale·eps·sqrt(h) (≈1e-3 absolute at 1e4), before the head does
  anything, and the exact answer depends on the logits to first order; so the tolerances there
  are relative to the logit *scale*, not to the outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import torch_backend
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants, error_table, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

OUT_RTOL = 1e-5  # fp32 outputs and fp32 gradients, relative to the tensor's max
BF16_CAST_RTOL = 2.0**-8  # the final cast of a gradient to bf16 (2^-9 relative, ×2 margin)
# Probabilities below fp32's smallest normal (~1e-38) flush to 0 in the head but not in the fp64
# reference; their gradient terms are < 1e-38·|x|·|g| — far below this floor.
GRAD_ATOL = 1e-30
LAYOUTS = ("2d", "3d", "packed")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def _report_errors(request):
    """After this module: print the largest relative error seen per output and dtype."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():  # print past pytest's output capture, as live logs do
        reporter.write_line("")
        for line in error_table().splitlines():
            reporter.write_line(line)


def set_chunks(monkeypatch: pytest.MonkeyPatch, token_chunk: int, vocab_chunk: int) -> None:
    """Shrink the torch backend's chunks so several chunks and ragged tails are exercised."""
    monkeypatch.setattr(torch_backend, "TOKEN_CHUNK", token_chunk)
    monkeypatch.setattr(torch_backend, "VOCAB_CHUNK", vocab_chunk)


def label_shape(layout: str, tokens: int, batch: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(hidden shape without h, labels shape)`` of a layout with about ``tokens`` tokens."""
    if layout == "2d":
        return (tokens,), (tokens,)
    if layout == "packed":
        return (tokens, 1), (1, tokens)
    seq = max(tokens // batch, 2)
    return (seq, batch), (batch, seq)


def make_case(
    layout: str,
    dtype: torch.dtype,
    vocab: int,
    hidden_size: int,
    tokens: int,
    gen: torch.Generator,
    ignore_fraction: float = 0.3,
    logit_std: float = 3.0,
) -> dict[str, torch.Tensor]:
    """Random hidden, weight, labels (first and last vocab id present, ignored sprinkled) and g, e."""
    lead, lshape = label_shape(layout, tokens)
    hidden = torch.randn(*lead, hidden_size, generator=gen) * logit_std
    weight = torch.randn(vocab, hidden_size, generator=gen) / math.sqrt(hidden_size)
    labels = torch.randint(0, vocab, lshape, generator=gen)
    flat = labels.view(-1)
    ignored = torch.rand(flat.shape, generator=gen) < ignore_fraction
    flat[ignored] = IGNORE_INDEX
    flat[0], flat[-1] = 0, vocab - 1  # both ends of the vocab, always
    g = torch.randn(lshape, generator=gen)
    e = torch.randn(lshape, generator=gen)
    # Per-token upstream gradients of both signs, always.
    g.view(-1)[0], g.view(-1)[-1] = g.view(-1)[0].abs() + 0.1, -g.view(-1)[-1].abs() - 0.1
    e.view(-1)[0], e.view(-1)[-1] = -e.view(-1)[0].abs() - 0.1, e.view(-1)[-1].abs() + 0.1
    return {"hidden": hidden.to(dtype), "weight": weight.to(dtype), "labels": labels, "g": g, "e": e}


def run_head(
    case: dict[str, torch.Tensor],
    temperature: float,
    use: str = "both",
    **kwargs,
) -> dict[str, torch.Tensor | None]:
    """Forward + backward of ``Σ g·log_prob + Σ e·entropy`` (or one term) through the public API.

    Also checks that no input was mutated and that the outputs satisfy the invariants.
    """
    originals = {k: v.clone() for k, v in case.items()}
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=temperature, backend="torch", **kwargs
    )
    check_invariants(log_prob, entropy, case["labels"], case["weight"].shape[0])
    terms = []
    if use in ("both", "log_prob"):
        terms.append((log_prob * case["g"]).sum())
    if use in ("both", "entropy"):
        terms.append((entropy * case["e"]).sum())
    sum(terms).backward()
    for key, value in originals.items():
        assert torch.equal(case[key], value), f"input {key} was mutated"
    assert torch.equal(hidden.detach(), originals["hidden"]) and torch.equal(weight.detach(), originals["weight"])
    return {"log_prob": log_prob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}


def compare(
    out: dict,
    ref: dict,
    dtype: torch.dtype,
    *,
    rtol: float = OUT_RTOL,
    atol: float = 0.0,
    grad_rtol: float = OUT_RTOL,
    tag: str = "",
    grad_tag: str | None = None,
    track_grads: bool = True,
    track_scale: float | None = None,
) -> None:
    """Outputs and both gradients against the reference, with the tolerances of the module doc.

    Gradients are compared relative to the magnitude of the terms they sum (``*_terms`` of the
    reference), so a gradient that cancels to ~0 is not held to an impossible relative bound.
    ``track_scale`` (outputs: error / track_scale; gradients: error / their largest term
    magnitude) replaces the max-norm relative error in the error table, under ``grad_tag``.
    """
    for name in ("log_prob", "entropy"):
        assert_close(out[name], ref[name], name=name + tag, dtype=dtype, rtol=rtol, atol=atol, track_scale=track_scale)
    cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    for name in ("d_hidden", "d_weight"):
        assert out[name] is not None, f"{name} is None: the gradient did not reach the input"
        assert out[name].dtype == dtype, f"{name} dtype {out[name].dtype}, expected {dtype}"
        assert_close(
            out[name],
            ref[name],
            name=name + (tag if grad_tag is None else grad_tag),
            dtype=dtype,
            rtol=grad_rtol,
            atol=GRAD_ATOL,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
            track=track_grads,
            track_scale=None if track_scale is None else ref[name + "_terms"].max().item(),
        )


# (token_chunk, vocab_chunk, vocab): chunks that do not divide the token count or the vocab.
CHUNKINGS = [(5, 7, 53), (3, 64, 131), (2048, 4096, 300)]


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=lambda c: f"tc{c[0]}-vc{c[1]}-V{c[2]}")
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(layout, dtype, temperature, chunking, monkeypatch):
    """Values and both gradients, every layout × dtype × T × chunking, ignored labels sprinkled."""
    token_chunk, vocab_chunk, vocab = chunking
    set_chunks(monkeypatch, token_chunk, vocab_chunk)
    case = make_case(layout, dtype, vocab, 24, 23, generator(next_seed()))
    out = run_head(case, temperature)
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], case["e"])
    compare(out, ref, dtype)


def test_chunking_is_exercised(monkeypatch):
    """The monkeypatched chunk sizes really drive the loop: ⌈n/tc⌉·⌈V/vc⌉ logit blocks per pass."""
    set_chunks(monkeypatch, 5, 7)
    calls = []
    original = torch_backend._tempered_logits

    def spy(x, w, temperature):
        calls.append((x.shape[0], w.shape[0]))
        return original(x, w, temperature)

    monkeypatch.setattr(torch_backend, "_tempered_logits", spy)
    case = make_case("2d", torch.float32, 37, 8, 23, generator(next_seed()))
    run_head(case, 1.0)
    blocks = math.ceil(23 / 5) * math.ceil(37 / 7)
    assert len(calls) == 2 * blocks  # forward statistics + backward recompute
    assert {n for n, _ in calls} == {5, 3} and {v for _, v in calls} == {7, 2}  # ragged tails seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_ignored(layout, dtype, monkeypatch):
    """Every token ignored: outputs and gradients exactly zero, nothing NaN."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case(layout, dtype, 29, 16, 17, generator(next_seed()))
    case["labels"].fill_(IGNORE_INDEX)
    out = run_head(case, 0.7)
    for name in ("log_prob", "entropy", "d_hidden", "d_weight"):
        assert out[name] is not None and torch.isfinite(out[name]).all(), name
        assert (out[name] == 0).all(), f"{name} must be exactly zero when every label is ignored"


@pytest.mark.parametrize("ignore_index", [-1, 5])
def test_custom_ignore_index(ignore_index, monkeypatch):
    """A non-default ignore_index (even one inside the vocab) is honoured; -100 is then a bad label."""
    set_chunks(monkeypatch, 5, 7)
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, 31, 16, 24, gen, ignore_fraction=0.0)
    labels = case["labels"]
    labels[labels == ignore_index] = 0
    labels.view(-1)[torch.rand(labels.numel(), generator=gen) < 0.3] = ignore_index
    out = run_head(case, 1.3, ignore_index=ignore_index)
    ref = reference(case["hidden"], case["weight"], labels, 1.3, case["g"], case["e"], ignore_index=ignore_index)
    compare(out, ref, torch.float32)


def test_int32_labels(monkeypatch):
    """int32 labels (as some data loaders produce) give the same answer as int64."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case("packed", torch.float32, 53, 16, 19, generator(next_seed()))
    case["labels"] = case["labels"].to(torch.int32)
    out = run_head(case, 0.7)
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
    set_chunks(monkeypatch, 5, 7)
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
    out = run_head(case, 1.0)
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
    set_chunks(monkeypatch, 5, 7)
    vocab = 97
    case = make_case("2d", dtype, vocab, 16, 22, generator(next_seed()))
    if how == "zero_hidden":
        case["hidden"] = torch.zeros_like(case["hidden"])
    else:
        case["weight"] = case["weight"][:1].expand(vocab, -1).contiguous()
    out = run_head(case, 0.7)
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
    set_chunks(monkeypatch, 64, 7)
    gen = generator(next_seed())
    h = 8
    weight = torch.randn(1, h, generator=gen).expand(vocab, h) + 1e-7 * torch.randn(vocab, h, generator=gen)
    hidden = torch.randn(64, h, generator=gen) * 3
    labels = torch.randint(0, vocab, (64,), generator=gen)
    with torch.no_grad():
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
    check_invariants(log_prob, entropy, labels, vocab)  # entropy <= log V, exactly
    assert_close(entropy, torch.full((64,), math.log(vocab)), name="entropy", dtype=torch.float32, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_non_contiguous_inputs(layout, dtype, monkeypatch):
    """Transposed and strided views of hidden, weight, labels and upstream gradients."""
    set_chunks(monkeypatch, 5, 7)
    gen = generator(next_seed())
    vocab, h = 45, 12
    weight = (torch.randn(h, vocab, generator=gen) / math.sqrt(h)).to(dtype).t()  # [V, h], transposed
    if layout == "2d":
        n = 19
        hidden = (torch.randn(2 * n, 2 * h, generator=gen) * 3).to(dtype)[::2, 1::2]  # strided
        labels = torch.randint(0, vocab, (3 * n,), generator=gen)[::3]
        g, e = torch.randn(2 * n, generator=gen)[::2], torch.randn(n, 2, generator=gen)[:, 1]
    else:
        s, b = 7, 3
        hidden = (torch.randn(b, s, h, generator=gen) * 3).to(dtype).transpose(0, 1)  # [s, b, h] view
        labels = torch.randint(0, vocab, (s, b), generator=gen).t()  # [b, s] view
        g, e = torch.randn(s, b, generator=gen).t(), torch.randn(s, b, generator=gen).t()
    labels[..., 1] = IGNORE_INDEX
    assert not (hidden.is_contiguous() or weight.is_contiguous() or labels.is_contiguous() or g.is_contiguous())
    case = {"hidden": hidden, "weight": weight, "labels": labels, "g": g, "e": e}
    out = run_head(case, 1.3)
    ref = reference(hidden, weight, labels, 1.3, g, e)
    compare(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("use", ["log_prob", "entropy"])
def test_only_one_output_used(use, dtype, monkeypatch):
    """The other output's gradient is None (never materialised): works and equals the reference."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case("3d", dtype, 57, 16, 24, generator(next_seed()))
    out = run_head(case, 0.7, use=use)
    g = case["g"] if use == "log_prob" else None
    e = case["e"] if use == "entropy" else None
    ref = reference(case["hidden"], case["weight"], case["labels"], 0.7, g, e)
    compare(out, ref, dtype)


@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_gradcheck_float64(layout, monkeypatch):
    """torch.autograd.gradcheck in float64 on small shapes, with chunking and ignored tokens."""
    set_chunks(monkeypatch, 2, 3)
    gen = generator(next_seed())
    vocab, h = 8, 4
    lead, lshape = label_shape(layout, 6, batch=2)
    hidden = torch.randn(*lead, h, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, vocab, lshape, generator=gen)
    labels.view(-1)[:3] = torch.tensor([0, vocab - 1, IGNORE_INDEX])

    def head(x, w):
        return mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend="torch")

    assert torch.autograd.gradcheck(head, (hidden, weight), eps=1e-6, atol=1e-7, rtol=1e-5)


class _SavedCounter:
    """saved_tensors_hooks that record every tensor autograd saves (dtype and shape)."""

    def __init__(self):
        self.saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def hooks(self):
        def pack(t):
            self.saved.append((t.dtype, tuple(t.shape)))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_tensors(dtype):
    """Grad-enabled forward saves fp32 per-token values; a no-grad forward saves nothing."""
    case = make_case("3d", dtype, 33, 16, 24, generator(next_seed()))
    hidden = case["hidden"].requires_grad_(True)
    weight = case["weight"].requires_grad_(True)
    n_tokens = case["labels"].numel()

    with_grad = _SavedCounter()
    with with_grad.hooks():
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], backend="torch")
    assert with_grad.saved, "a grad-enabled forward must save what the backward recomputes from"
    per_token_floats = [d for d, shape in with_grad.saved if shape == (n_tokens,) and d.is_floating_point]
    assert len(per_token_floats) >= 2, f"expected saved per-token lse and entropy, saw {with_grad.saved}"
    assert all(d == torch.float32 for d in per_token_floats), f"saved per-token values must be fp32: {with_grad.saved}"
    # Nothing [tokens, V]-sized is kept.
    assert all(math.prod(shape) <= max(hidden.numel(), weight.numel()) for _, shape in with_grad.saved)

    no_grad = _SavedCounter()
    with no_grad.hooks(), torch.no_grad():
        lp_ng, ent_ng = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], backend="torch")
    assert no_grad.saved == [], f"no-grad forward saved {no_grad.saved}"
    assert torch.equal(lp_ng, log_prob.detach()) and torch.equal(ent_ng, entropy.detach())


# --- seed bug: gradients must reach hidden for 3-D input -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["3d", "packed"])
def test_gradient_reaches_3d_hidden(layout, dtype, monkeypatch):
    """Regression: hidden [s,b,h] / [t,1,h] as a leaf gets .grad, equal to the reference."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case(layout, dtype, 39, 16, 24, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(True)
    weight = case["weight"].clone()  # frozen: only hidden asks for a gradient
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], temperature=1.3)
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    assert hidden.grad is not None, "gradient did not reach 3-D hidden"
    assert weight.grad is None
    ref = reference(case["hidden"], case["weight"], case["labels"], 1.3, case["g"], case["e"])
    cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    assert_close(
        hidden.grad,
        ref["d_hidden"],
        name="d_hidden",
        dtype=dtype,
        rtol=OUT_RTOL,
        elementwise_rtol=cast,
        terms=ref["d_hidden_terms"],
    )


def test_gradient_reaches_backbone(monkeypatch):
    """Regression: through a backbone layer producing 3-D hidden, the layer's parameter gets its gradient."""
    set_chunks(monkeypatch, 5, 7)
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, 39, 16, 24, gen)
    x = case["hidden"]
    proj = (torch.randn(16, 16, generator=gen) / 4).requires_grad_(True)
    weight = case["weight"].clone().requires_grad_(True)
    hidden = torch.tanh(x @ proj)  # a non-leaf [s, b, h]
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], temperature=0.7)
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    assert proj.grad is not None
    ref = reference(hidden.detach(), case["weight"], case["labels"], 0.7, case["g"], case["e"])
    x64, p64 = x.double(), proj.detach().double().requires_grad_(True)
    (torch.tanh(x64 @ p64) * ref["d_hidden"]).sum().backward()
    assert_close(proj.grad, p64.grad, name="d_backbone", dtype=torch.float32, rtol=OUT_RTOL)
    assert_close(weight.grad, ref["d_weight"], name="d_weight", dtype=torch.float32, rtol=OUT_RTOL)


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_gradient_to_one_input_only(which, monkeypatch):
    """Only one input requires grad: it gets the reference gradient, the other stays None."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case("2d", torch.float32, 39, 16, 24, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(which == "hidden")
    weight = case["weight"].clone().requires_grad_(which == "weight")
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], temperature=1.0)
    check_invariants(log_prob, entropy, case["labels"], 39)
    ((log_prob * case["g"]).sum() + (entropy * case["e"]).sum()).backward()
    ref = reference(case["hidden"], case["weight"], case["labels"], 1.0, case["g"], case["e"])
    got, other = (hidden, weight) if which == "hidden" else (weight, hidden)
    assert other.grad is None
    name = "d_" + which
    assert_close(got.grad, ref[name], name=name, dtype=torch.float32, rtol=OUT_RTOL, terms=ref[name + "_terms"])


def test_repeated_backward_accumulates(monkeypatch):
    """Two micro-batches through the same weight: weight.grad is the sum (no state left behind)."""
    set_chunks(monkeypatch, 5, 7)
    gen = generator(next_seed())
    weight = (torch.randn(29, 16, generator=gen) / 4).requires_grad_(True)
    expected = torch.zeros(29, 16, dtype=torch.float64)
    terms = torch.zeros(29, 16, dtype=torch.float64)
    for _ in range(2):
        case = make_case("3d", torch.float32, 29, 16, 18, gen)
        lp, ent = mcore_ppo.fused_log_probs_and_entropy(case["hidden"], weight, case["labels"])
        check_invariants(lp, ent, case["labels"], 29)
        ((lp * case["g"]).sum() + (ent * case["e"]).sum()).backward()
        ref = reference(case["hidden"], weight, case["labels"], 1.0, case["g"], case["e"])
        expected += ref["d_weight"]
        terms += ref["d_weight_terms"]
    assert_close(weight.grad, expected, name="d_weight", dtype=torch.float32, rtol=OUT_RTOL, terms=terms)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mean_loss_broadcast_upstream(layout, monkeypatch):
    """A mean loss hands the head an expanded (stride-0) upstream gradient: same as a dense one."""
    set_chunks(monkeypatch, 5, 7)
    case = make_case(layout, torch.float32, 43, 16, 21, generator(next_seed()))
    hidden = case["hidden"].clone().requires_grad_(True)
    weight = case["weight"].clone().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, case["labels"], temperature=0.7)
    check_invariants(log_prob, entropy, case["labels"], 43)
    (log_prob.mean() - 0.01 * entropy.sum()).backward()
    n = case["labels"].numel()
    g = torch.full(case["labels"].shape, 1.0 / n)
    e = torch.full(case["labels"].shape, -0.01)
    ref = reference(case["hidden"], case["weight"], case["labels"], 0.7, g, e)
    out = {"log_prob": log_prob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}
    compare(out, ref, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_tokens(layout):
    """An empty micro-batch (no tokens on this rank) returns empty outputs and zero gradients."""
    lead, lshape = {"2d": ((0,), (0,)), "3d": ((0, 2), (2, 0)), "packed": ((0, 1), (1, 0))}[layout]
    hidden = torch.randn(*lead, 8, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator(next_seed()), requires_grad=True)
    labels = torch.zeros(lshape, dtype=torch.long)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
    check_invariants(log_prob, entropy, labels, 11)
    (log_prob.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape
    assert weight.grad is not None and (weight.grad == 0).all()


def test_ignored_rows_with_inf_hidden_give_finite_gradients():
    """Padding rows (ignored labels) may hold inf: outputs there are 0, every gradient finite,
    and the valid rows' results equal those of a batch without the padding rows."""
    gen = generator(next_seed())
    hidden = torch.randn(9, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (9,), generator=gen)
    padded = (1, 5)
    hidden[list(padded)] = float("inf")
    labels[list(padded)] = -100
    keep = [i for i in range(9) if i not in padded]
    outs = []
    for h, y in ((hidden, labels), (hidden[keep], labels[keep])):
        x = h.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(x, w, y, temperature=0.7, backend="torch")
        (log_prob.sum() - 0.3 * entropy.sum()).backward()
        outs.append((log_prob, entropy, x.grad, w.grad))
    (lp, ent, gx, gw), (lp_ref, ent_ref, gx_ref, gw_ref) = outs
    assert torch.isfinite(gw).all() and torch.isfinite(gx).all()
    assert (lp[list(padded)] == 0).all() and (ent[list(padded)] == 0).all() and (gx[list(padded)] == 0).all()
    torch.testing.assert_close(lp[keep], lp_ref)
    torch.testing.assert_close(ent[keep], ent_ref)
    torch.testing.assert_close(gx[keep], gx_ref)
    torch.testing.assert_close(gw, gw_ref)
