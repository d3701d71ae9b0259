"""``fused_topk`` on one rank against the fp64 full-logits reference (``mcore_ppo_testing.topk_reference``).

Every layout ([s,b,h], packed [t,1,h], [n,h]) × k in {1, 8, 64, 128} with the token and vocab
chunks set small by a ``TopKConfig`` (vocab chunks narrower than k, ragged tails), V up to 4096;
exactly tied logits across chunks (integer data); ignored tokens; k = V; extreme logits; bad
inputs and bad ``TopKConfig`` fields; a per-token temperature (both paths, every layout, its
checks, NaN outputs for a bad value with ``validate=False``). The Triton kernels' path runs
under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it on a machine without CUDA).

fp64 inputs: ids equal to the reference's, values to 1e-12. fp32 inputs: the top-k values equal
the reference's sorted values and the reference's log-prob at each returned id equals the
returned one (so a near-tie decided the other way by fp32 rounding cannot fail the test, a wrong
id can).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends.triton_launch import Launcher
from mcore_ppo.distill import MAX_TOPK, TopKConfig, fused_topk, topk_config, topk_torch, topk_triton
from mcore_ppo.distill import topk as topk_module
from mcore_ppo.numerics import cdiv, inverse_temperature
from mcore_ppo_testing.seeds import generator, next_seed
from mcore_ppo_testing.topk_reference import full_pairs, integer_case, log_probs_at, topk_reference

pytestmark = pytest.mark.usefixtures("one_thread")

IGNORE = -100
HIDDEN = 16
# layout -> (hidden's leading shape, labels' shape)
LAYOUTS = {"sbh": ((6, 3), (3, 6)), "thd": ((17, 1), (1, 17)), "nh": ((19,), (19,))}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def chunked(token_chunk: int, vocab_chunk: int) -> TopKConfig:
    """The torch path's logits in blocks of ``token_chunk × vocab_chunk``."""
    return TopKConfig(token_chunk=token_chunk, vocab_chunk=vocab_chunk)


def random_case(layout: str, vocab: int, dtype: torch.dtype, scale: float = 1.0):
    lead, label_shape = LAYOUTS[layout]
    gen = generator(next_seed())
    hidden = (scale * torch.randn(*lead, HIDDEN, generator=gen, dtype=torch.float64)).to(dtype)
    weight = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, label_shape, generator=gen)
    labels.view(-1)[torch.randperm(labels.numel(), generator=gen)[: labels.numel() // 4]] = IGNORE
    return hidden, weight, labels


def check_against_reference(out, ref, dtype: torch.dtype, *, exact_ids: bool) -> None:
    """``out`` (a TopK) against the fp64 reference; see the module doc for what is compared."""
    tol = TOL[dtype]
    assert out.ids.dtype == torch.int64 and out.ids.shape == ref.ids.shape
    assert out.log_probs.dtype == dtype and out.log_probs.shape == ref.log_probs.shape
    assert out.tail_log_mass.shape == ref.tail_log_mass.shape
    assert not out.log_probs.requires_grad and not out.tail_log_mass.requires_grad
    if exact_ids:
        assert torch.equal(out.ids, ref.ids)
    else:
        assert torch.equal(out.ids == IGNORE, ref.ids == IGNORE)
        valid_ids = out.ids[ref.valid]
        assert (valid_ids >= 0).all() and (valid_ids < ref.full_log_probs.shape[-1]).all()
        sorted_ids = valid_ids.sort(dim=-1).values
        assert (sorted_ids[..., 1:] > sorted_ids[..., :-1]).all(), "an id returned twice for one token"
        torch.testing.assert_close(out.log_probs.double(), log_probs_at(ref, out.ids), rtol=0, atol=tol)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=tol)
    # Most likely first, every row.
    assert (out.log_probs[..., 1:] <= out.log_probs[..., :-1]).all()
    finite = torch.isfinite(ref.tail_log_mass)
    assert torch.equal(torch.isfinite(out.tail_log_mass), finite)
    torch.testing.assert_close(out.tail_log_mass.double()[finite], ref.tail_log_mass[finite], rtol=0, atol=tol)


@pytest.mark.parametrize("k", [1, 8, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_fp64_reference(layout, dtype, k):
    """Random data, V = 1000 in vocab chunks of 100 (narrower than k = 128), token chunks of 5."""
    config = chunked(5, 100)
    hidden, weight, labels = random_case(layout, 1000, dtype)
    out = fused_topk(hidden, weight, k, temperature=0.7, labels=labels, config=config)
    ref = topk_reference(hidden, weight, k, 0.7, labels, IGNORE)
    check_against_reference(out, ref, dtype, exact_ids=dtype == torch.float64)


@pytest.mark.parametrize("chunking", [(4, 33), (2048, 4096)], ids=lambda c: f"tc{c[0]}-vc{c[1]}")
def test_large_vocab(chunking):
    """V = 4096 (one chunk by default; 125 chunks of 33 patched), k = 128, fp32, no labels."""
    config = chunked(*chunking)
    hidden, weight, _ = random_case("nh", 4096, torch.float32)
    out = fused_topk(hidden, weight, 128, config=config)
    check_against_reference(out, topk_reference(hidden, weight, 128), torch.float32, exact_ids=False)


@pytest.mark.parametrize("k", [1, 8, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_vocab_262144_relative_error(dtype, k):
    """V = 262,144 (64 default vocab chunks), a few tokens with a temperature: the probabilities
    of the top k and the tail mass within 1e-5 of fp64 relative to themselves (fp32; 1e-12 for
    fp64), i.e. their logs within that much absolutely; the ids are fp64's exactly in fp64 (in
    fp32 a near-tie at the k-th place may take another order, so there the log-probs are
    checked at the returned ids too)."""
    gen = generator(next_seed())
    hidden = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(262_144, HIDDEN, generator=gen, dtype=torch.float64)
    out = fused_topk(hidden.to(dtype), weight.to(dtype), k, temperature=0.8)
    ref = topk_reference(hidden.to(dtype).double(), weight.to(dtype).double(), k, 0.8)
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    at_ids = ref.full_log_probs.gather(-1, out.ids)  # fp64's log p at the returned ids
    assert (out.log_probs.double() - at_ids).abs().max() <= rel
    assert (out.log_probs.double() - ref.log_probs).abs().max() <= rel
    assert (out.tail_log_mass.double() - ref.tail_log_mass).abs().max() <= rel
    if dtype == torch.float64:
        assert torch.equal(out.ids, ref.ids)


@pytest.mark.parametrize("k", [1, 8, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunking", [(3, 7), (4, 130), (2048, 4096)], ids=lambda c: f"tc{c[0]}-vc{c[1]}")
def test_exact_ties_break_to_the_smaller_id(chunking, dtype, k):
    """Integer logits (every dtype holds them exactly; most of them tie, within and across
    chunks): the ids are exactly the reference's, smaller id first among equal values."""
    config = chunked(*chunking)
    hidden, weight = integer_case((5, 2), 600, 4, generator(next_seed()))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ref = topk_reference(hidden, weight, k)
    out = fused_topk(hidden, weight, k, config=config)
    assert torch.equal(out.ids, ref.ids)
    # bf16 inputs give fp32 outputs.
    tol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=tol)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=tol)
    # The ties really are there: some token has equal values at the k-th place and beyond it.
    if k > 1:
        sorted_full = ref.full_log_probs.sort(dim=-1, descending=True).values
        assert (sorted_full[..., k - 1] == sorted_full[..., k]).any()


def test_all_logits_equal():
    """Every logit equal (zero hidden): ids 0..k-1, log p = -log V, tail log((V-k)/V)."""
    config = chunked(3, 10)
    vocab, k = 97, 64
    hidden = torch.zeros(4, 2, 8, dtype=torch.float64)
    weight = torch.randn(vocab, 8, generator=generator(next_seed()), dtype=torch.float64)
    out = fused_topk(hidden, weight, k, config=config)
    assert torch.equal(out.ids, torch.arange(k).expand(2, 4, k))
    torch.testing.assert_close(out.log_probs, torch.full((2, 4, k), -torch.log(torch.tensor(97.0)).item()).double())
    expected_tail = torch.log(torch.tensor((vocab - k) / vocab, dtype=torch.float64))
    torch.testing.assert_close(out.tail_log_mass, expected_tail.expand(2, 4))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_k_equal_to_vocab(dtype):
    """k = V: every id returned, probabilities summing to 1, tail exactly -inf."""
    config = chunked(4, 9)
    hidden, weight, labels = random_case("sbh", 40, dtype)
    out = fused_topk(hidden, weight, 40, labels=labels, config=config)
    ref = topk_reference(hidden, weight, 40, 1.0, labels, IGNORE)
    valid = labels != IGNORE
    assert torch.isneginf(out.tail_log_mass[valid]).all()
    assert torch.equal(out.ids[valid].sort(dim=-1).values, torch.arange(40).expand(int(valid.sum()), 40))
    total = out.log_probs[valid].double().exp().sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=TOL[dtype])
    check_against_reference(out, ref, dtype, exact_ids=dtype == torch.float64)


def test_tiny_tail_is_exact():
    """A tail of relative size ~1e-30: computed as its own sum, it keeps full relative accuracy
    (as ``log(1 - Σ p_topk)`` it would be 0 or -inf in fp32)."""
    config = chunked(3, 16)
    gen = generator(next_seed())
    vocab, k = 64, 8
    hidden = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64)
    # A constant last feature: rows k..V-1 of the weight get logits exactly 80 lower there.
    hidden[:, -1] = 1.0
    weight[:k, -1] = 0.0
    weight[k:, -1] = -80.0
    out = fused_topk(hidden.float(), weight.float(), k, config=config)
    ref = topk_reference(hidden.float(), weight.float(), k)
    assert (ref.tail_log_mass < -60).all()
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=1e-4)


@pytest.mark.parametrize("gap", [30.0, 100.0], ids=["gap30", "gap100"])
def test_triton_tiny_tail_is_exact(gap, triton_path):
    """The kernel's tail sums (each tile's rest, from the statistics' own exponentials rescaled
    to the rest's max) keep full relative accuracy with the rest ``gap`` nats below the top: 30
    rides on the statistics' exponentials, 100 (where those underflow fp32) takes the rest's
    own; over 3 vocab splits, the top (9 ids) spread over the first two."""
    gen = generator(next_seed())
    vocab, k = 300, 9
    hidden = torch.randn(6, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64) / 4
    # A constant last feature: the rows outside the top get logits exactly `gap` lower there.
    top = torch.arange(vocab) % 100 < 3
    hidden[:, -1] = 1.0
    weight[:, -1] = torch.where(top, 0.0, -gap)
    out = triton_topk(hidden.float(), weight.float(), k, 3)
    ref = topk_reference(hidden.float(), weight.float(), k)
    assert (ref.tail_log_mass < -gap + 8).all()
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("impl", "dtype", "splits", "row_temperature"),
    [("torch", torch.float64, None, True), ("torch", torch.float32, None, False), ("triton", torch.float32, 3, True),
     ("triton", torch.float16, 2, False), ("triton", torch.float32, 1, False)],
    ids=["torch-fp64-row-t", "torch-fp32", "triton-fp32-3splits-row-t", "triton-fp16-2splits", "triton-fp32-1split"],
)  # fmt: skip
@pytest.mark.parametrize("names", [(), ("entropy",), ("entropy", "sum_pi_squared")], ids=["lse", "H", "H-sumpi"])
def test_statistics_of_the_topk_pass(impl, dtype, splits, row_temperature, names, triton_path):
    """The head's statistics from the top-k's own pass (``topk_and_statistics``): ``lse``, the
    entropy and Σπ² against fp64 over the same operands, one row far more peaked than the
    others; the top-k itself as ``fused_topk``'s (the statistics change nothing of it)."""
    from mcore_ppo.distill.topk import topk_and_statistics
    from mcore_ppo.statistics import Statistics

    if impl == "torch":
        triton_path = []  # the fixture's kernel record is for the kernel path only
    gen = generator(next_seed())
    vocab, k = 500, 16
    hidden = torch.randn(20, HIDDEN, generator=gen).to(dtype)
    hidden[5] *= 40  # a row whose softmax is nearly one-hot
    weight = torch.randn(vocab, HIDDEN, generator=gen).to(dtype)
    temperature = token_temperatures((20,), gen) if row_temperature else 0.7
    config = replace(TopKConfig(), splits=splits)
    statistics = Statistics.named(names)
    top, finished = topk_and_statistics(
        hidden, weight, k, statistics=statistics, temperature=temperature, impl=impl, config=config
    )
    assert triton_path == []
    alone = fused_topk(hidden, weight, k, temperature=temperature, impl=impl, config=config)
    for name in ("ids", "log_probs", "tail_log_mass"):
        torch.testing.assert_close(getattr(top, name), getattr(alone, name), rtol=0, atol=0)
    t = temperature[:, None].double() if row_temperature else temperature
    z = hidden.double() @ weight.double().t() / t
    lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    expected = {"entropy": lse - (p * z).sum(dim=1), "sum_pi_squared": p.square().sum(dim=1)}
    assert finished.shape == (1 + len(names), 20)
    assert finished.dtype == (dtype if dtype == torch.float64 else torch.float32)
    got_lse, values = statistics.from_finished(finished)
    # fp32 rounding of logits of this size, relative to the largest.
    atol = 1e-9 if dtype == torch.float64 else 2e-6 * z.abs().max().item()
    torch.testing.assert_close(got_lse.double(), lse, rtol=0, atol=atol)
    for name in names:
        torch.testing.assert_close(values[name].double(), expected[name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("scale", [1e-3, 30.0, 1e3])
def test_extreme_logits(scale):
    """Logits near zero and up to ~1e4: finite, and exact to the fp32 rounding of their size."""
    config = chunked(4, 50)
    hidden, weight, labels = random_case("nh", 300, torch.float32, scale=scale)
    out = fused_topk(hidden, weight, 16, labels=labels, config=config)
    ref = topk_reference(hidden, weight, 16, 1.0, labels, IGNORE)
    assert torch.isfinite(out.log_probs).all()
    # fp32 rounding of logits of this size (a few ulp of the largest, summed over h products).
    atol = 1e-5 + 2e-6 * (hidden.double() @ weight.double().t()).abs().max().item()
    torch.testing.assert_close(out.log_probs.double(), log_probs_at(ref, out.ids), rtol=0, atol=atol)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=atol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_nan_and_inf_inputs_poison_their_tokens_with_valid_ids(impl):
    """A NaN in a token's hidden state, an inf hidden row, a NaN or inf weight row: the tokens
    that meet them get NaN log-probs and tails (never a plausible number), and every id stays a
    vocab id (a consumer may index with them); the other tokens are untouched."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernel runs CPU tensors only under TRITON_INTERPRET=1")
    gen = generator(next_seed())
    hidden = torch.randn(6, HIDDEN, generator=gen)
    weight = torch.randn(300, HIDDEN, generator=gen)
    clean = fused_topk(hidden, weight, 12, impl=impl)
    hidden[1, 3] = torch.nan
    hidden[2] = torch.inf
    for k in (5, 12, 40):
        out = fused_topk(hidden, weight, k, impl=impl)
        assert ((out.ids >= 0) & (out.ids < 300)).all()
        assert out.log_probs[1:3].isnan().all() and out.tail_log_mass[1:3].isnan().all()
        if k == 12:
            others = [0, 3, 4, 5]
            assert torch.equal(out.ids[others], clean.ids[others])
            assert torch.equal(out.log_probs[others], clean.log_probs[others])
    weight[37] = torch.nan
    weight[100, 0] = torch.inf
    out = fused_topk(hidden, weight, 12, impl=impl)
    assert ((out.ids >= 0) & (out.ids < 300)).all() and out.log_probs.isnan().all()


def test_ignored_tokens():
    """Ignored tokens: ids = ignore_index in every slot, log_probs and tail 0; a custom ignore_index."""
    config = chunked(4, 30)
    hidden, weight, labels = random_case("sbh", 200, torch.float64)
    labels[labels == IGNORE] = 7
    labels[0, :3] = -1
    out = fused_topk(hidden, weight, 8, labels=labels, ignore_index=-1, config=config)
    ignored = labels == -1
    assert (out.ids[ignored] == -1).all() and (out.log_probs[ignored] == 0).all()
    assert (out.tail_log_mass[ignored] == 0).all()
    ref = topk_reference(hidden, weight, 8, 1.0, labels, -1)
    check_against_reference(out, ref, torch.float64, exact_ids=True)
    # Every token ignored: nothing NaN.
    out = fused_topk(hidden, weight, 8, labels=torch.full_like(labels, IGNORE), config=config)
    assert (out.ids == IGNORE).all() and (out.log_probs == 0).all() and (out.tail_log_mass == 0).all()


def test_no_gradient_and_deterministic():
    """Inputs that require grad, grad mode on: outputs detached; the same call twice is bitwise equal."""
    config = chunked(5, 64)
    hidden, weight, labels = random_case("thd", 500, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    first = mcore_ppo.fused_topk(hidden, weight, 32, temperature=1.3, labels=labels, config=config)
    second = mcore_ppo.fused_topk(hidden, weight, 32, temperature=1.3, labels=labels, config=config)
    for a, b in zip(first, second, strict=True):
        assert not a.requires_grad and a.grad_fn is None
        assert torch.equal(a, b)
    assert hidden.grad is None and weight.grad is None


def test_labels_dtypes():
    """Labels of any head label dtype select the same ignored tokens."""
    hidden, weight, labels = random_case("nh", 50, torch.float64)
    expected = fused_topk(hidden, weight, 4, labels=labels)
    labels32 = labels.to(torch.int32)
    for a, b in zip(fused_topk(hidden, weight, 4, labels=labels32), expected, strict=True):
        assert torch.equal(a, b)


def test_bad_inputs():
    """Each a ValueError/TypeError naming the argument (the head's checks, and the top-k's own:
    k, impl, config); labels outside the vocab with value checks on (the head's contract)."""
    gen = generator(next_seed())
    hidden = torch.randn(4, 2, 8, generator=gen)
    weight = torch.randn(50, 8, generator=gen)
    labels = torch.zeros(2, 4, dtype=torch.int64)
    out_of_vocab = labels.clone()
    out_of_vocab[1, 3] = 50
    cases = [
        (ValueError, "k must be in", dict(k=0)),
        (ValueError, "k must be in", dict(k=-3)),
        (ValueError, "k must be in", dict(k=MAX_TOPK + 1)),
        (ValueError, "k must be <= the global vocab size 50", dict(k=51)),
        (TypeError, "k must be an int", dict(k=8.0)),
        (TypeError, "k must be an int", dict(k=True)),
        (TypeError, "k must be an int", dict(k=torch.tensor(8))),
        (TypeError, "hidden must be a floating-point", dict(hidden=hidden.long())),
        (TypeError, "weight dtype torch.float64 must match hidden dtype", dict(weight=weight.double())),
        (TypeError, "hidden must be a torch.Tensor", dict(hidden=hidden.tolist())),
        (TypeError, "weight must be a torch.Tensor", dict(weight=None)),
        (TypeError, "labels must be an integer tensor", dict(labels=labels.float())),
        (ValueError, "labels must have shape", dict(labels=labels.t())),
        (ValueError, "hidden size 7", dict(hidden=hidden[..., :7])),
        (ValueError, "hidden must be [n, h] or [s, b, h]", dict(hidden=hidden[None])),
        (ValueError, "temperature must be", dict(temperature=0.0)),
        (TypeError, "temperature must be a number", dict(temperature="0.7")),
        (TypeError, "ignore_index must be an int", dict(ignore_index=1.5)),
        (TypeError, "sequence_parallel must be a bool", dict(sequence_parallel=1)),
        (TypeError, "tp_group must be a torch.distributed.ProcessGroup", dict(tp_group="tp")),
        (TypeError, "validate must be a bool or None", dict(validate=1)),
        (TypeError, "impl must be a str", dict(impl=None)),
        (ValueError, "impl must be one of", dict(impl="cuda")),
        (TypeError, "config must be a mcore_ppo.distill.TopKConfig or None", dict(config={"token_chunk": 4})),
        (
            ValueError,
            "labels must be in [0, 50) (the global vocab) or ignore_index=-100; found 50",
            dict(labels=out_of_vocab, validate=True),
        ),
        (ValueError, "labels must be in [0, 50)", dict(labels=out_of_vocab - 51, validate=True)),
    ]
    for error, match, override in cases:
        args = dict(hidden=hidden, weight=weight, k=4, labels=labels) | override
        escaped = match.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(error, match=escaped):
            fused_topk(args.pop("hidden"), args.pop("weight"), args.pop("k"), **args)
    # Without value checks an out-of-vocab label only says the token counts (nothing is read back).
    unchecked = fused_topk(hidden, weight, 4, labels=out_of_vocab, validate=False)
    assert torch.equal(unchecked.ids, fused_topk(hidden, weight, 4, labels=labels, validate=False).ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_path(dtype):
    """CUDA tensors (the fp32-output GEMM for bf16): random data against fp64 on the same
    (rounded) inputs, and exact integer ties, k = 128 over V = 4096 in chunks of 1000."""
    config = chunked(64, 1000)
    hidden, weight, labels = random_case("sbh", 4096, dtype)
    out = fused_topk(hidden.cuda(), weight.cuda(), 128, temperature=0.7, labels=labels.cuda(), config=config)
    out = type(out)(*(t.cpu() for t in out))
    ref = topk_reference(hidden, weight, 128, 0.7, labels, IGNORE)
    assert out.log_probs.dtype == torch.float32
    atol = 1e-5 + 2e-6 * (hidden.double() @ weight.double().t()).abs().max().item()
    torch.testing.assert_close(out.log_probs.double(), log_probs_at(ref, out.ids), rtol=0, atol=atol)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=atol)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=atol)
    hidden, weight = integer_case((9, 2), 4096, 4, generator(next_seed()))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ties = fused_topk(hidden.cuda(), weight.cuda(), 128, config=config)
    assert torch.equal(ties.ids.cpu(), topk_reference(hidden, weight, 128).ids)


# ----------------------------------------------------------------------------- the Triton kernel
# Under TRITON_INTERPRET=1 (tests/conftest.py) with the interpreter's tiles (16 rows × 32 vocab
# columns): against the fp64 reference and the torch path, with the vocab split across programs.


class KernelRecord:
    """What the kernel path did: ``torch_rows`` (rows handed to the torch path: none, ever) and
    ``full_tiles`` (the (row, tile) pairs recomputed whole, one list per launch)."""

    def __init__(self):
        self.torch_rows = []
        self.full_tiles = []

    def __eq__(self, other):  # `triton_path == []`: no row took the torch path
        return self.torch_rows == other


@pytest.fixture
def triton_path(monkeypatch):
    """A :class:`KernelRecord` of the kernel path's calls."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # tests/conftest.py turns the interpreter on only without CUDA; on a GPU host the kernel's
        # tests are tests/gpu/test_gpu_topk.py.
        pytest.skip("the kernel runs CPU tensors only under TRITON_INTERPRET=1")
    record = KernelRecord()
    shard_topk, recompute = topk_torch.shard_topk_torch, topk_triton._recompute_full_tiles

    def torch_spy(tokens, *args, **kwargs):
        record.torch_rows.append(tokens.shape[0])
        return shard_topk(tokens, *args, **kwargs)

    def recompute_spy(tokens, weight, full, *args, **kwargs):
        record.full_tiles.append(full_pairs(full))
        return recompute(tokens, weight, full, *args, **kwargs)

    monkeypatch.setattr(topk_torch, "shard_topk_torch", torch_spy)
    monkeypatch.setattr(topk_triton, "_recompute_full_tiles", recompute_spy)
    return record


def triton_topk(hidden, weight, k, splits, config=None, **kwargs):
    """The kernel path with ``splits`` vocab splits per row block (and ``config``'s other settings)."""
    config = replace(config or TopKConfig(), splits=splits)
    return fused_topk(hidden, weight, k, impl="triton", config=config, **kwargs)


@pytest.mark.parametrize(
    ("dtype", "k", "vocab", "splits"),
    [(torch.float32, 8, 600, 3), (torch.float16, 64, 500, 2), (torch.float32, 128, 400, 1)],
    ids=["fp32-k8-3splits", "fp16-k64-2splits", "fp32-k128-1split"],
)
def test_triton_matches_fp64_and_torch(dtype, k, vocab, splits, triton_path):
    """Random logits (T = 0.7, a quarter of the tokens ignored): the kernel's top-k against fp64
    (ids up to fp32 near-ties, log-probs and tail to fp32 rounding) and the torch path."""
    gen = generator(next_seed())
    hidden = torch.randn(14, HIDDEN, generator=gen).to(dtype)
    weight = torch.randn(vocab, HIDDEN, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (14,), generator=gen)
    labels[::4] = IGNORE
    out = triton_topk(hidden, weight, k, splits, temperature=0.7, labels=labels)
    assert triton_path == []  # no row needed the torch path
    ref = topk_reference(hidden.float(), weight.float(), k, 0.7, labels, IGNORE)
    check_against_reference(out, ref, torch.float32, exact_ids=False)
    chunked = fused_topk(hidden, weight, k, temperature=0.7, labels=labels, impl="torch")
    torch.testing.assert_close(out.tail_log_mass, chunked.tail_log_mass, rtol=0, atol=2e-5)


def test_triton_token_chunks(triton_path):
    """A batch longer than one launch's scratch runs in token chunks (three here, the last
    ragged), with per-token temperatures split along and full tiles in every chunk (vocab rows
    40..79 boosted, k 12, 5 candidates per tile: two full-tile slots per row): the same as fp64
    and as one launch."""
    five = TopKConfig(candidates=5)
    gen = generator(next_seed())
    hidden = torch.randn(40, HIDDEN, generator=gen)
    weight = torch.randn(300, HIDDEN, generator=gen)
    weight[40:80] *= 3.0
    temperature = torch.rand(40, generator=gen) + 0.5
    whole = triton_topk(hidden, weight, 12, 2, five, temperature=temperature)
    tiles_config = five.interpreter_tiles
    tiles = cdiv(300, tiles_config.block_n)
    per_row = tiles * (8 * topk_config.candidates_per_tile(tiles, 12, five) + 8) + 2 * tiles_config.block_n * 4
    per_row += tiles * 4
    assert topk_config.full_tiles_cap(tiles, 12, five) == 2
    one_block = replace(five, scratch_bytes=per_row * tiles_config.block_m)  # one row block per launch
    triton_path.full_tiles.clear()
    chunked = triton_topk(hidden, weight, 12, 2, one_block, temperature=temperature)
    assert len(triton_path.full_tiles) == 3 and all(triton_path.full_tiles)  # three launches, each with full tiles
    assert torch.equal(chunked.ids, whole.ids)
    # Not to the bit here: the interpreter's tl.dot is a numpy product, whose summation order
    # follows the rows grouped with a recomputed tile's (other rows in another chunk).
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(chunked.tail_log_mass, whole.tail_log_mass, rtol=0, atol=2e-5)
    ref = topk_reference(hidden, weight, 12, temperature)
    check_against_reference(chunked, ref, torch.float32, exact_ids=False)


@pytest.mark.parametrize("k", [1, 8, 24])
def test_triton_ties_across_tiles_and_splits(k, triton_path):
    """Each weight row repeated every 37 columns (across tiles of 32 and 3 splits), integer
    entries (logits exact in any summation order): every value ties at least 11 times; the
    top-k takes the smaller ids among equal values, exactly as fp64 does."""
    gen = generator(next_seed())
    hidden = torch.randint(-4, 5, (16, HIDDEN), generator=gen).float()
    weight = torch.randint(-4, 5, (37, HIDDEN), generator=gen).float().repeat(11, 1)
    out = triton_topk(hidden, weight, k, 3)
    assert triton_path == []
    ref = topk_reference(hidden, weight, k)
    assert torch.equal(out.ids, ref.ids)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=2e-5)
    assert torch.equal(out.ids, fused_topk(hidden, weight, k, impl="torch").ids)


@pytest.mark.parametrize("k", [31, 32, 33, 64])
def test_triton_k_at_tile_boundaries(k, triton_path):
    """k at and around the tile width (32), integer logits (ties)."""
    gen = generator(next_seed())
    hidden = torch.randint(-3, 4, (12, 8), generator=gen).float()
    weight = torch.randint(-3, 4, (300, 8), generator=gen).float()
    out = triton_topk(hidden, weight, k, 2)
    assert triton_path == []
    ref = topk_reference(hidden, weight, k)
    assert torch.equal(out.ids, ref.ids)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=2e-5)
    sorted_full = ref.full_log_probs.sort(dim=-1, descending=True).values
    assert (sorted_full[..., k - 1] == sorted_full[..., k]).any()  # ties at the k-th place


def test_triton_k_equal_to_vocab(triton_path):
    """k = V over 2 splits: every id, probabilities summing to 1, tail -inf."""
    hidden, weight, labels = random_case("nh", 40, torch.float32)
    out = triton_topk(hidden, weight, 40, 2, labels=labels)
    valid = labels != IGNORE
    assert torch.isneginf(out.tail_log_mass[valid]).all()
    total = out.log_probs[valid].double().exp().sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=2e-5)
    ref = topk_reference(hidden, weight, 40, 1.0, labels, IGNORE)
    check_against_reference(out, ref, torch.float32, exact_ids=False)


def test_triton_ignored_tokens_and_layout(triton_path):
    """[s, b, h] with ignored tokens: ignore_index / 0 there, the torch path's ids elsewhere
    (integer logits: no rounding can separate the two paths)."""
    gen = generator(next_seed())
    hidden = torch.randint(-2, 3, (6, 2, 8), generator=gen).float()
    weight = torch.randint(-2, 3, (150, 8), generator=gen).float()
    labels = torch.randint(0, 150, (2, 6), generator=gen)
    labels[0, 1:4] = IGNORE
    out = triton_topk(hidden, weight, 16, 2, labels=labels)
    chunked = fused_topk(hidden, weight, 16, labels=labels, impl="torch")
    assert (out.ids[labels == IGNORE] == IGNORE).all() and (out.log_probs[labels == IGNORE] == 0).all()
    for a, b in zip(out, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert torch.equal(out.ids, chunked.ids)


@pytest.mark.parametrize("k", [8, 23])
def test_triton_all_equal_logits_recompute_only_the_first_tiles(k, triton_path):
    """Every logit equal (zero hidden): each tile's candidates tie with the k-th value, yet only
    the tiles whose candidates all made the top can hide one of it: the first ``k // C`` (tiles
    of 32 over a vocab of 300), not all 10 per row. Ids 0..k-1, log p = -log V, exact tail."""
    vocab = 300
    hidden = torch.zeros(5, 8)
    weight = torch.randn(vocab, 8, generator=generator(next_seed()))
    out = triton_topk(hidden, weight, k, 2)
    assert triton_path == []
    first = k // topk_config.candidates_per_tile(10, k, TopKConfig())
    assert sorted(map(tuple, triton_path.full_tiles[0])) == [(row, tile) for row in range(5) for tile in range(first)]
    assert torch.equal(out.ids, torch.arange(k).expand(5, k))
    torch.testing.assert_close(out.log_probs.double(), torch.full((5, k), -math.log(vocab), dtype=torch.float64))
    expected_tail = torch.full((5,), math.log((vocab - k) / vocab), dtype=torch.float64)
    torch.testing.assert_close(out.tail_log_mass.double(), expected_tail, rtol=0, atol=2e-6)


def test_triton_kth_value_hidden_in_a_tile_without_excess(triton_path):
    """Exactly k candidates reach the k-th value (no tie to break among them), yet tile 0 hides
    an entry equal to it with a smaller id than tile 1's: tile 0's last candidate (at the k-th
    value) is in the top and its rest reaches the bound, so it is full and recomputed, and id 5
    wins over id 32. Logits per id: 10 for 0-3, 5 for 4, 5 and 32, 0 elsewhere (tiles of 32)."""
    vocab, k = 64, 6
    logits = torch.zeros(vocab)
    logits[:4] = 10.0
    logits[[4, 5, 32]] = 5.0
    weight = torch.zeros(vocab, 8)
    weight[:, 0] = logits
    hidden = torch.zeros(3, 8)
    hidden[:, 0] = 1.0
    out = triton_topk(hidden, weight, k, 1)
    assert triton_path == []
    assert sorted(map(tuple, triton_path.full_tiles[0])) == [(row, 0) for row in range(3)]
    assert out.ids.tolist() == [[0, 1, 2, 3, 4, 5]] * 3
    ref = topk_reference(hidden.double(), weight.double(), k)
    check_against_reference(out, ref, torch.float32, exact_ids=True)


@pytest.mark.parametrize("k", [8, 40])
def test_triton_top_k_inside_few_tiles(k, triton_path):
    """Vocab rows 70..109 (across tiles 2 and 3 of 32) are scaled up so that each token's top
    ``k`` lies mostly inside them: far more than a tile's candidates, so the unkept entries must
    come from the whole-tile recompute. Against fp64: ids, log-probs and tails."""
    gen = generator(next_seed())
    hidden = torch.randn(18, HIDDEN, generator=gen)
    weight = torch.randn(500, HIDDEN, generator=gen)
    weight[70:110] *= 6.0
    out = triton_topk(hidden, weight, k, 3, temperature=0.9)
    assert triton_path == []
    full_tiles = {tile for pairs in triton_path.full_tiles for _, tile in pairs}
    assert full_tiles & {2, 3}
    ref = topk_reference(hidden, weight, k, 0.9)
    check_against_reference(out, ref, torch.float32, exact_ids=False)
    assert torch.equal(out.ids, fused_topk(hidden, weight, k, temperature=0.9, impl="torch").ids)


def test_triton_equal_values_above_the_kth_in_tie_rule_order(triton_path):
    """Entries in {-1, 0, 1} over a hidden size of 24: logits are small integers, so the top
    ``k`` holds runs of equal values above its last place too; they come out by ascending id,
    as fp64's stable order has them."""
    gen = generator(next_seed())
    hidden = torch.randint(-1, 2, (40, 24), generator=gen).float()
    weight = torch.randint(-1, 2, (700, 24), generator=gen).float()
    out = triton_topk(hidden, weight, 8, 3)
    ref = topk_reference(hidden, weight, 8)
    assert torch.equal(out.ids, ref.ids)


@pytest.mark.parametrize("case", range(6))
def test_triton_random_structures(case, triton_path):
    """Six random draws (fixed, printed seed) of size, k, splits, temperature and logit
    structure: plain Gaussian, a block of boosted vocab rows (full tiles), small integers
    (ties inside and at the end of the top), and a vocab smaller than the candidates' need.
    Every selection path against fp64: the ids (exact where the logits are exact), the order,
    the log-probs and the tail."""
    gen = generator(next_seed() + case)
    n = int(torch.randint(3, 24, (1,), generator=gen))
    vocab = int(torch.randint(40, 400, (1,), generator=gen))
    k = int(torch.randint(1, min(vocab, 48) + 1, (1,), generator=gen))
    splits = int(torch.randint(1, 5, (1,), generator=gen))
    structure = ("gaussian", "boosted", "integer")[case % 3]
    if structure == "integer":
        hidden, weight = (t.float() for t in integer_case((n,), vocab, 6, gen))
        temperature = 1.0
    else:
        hidden = torch.randn(n, HIDDEN, generator=gen)
        weight = torch.randn(vocab, HIDDEN, generator=gen)
        temperature = float(torch.empty(1).uniform_(0.3, 2.0, generator=gen))
        if structure == "boosted":
            start = int(torch.randint(0, vocab - 20, (1,), generator=gen))
            weight[start : start + 20] *= 4.0
    print(f"n={n} vocab={vocab} k={k} splits={splits} {structure} T={temperature:.3f}")
    out = triton_topk(hidden, weight, k, splits, temperature=temperature)
    assert triton_path == []
    ref = topk_reference(hidden.double(), weight.double(), k, temperature)
    check_against_reference(out, ref, torch.float32, exact_ids=structure == "integer")


def test_candidates_per_tile_follow_the_expected_full_tiles():
    """``C`` grows from 1 while one more candidate saves over ``tiles / 500`` expected full
    tiles per row (a candidate costs every tile, a full tile one tile of its row): 1 / 2 / 2 at
    TP 1 of a 152k vocab (594 tiles of 256) for k 8 / 64 / 128, 2 / 4 / 5 at TP 8 (75 tiles),
    never above 5 nor above k. The expectation is Poisson's tail, checked against a direct sum;
    ``TopKConfig(candidates=)`` forces a count, and the range and the cost are the config's."""
    defaults = TopKConfig()

    def choose(num_tiles, k, config=defaults):
        return topk_config.candidates_per_tile(num_tiles, k, config)

    def cap(num_tiles, k, config=defaults):
        return topk_config.full_tiles_cap(num_tiles, k, config)

    assert [choose(594, k) for k in (8, 64, 128)] == [1, 2, 2]
    assert [choose(75, k) for k in (8, 64, 128)] == [2, 4, 5]
    assert choose(1, 128) == 1 and choose(2, 128) == 1  # every tile fills whatever C: the cheapest
    assert choose(75, 1) == 1 and choose(3, 2) == 2 and choose(3, 4) == 4  # never above k
    assert cap(594, 128) == 64 and cap(75, 128) == 25 and cap(594, 8) == 8
    assert cap(594, 1) == 1  # C = k: a tile fills only by a tie at the top's last value
    lam = 128 / 75
    tail = 1 - sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(6))
    assert topk_config.expected_full_tiles(75, 128, 5) == pytest.approx(75 * tail, rel=1e-12)
    assert topk_config.expected_full_tiles(594, 128, 3) == pytest.approx(0.045, abs=5e-4)  # 0.042 measured
    forced = TopKConfig(candidates=4)
    assert choose(594, 128, forced) == 4 and cap(594, 128, forced) == 32
    assert choose(75, 128, TopKConfig(candidate_range=(3, 4))) == 4  # never above the range's top
    assert choose(75, 8, TopKConfig(candidate_range=(4, 6))) == 4  # from its low end
    # A full tile so cheap that no candidate pays for itself: the low end; so dear: the top.
    assert choose(75, 128, TopKConfig(full_tile_cost=1e-3)) == 1
    assert choose(75, 128, TopKConfig(full_tile_cost=1e12, candidate_range=(3, 9))) == 9


@pytest.mark.parametrize("candidates", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("structure", ["integer", "boosted"])
def test_triton_candidates_per_tile(structure, candidates, triton_path):
    """Every candidate count the choice can make, on the interpreter's small shards:
    ties across tiles and tiles that fill (whole-tile recompute), ids and values against fp64."""
    gen = generator(next_seed())
    if structure == "integer":
        hidden, weight = (t.float() for t in integer_case((6,), 200, 6, gen))
    else:
        hidden = torch.randn(10, HIDDEN, generator=gen)
        weight = torch.randn(200, HIDDEN, generator=gen)
        weight[60:90] *= 3.0
    out = triton_topk(hidden, weight, 12, 3, TopKConfig(candidates=candidates))
    assert triton_path == [] and sum(len(pairs) for pairs in triton_path.full_tiles) > 0
    ref = topk_reference(hidden.double(), weight.double(), 12)
    check_against_reference(out, ref, torch.float32, exact_ids=structure == "integer")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_triton_as_many_candidates_as_places(k, triton_path):
    """``C = k`` (what the choice takes for k below its low end): a tile then fills only when
    its rest ties the top's last value, and the tile is recomputed and its rest summed all the
    same. Small-integer logits, where most of a row's largest values tie across tiles and within
    them: ids in the tie rule's order, log-probs and tails against fp64."""
    hidden, weight = integer_case((6,), 200, 6, generator(next_seed()))
    config = TopKConfig(candidate_range=(1, 1) if k == 1 else (k, 5))
    assert topk_config.candidates_per_tile(7, k, config) == k
    out = triton_topk(hidden.float(), weight.float(), k, 2, config)
    assert triton_path == [] and sum(len(pairs) for pairs in triton_path.full_tiles) > 0
    check_against_reference(out, topk_reference(hidden, weight, k), torch.float32, exact_ids=True)


@pytest.mark.parametrize("by_sort", [True, False], ids=["tl.sort", "by-count"])
def test_triton_full_tile_merge_orders(by_sort, triton_path):
    """The full tiles' merge orders keys by ``tl.sort`` (the GPU's choice) or by counting (the
    interpreter's): the same ids, log-probs and tails, both against fp64, on small-integer logits
    (ties) with more candidates than places in several tiles."""
    hidden, weight = integer_case((4,), 160, 6, generator(next_seed()))
    out = triton_topk(hidden.float(), weight.float(), 12, 5, TopKConfig(sort_keys=by_sort))
    assert triton_path == [] and sum(len(pairs) for pairs in triton_path.full_tiles) > 0
    ref = topk_reference(hidden, weight, 12)
    check_against_reference(out, ref, torch.float32, exact_ids=True)


@pytest.mark.parametrize("by_sort", [True, False], ids=["tl.sort", "by-count"])
def test_selection_kernel_tie_rule_bound_and_rest(by_sort, triton_path):
    """The selection kernel alone, on crafted candidate rows: the top in the tie rule's order
    over signs, ±0.0 (equal), magnitudes and equal values at the k-th (by column); the full
    tiles (rest max at or above the k-th value, every candidate in the top); the rest's
    ``(m, s)`` against fp64 over the
    unselected candidates and the other tiles' rests."""
    from mcore_ppo.kernels.topk import select_top_kernel

    config = TopKConfig(candidates=5)
    c = topk_config.candidates_per_tile(5, 7, config)
    gen = generator(next_seed())
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 3e38, -3e38, 1e-38, -1e-38, 2.5, 2.5, -2.5, 7.0])
    rows, num_tiles, k, block_n = 6, 5, 7, 32
    values = pool[torch.randint(0, len(pool), (rows, num_tiles, c), generator=gen)]
    # Row 0: tile 0's candidates all in the top (full, with its rest at 5.0), the others' last not.
    values[0] = torch.tensor([-1.0, -1.0, 0.0, 0.0, 1.0])[:c]
    values[0, 0] = torch.tensor([3e38, 7.0, 7.0, 2.5, 2.5])[:c]
    # Each tile's candidates as the statistics kernel writes them: the tie rule's order, distinct columns.
    values = values.sort(dim=2, descending=True, stable=True).values.contiguous()
    cols = (torch.arange(num_tiles)[:, None] * block_n + torch.arange(c)).expand(rows, -1, -1)
    rest_m = torch.randn(rows, num_tiles, generator=gen) - 1.0
    rest_m[0] = 5.0  # row 0: every tile's rest reaches the bound
    rest_m[1, 2] = -torch.inf  # an empty rest
    rest_s = torch.rand(rows, num_tiles, generator=gen) + 1.0
    rest_s[1, 2] = 0.0
    out = [torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)]
    cap = topk_config.full_tiles_cap(num_tiles, k, config)
    out += [torch.empty(rows, num_tiles, dtype=torch.int8), torch.empty(rows, dtype=torch.int32)]
    out += [torch.full((rows, cap), -1, dtype=torch.int32), torch.empty(rows), torch.empty(rows)]
    width = num_tiles * c
    select_top_kernel[(2,)](
        values.reshape(rows, width), cols.reshape(rows, width).to(torch.int32).contiguous(), rest_m, rest_s, *out,
        rows, width, k, num_tiles, cap, width, 0, C=c, BLOCK_R=4, BLOCK_W=32, BLOCK_T=8, TOP=8, BY_SORT=by_sort,
    )  # fmt: skip
    top_v, top_c, full, full_rows, full_list, m, s = out
    assert 0 < full_rows.sum() < rows * num_tiles  # full tiles and others
    for r in range(rows):
        pairs = zip(values[r].flatten().tolist(), cols[r].flatten().tolist(), strict=True)
        entries = sorted(pairs, key=lambda e: (-e[0], e[1]))
        assert top_v[r].tolist() == [e[0] for e in entries[:k]]
        assert top_c[r].tolist() == [e[1] for e in entries[:k]]
        bound = entries[k - 1][0]
        # Full: the rest reaches the bound and the tile's last candidate (so all) is in the top.
        last_in_top = torch.tensor(
            [(values[r, t, -1].item(), cols[r, t, -1].item()) in entries[:k] for t in range(num_tiles)]
        )
        expect_full = (rest_m[r] >= bound) & (rest_m[r] > -torch.inf) & last_in_top
        assert full[r].bool().tolist() == expect_full.tolist() and full_rows[r].item() == expect_full.sum().item()
        assert full_list[r, : full_rows[r]].tolist() == expect_full.nonzero().flatten().tolist()
        terms = [torch.tensor(v, dtype=torch.float64) for v, col in entries[k:] if not expect_full[col // block_n]]
        terms += [rest_m[r, t].double() + rest_s[r, t].double().log() for t in range(num_tiles) if not expect_full[t]]
        expected = torch.logsumexp(torch.stack(terms), 0) if terms else torch.tensor(-torch.inf, dtype=torch.float64)
        got = m[r].double() + s[r].double().log() if s[r] > 0 else torch.tensor(-torch.inf, dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0) or (got == expected), (r, got, expected)


@pytest.mark.parametrize(("world", "c", "k"), [(2, 8, 5), (4, 6, 24), (3, 16, 1), (4, 8, 13)])
@pytest.mark.parametrize("by_sort", [False, True])
def test_rank_merge_by_the_selection_kernel(world, c, k, by_sort, triton_path, monkeypatch):
    """The ranks' merge through the selection kernel (``topk_triton.select_merged``) against the
    reference selection (``select_topk_lse``): every rank's ``c`` candidates side by side, each
    rank's in the tie rule's order and its ids above the previous rank's, values from a few
    levels (ties within and across ranks, ±0.0, -inf padding of a tiny shard): the same ids and
    values in the same order, the dropped entries' log-sum-exp to fp32 rounding (``-inf`` when
    every candidate is kept)."""
    from mcore_ppo.parallel.topk import select_topk_lse

    monkeypatch.setattr(topk_triton, "DEFAULT_CONFIG", replace(topk_triton.DEFAULT_CONFIG, sort_keys=by_sort))
    seed = next_seed()
    gen = generator(seed)
    n, shard = 9, 1000
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, 2.5, -2.5, 7.0, 30.0, -torch.inf])
    values = pool[torch.randint(0, len(pool), (world, n, c), generator=gen)]
    values = torch.where(torch.rand(world, n, c, generator=gen) < 0.3, torch.randn(world, n, c, generator=gen), values)
    ids = torch.stack([torch.stack([torch.randperm(shard, generator=gen)[:c] for _ in range(n)]) for _ in range(world)])
    ids = ids + torch.arange(world)[:, None, None] * shard
    # Each rank's candidates in the tie rule's order: larger value first, equal values by smaller id.
    order = torch.sort(ids, dim=-1).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    # As the all-gather leaves them: [world, 2, n, c], fp32 values beside their ids' int32 bits.
    gathered = torch.stack([values.float(), ids.to(torch.int32).view(torch.float32)], 1).permute(1, 2, 0, 3)
    side_by_side = (gathered[0], gathered[1].view(torch.int32))
    got = topk_triton.select_merged(*side_by_side, k)
    want = select_topk_lse(*side_by_side, k)
    assert got[1].dtype == want[1].dtype == torch.int64
    assert torch.equal(got[1], want[1]), f"seed {seed}: ids"
    assert torch.equal(got[0], want[0]), f"seed {seed}: values"
    torch.testing.assert_close(got[2], want[2], rtol=2e-6, atol=0, msg=f"seed {seed}: dropped lse")
    everything = topk_triton.select_merged(*side_by_side, world * c)
    assert torch.equal(everything[2], torch.full((n,), -torch.inf)), seed
    # Rows already side by side (one part per row, int64 ids): the same selection.
    rows = [t.permute(1, 0, 2).reshape(n, 1, world * c).contiguous() for t in (values.float(), ids)]
    again = topk_triton.select_merged(*rows, k)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1]), seed
    torch.testing.assert_close(again[2], got[2], rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="ids laid out as values"):
        topk_triton.select_merged(rows[0], side_by_side[1], k)


def test_full_pairs_kernel_lists_by_tile(triton_path):
    """The full pairs grouped by tile, rows ascending, each as its slot ``r·cap + j`` (``j`` the
    tile's place among the row's full tiles, as the selection kernel writes it into ``full``),
    over several row blocks, with empty tiles and rows; and the recompute's work items mapped
    from those counts: every slot gets its row's tile, computed as fp64 computes it."""
    from mcore_ppo.kernels.topk import full_pairs_kernel

    gen = generator(next_seed())
    rows, num_tiles, cap = 45, 7, 3
    flags = torch.zeros(rows, num_tiles, dtype=torch.bool)
    for r in range(rows):
        chosen = torch.randperm(num_tiles, generator=gen)[: int(torch.randint(0, cap + 1, (), generator=gen))]
        flags[r, chosen] = True
    flags[:, 4] = False  # a tile no row recomputes
    full = torch.where(flags, flags.int().cumsum(1), 0).to(torch.int8)  # 1 + the place among the row's
    counts = torch.full((num_tiles,), -1, dtype=torch.int32)
    pair_slot = torch.full((num_tiles, rows), -1, dtype=torch.int32)
    full_pairs_kernel[(num_tiles,)](full, counts, pair_slot, rows, num_tiles, cap, BLOCK_R=16)
    for t in range(num_tiles):
        expected = [r * cap + int(full[r, t]) - 1 for r in range(rows) if flags[r, t]]
        assert counts[t].item() == len(expected) and pair_slot[t, : len(expected)].tolist() == expected
    tiles = TopKConfig().interpreter_tiles
    block_n = tiles.block_n
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    weight = torch.randn(num_tiles * block_n - 5, HIDDEN, generator=gen)  # the last tile ragged
    inverse = inverse_temperature(0.5, hidden[0])
    z = topk_triton._recompute_full_tiles(hidden, weight, full, cap, inverse, tiles, 16, Launcher().bound())
    logits = torch.nn.functional.pad(hidden.double() @ weight.double().t() / 0.5, (0, 5), value=-torch.inf)
    for r, t in flags.nonzero().tolist():
        expected = logits[r, t * block_n : (t + 1) * block_n]
        torch.testing.assert_close(z[r * cap + int(full[r, t]) - 1].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(0, HIDDEN), (0, 2, HIDDEN), (3, 0, HIDDEN)], ids=["n0", "s0", "b0"])
def test_no_tokens(impl, shape):
    """No tokens: empty outputs of the layout's shapes and dtypes on either path, no error."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernel runs CPU tensors only under TRITON_INTERPRET=1")
    weight = torch.randn(300, HIDDEN, generator=generator(next_seed()))
    out = fused_topk(torch.zeros(shape), weight, 8, impl=impl)
    tokens = (shape[1], shape[0]) if len(shape) == 3 else (shape[0],)
    assert out.ids.shape == (*tokens, 8) and out.ids.dtype == torch.int64
    assert out.log_probs.shape == (*tokens, 8) and out.log_probs.dtype == torch.float32
    assert out.tail_log_mass.shape == tokens and out.tail_log_mass.dtype == torch.float32


def test_impl_argument():
    """impl: a TypeError for a non-str, a ValueError naming the choices or the tensors it needs."""
    hidden, weight, _ = random_case("nh", 50, torch.float64)
    with pytest.raises(TypeError, match="impl must be a str"):
        fused_topk(hidden, weight, 4, impl=1)
    with pytest.raises(ValueError, match="impl must be one of"):
        fused_topk(hidden, weight, 4, impl="cuda")
    with pytest.raises(ValueError, match="impl='triton' needs fp16/bf16/fp32"):
        fused_topk(hidden, weight, 4, impl="triton")
    # On CPU tensors "auto" is the torch path, whatever the interpreter.
    assert not topk_module._use_triton("auto", hidden.float())


@pytest.mark.parametrize("k", [8, 64])
def test_triton_heavy_ties_mix_full_and_other_tiles(k, triton_path):
    """Logits in {-4..4} (entries in {-1, 0, 1}): many values tie above and at the k-th place,
    so many (row, tile) pairs are full and recomputed while the others keep their candidates.
    Every row's ids are fp64's exactly, in the tie rule's order."""
    hidden, weight = integer_case((37,), 600, 4, generator(next_seed()))
    out = triton_topk(hidden.float(), weight.float(), k, 3)
    full = sum(len(pairs) for pairs in triton_path.full_tiles)
    print(f"(row, tile) pairs recomputed whole: {full} of {37 * 19}")
    assert triton_path == [] and 0 < full < 37 * 19
    ref = topk_reference(hidden, weight, k)
    assert torch.equal(out.ids, ref.ids)
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=2e-5)


# ----------------------------------------------------------------------- per-token temperature
# A tensor shaped like the labels (or, without labels, like the tokens): row i of the logits is
# divided by T_i. Temperatures drawn log-uniformly in [0.25, 4] so that no two tokens share one
# (a kernel or a token order that mixes rows up cannot pass).


def token_temperatures(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.float32):
    return torch.exp((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * math.log(4.0)).to(dtype)


@pytest.mark.parametrize("k", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_token_temperature_matches_fp64_reference(layout, dtype, k):
    """Torch path, vocab chunks of 100 over V = 400, token chunks of 5 (a chunk's rows take their
    own temperatures), a quarter of the tokens ignored: against fp64 with the same temperatures."""
    config = chunked(5, 100)
    hidden, weight, labels = random_case(layout, 400, dtype)
    temperature = token_temperatures(LAYOUTS[layout][1], generator(next_seed()), dtype)
    out = fused_topk(hidden, weight, k, temperature=temperature, labels=labels, config=config)
    ref = topk_reference(hidden, weight, k, temperature, labels, IGNORE)
    check_against_reference(out, ref, dtype, exact_ids=dtype == torch.float64)
    # Without labels the tensor is shaped like the tokens; the valid tokens' outputs are the same.
    unlabelled = fused_topk(hidden, weight, k, temperature=temperature, config=config)
    valid = labels != IGNORE
    for a, b in zip(unlabelled, out, strict=True):
        assert torch.equal(a[valid], b[valid])


def test_per_token_temperature_broadcast_and_uniform():
    """``[b, 1]`` per sequence equals its ``[b, s]`` expansion; a tensor of one value equals the
    float (ids exactly, values to rounding; 0.75 is exact in fp32, so both divide by one number)."""
    config = chunked(4, 64)
    hidden, weight, labels = random_case("sbh", 300, torch.float32)
    per_sequence = token_temperatures((3, 1), generator(next_seed()))
    a = fused_topk(hidden, weight, 16, temperature=per_sequence, labels=labels, config=config)
    b = fused_topk(hidden, weight, 16, temperature=per_sequence.expand(3, 6).contiguous(), labels=labels, config=config)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    check_against_reference(a, topk_reference(hidden, weight, 16, per_sequence, labels, IGNORE), torch.float32,
                            exact_ids=False)  # fmt: skip
    uniform = fused_topk(hidden, weight, 16, temperature=torch.full((3, 6), 0.75), labels=labels, config=config)
    number = fused_topk(hidden, weight, 16, temperature=0.75, labels=labels, config=config)
    assert torch.equal(uniform.ids, number.ids)
    torch.testing.assert_close(uniform.log_probs, number.log_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(uniform.tail_log_mass, number.tail_log_mass, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_per_token_temperature_keeps_the_untempered_ids(dtype):
    """Integer logits (ties everywhere, across chunks): a positive T per row keeps each row's
    order, so the ids are exactly those of T = 1 and of fp64 (tie rule included); the log-probs
    and tails are the tempered ones, not T = 1's."""
    config = chunked(3, 40)
    gen = generator(next_seed())
    hidden, weight = integer_case((5, 2), 300, 4, gen)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    temperature = token_temperatures((2, 5), gen)
    out = fused_topk(hidden, weight, 24, temperature=temperature, config=config)
    ref = topk_reference(hidden, weight, 24, temperature)
    plain = fused_topk(hidden, weight, 24, config=config)
    assert torch.equal(out.ids, ref.ids) and torch.equal(out.ids, plain.ids)
    tol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(out.log_probs.double(), ref.log_probs, rtol=0, atol=tol)
    torch.testing.assert_close(out.tail_log_mass.double(), ref.tail_log_mass, rtol=0, atol=tol)
    assert (out.log_probs - plain.log_probs).abs().max() > 1e-2


def test_per_token_temperature_ignored_tokens():
    """Ignored tokens give ignore_index / 0 / 0 at any (valid) temperature, and their
    temperatures change no other token's outputs; changing one valid token's temperature changes
    that token's outputs only."""
    config = chunked(4, 50)
    gen = generator(next_seed())
    hidden, weight, labels = random_case("thd", 200, torch.float64)
    temperature = token_temperatures((1, 17), gen, torch.float64)
    out = fused_topk(hidden, weight, 8, temperature=temperature, labels=labels, config=config)
    ignored = labels == IGNORE
    assert ignored.any()
    assert (out.ids[ignored] == IGNORE).all() and (out.log_probs[ignored] == 0).all()
    assert (out.tail_log_mass[ignored] == 0).all()
    extreme = temperature.clone()
    coin = torch.rand(int(ignored.sum()), generator=gen, dtype=torch.float64) < 0.5
    extreme[ignored] = torch.where(coin, torch.tensor(1e-4, dtype=torch.float64), 1e4)
    again = fused_topk(hidden, weight, 8, temperature=extreme, labels=labels, config=config)
    for a, b in zip(again, out, strict=True):
        assert torch.equal(a, b)
    valid_positions = (~ignored).nonzero()
    changed = valid_positions[0, 1].item()
    moved = temperature.clone()
    moved[0, changed] *= 3.0
    third = fused_topk(hidden, weight, 8, temperature=moved, labels=labels, config=config)
    others = torch.ones(1, 17, dtype=torch.bool)
    others[0, changed] = False
    for a, b in zip(third, out, strict=True):
        assert torch.equal(a[others], b[others])
    assert not torch.equal(third.log_probs[0, changed], out.log_probs[0, changed])
    check_against_reference(third, topk_reference(hidden, weight, 8, moved, labels, IGNORE), torch.float64,
                            exact_ids=True)  # fmt: skip


def test_per_token_temperature_bad_inputs():
    """Each a ValueError/TypeError naming temperature, with and without labels, at an ignored
    token too."""
    gen = generator(next_seed())
    hidden = torch.randn(4, 2, 8, generator=gen)
    weight = torch.randn(50, 8, generator=gen)
    labels = torch.zeros(2, 4, dtype=torch.int64)
    labels[1, 2] = IGNORE
    good = torch.full((2, 4), 0.7)
    values = "temperature values must be finite and >= 0.0001 (MIN_TEMPERATURE), got "
    shape = "temperature must be shaped like labels (2, 4)"
    cases = []
    for bad in (float("nan"), float("inf"), -float("inf"), 0.0, -0.5, 5e-5):
        tensor = good.clone()
        tensor[1, 2] = bad  # the ignored token
        message = f"{values}{tensor[1, 2].item()} (1 bad values)"  # the fp32 value, as stored
        cases.append((ValueError, message, dict(temperature=tensor)))
        cases.append((ValueError, message, dict(temperature=tensor, labels=None)))
    cases += [
        (ValueError, shape, dict(temperature=good.t())),
        (ValueError, shape, dict(temperature=good.t(), labels=None)),
        (ValueError, shape, dict(temperature=torch.full((8,), 0.7))),
        (ValueError, shape, dict(temperature=torch.full((2, 4, 1), 0.7))),
        (TypeError, "floating-point tensor, got dtype torch.int64", dict(temperature=good.long())),
        (TypeError, "temperature must be a floating-point tensor", dict(temperature=good > 0)),
        (ValueError, "temperature must be on the labels' device cpu", dict(temperature=good.to("meta"))),
    ]
    for error, match, override in cases:
        args = dict(hidden=hidden, weight=weight, k=4, labels=labels) | override
        escaped = match.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(error, match=escaped.replace("+", r"\+")):
            fused_topk(args.pop("hidden"), args.pop("weight"), args.pop("k"), **args)
    # [n, h] without labels: [n].
    with pytest.raises(ValueError, match=r"temperature must be shaped like labels \(8,\)"):
        fused_topk(hidden.view(8, 8), weight, 4, temperature=good)
    fused_topk(hidden.view(8, 8), weight, 4, temperature=good.view(8))


def test_validate_switch_for_temperature_values():
    """``validate=False`` skips the value check (no host sync): a bad temperature gives NaN for its
    token only, the others equal the checked call's; shape checks still run; a non-bool refused."""
    gen = generator(next_seed())
    hidden = torch.randn(4, 2, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(50, 8, generator=gen, dtype=torch.float64)
    labels = torch.zeros(2, 4, dtype=torch.int64)
    good = 0.5 + torch.rand(2, 4, generator=gen, dtype=torch.float64)
    bad = good.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="temperature values must be finite"):
        fused_topk(hidden, weight, 4, temperature=bad, labels=labels, validate=True)
    checked = fused_topk(hidden, weight, 4, temperature=good, labels=labels, validate=True)
    unchecked = fused_topk(hidden, weight, 4, temperature=bad, labels=labels, validate=False)
    others = torch.ones(2, 4, dtype=torch.bool)
    others[1, 2] = False
    assert torch.isnan(unchecked.log_probs[1, 2]).all() and torch.isnan(unchecked.tail_log_mass[1, 2])
    assert torch.equal(unchecked.log_probs[others], checked.log_probs[others])
    assert torch.equal(unchecked.tail_log_mass[others], checked.tail_log_mass[others])
    assert torch.equal(unchecked.ids[others], checked.ids[others])
    with pytest.raises(ValueError, match="temperature must be shaped like labels"):
        fused_topk(hidden, weight, 4, temperature=good.t(), labels=labels, validate=False)
    with pytest.raises(TypeError, match="validate must be a bool or None, got str"):
        fused_topk(hidden, weight, 4, temperature=good, labels=labels, validate="no")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unchecked_bad_temperature_values_give_nan(layout, impl):
    """``validate=False``: each bad temperature value (NaN, ±inf, 0, negative, below
    MIN_TEMPERATURE; on valid tokens and on ignored ones) gives NaN ``log_probs`` and
    ``tail_log_mass`` for its token (a bad value is never a plausible number), vocab ids (those
    of ``T = 1``) on a valid token, and leaves every other token as a call without it computes;
    on either path, in every layout."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernel runs CPU tensors only under TRITON_INTERPRET=1")
    hidden, weight, labels = random_case(layout, 200, torch.float32)
    label_shape = LAYOUTS[layout][1]
    good = token_temperatures(label_shape, generator(next_seed()))
    checked = fused_topk(hidden, weight, 8, temperature=good, labels=labels, impl=impl, validate=True)
    untempered = fused_topk(hidden, weight, 8, labels=labels, impl=impl)
    flat_labels = labels.reshape(-1)
    valid_at = (flat_labels != IGNORE).nonzero().flatten()[:4].tolist()
    ignored_at = (flat_labels == IGNORE).nonzero().flatten()[:2].tolist()
    bad = good.clone()
    bad.view(-1)[valid_at + ignored_at] = torch.tensor([float("nan"), float("inf"), 0.0, -0.5, -float("inf"), 5e-5])
    out = fused_topk(hidden, weight, 8, temperature=bad, labels=labels, impl=impl, validate=False)
    poisoned = torch.zeros(label_shape, dtype=torch.bool)
    poisoned.view(-1)[valid_at + ignored_at] = True
    assert out.log_probs[poisoned].isnan().all() and out.tail_log_mass[poisoned].isnan().all()
    assert torch.equal(out.ids.reshape(-1, 8)[valid_at], untempered.ids.reshape(-1, 8)[valid_at])
    assert (out.ids.reshape(-1, 8)[ignored_at] == IGNORE).all()
    for got, expected in zip(out, checked, strict=True):
        assert torch.equal(got[~poisoned], expected[~poisoned])


def test_config_validation():
    """``TopKConfig`` refuses a bad field when built, naming it (TypeError for a type, ValueError
    for a value); it is frozen, and its defaults are the measured ones."""
    from mcore_ppo.backends.triton_host import GemmConfig
    from mcore_ppo.distill.topk_config import GPU_TILES

    defaults = TopKConfig()
    assert (defaults.token_chunk, defaults.vocab_chunk, defaults.tiles) == (2048, 4096, GPU_TILES)
    assert (defaults.tiles.block_m, defaults.tiles.block_n, defaults.tiles.use_tma) == (128, 256, True)
    assert (defaults.candidates, defaults.candidate_range, defaults.full_tile_cost) == (None, (1, 5), 500.0)
    assert (defaults.recompute_rows, defaults.scratch_bytes, defaults.splits) == (64, 512 * 2**20, None)
    assert TopKConfig(candidate_range=[2, 4]).candidate_range == (2, 4)
    with pytest.raises(AttributeError):
        defaults.token_chunk = 4  # frozen
    cases = [
        (TypeError, "token_chunk must be an int, got float", dict(token_chunk=4.0)),
        (TypeError, "vocab_chunk must be an int, got bool", dict(vocab_chunk=True)),
        (ValueError, "token_chunk must be >= 1, got 0", dict(token_chunk=0)),
        (ValueError, "scratch_bytes must be >= 1, got -1", dict(scratch_bytes=-1)),
        (ValueError, "candidates must be >= 1, got 0", dict(candidates=0)),
        (TypeError, "splits must be an int, got str", dict(splits="2")),
        (TypeError, "max_registers must be an int, got float", dict(max_registers=128.0)),
        (ValueError, "recompute_rows must be >= 1", dict(recompute_rows=0)),
        (ValueError, "interpreter_recompute_rows must be >= 1", dict(interpreter_recompute_rows=0)),
        (ValueError, "interpreter_select_rows must be >= 1", dict(interpreter_select_rows=0)),
        (TypeError, "tiles must be a mcore_ppo.backends.triton_host.GemmConfig, got dict", dict(tiles={})),
        (TypeError, "interpreter_tiles must be a", dict(interpreter_tiles=None)),
        (ValueError, "tiles.block_n must be a power of two", dict(tiles=GemmConfig(block_n=96))),
        (ValueError, "interpreter_tiles.num_warps must be >= 1", dict(interpreter_tiles=GemmConfig(num_warps=0))),
        (TypeError, "tiles.use_tma must be a bool", dict(tiles=GemmConfig(use_tma=1))),
        (TypeError, "candidate_range must be a (low, high) pair of ints", dict(candidate_range=3)),
        (TypeError, "candidate_range must be a (low, high) pair of ints", dict(candidate_range=(1, 2, 3))),
        (TypeError, "candidate_range must be an int", dict(candidate_range=(3.0, 5))),
        (ValueError, "candidate_range must be >= 1", dict(candidate_range=(0, 5))),
        (ValueError, "candidate_range must have low <= high, got (5, 3)", dict(candidate_range=(5, 3))),
        (TypeError, "full_tile_cost must be a number, got str", dict(full_tile_cost="500")),
        (TypeError, "full_tile_cost must be a number, got bool", dict(full_tile_cost=True)),
        (ValueError, "full_tile_cost must be finite and > 0", dict(full_tile_cost=0.0)),
        (ValueError, "full_tile_cost must be finite and > 0", dict(full_tile_cost=math.inf)),
        (TypeError, "sort_keys must be a bool, got int", dict(sort_keys=1)),
    ]
    for error, match, fields in cases:
        escaped = match.replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(error, match=escaped):
            TopKConfig(**fields)
    with pytest.raises(TypeError):
        TopKConfig(4096)  # keywords only


@pytest.mark.parametrize(
    ("dtype", "k", "vocab", "splits"),
    [(torch.float32, 8, 600, 3), (torch.float16, 64, 400, 2)],
    ids=["fp32-k8-3splits", "fp16-k64-2splits"],
)
def test_triton_per_token_temperature(dtype, k, vocab, splits, triton_path):
    """The kernel's per-row ``1/T_i`` ([s, b, h], 18 tokens over two row blocks of 16, a quarter
    ignored): against fp64 with the same temperatures and against the torch path."""
    gen = generator(next_seed())
    hidden = torch.randn(6, 3, HIDDEN, generator=gen).to(dtype)
    weight = torch.randn(vocab, HIDDEN, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (3, 6), generator=gen)
    labels[:, ::4] = IGNORE
    temperature = token_temperatures((3, 6), gen)
    out = triton_topk(hidden, weight, k, splits, temperature=temperature, labels=labels)
    assert triton_path == []  # no row needed the torch path
    ref = topk_reference(hidden.float(), weight.float(), k, temperature, labels, IGNORE)
    check_against_reference(out, ref, torch.float32, exact_ids=False)
    chunked = fused_topk(hidden, weight, k, temperature=temperature, labels=labels, impl="torch")
    torch.testing.assert_close(out.log_probs, chunked.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.tail_log_mass, chunked.tail_log_mass, rtol=0, atol=2e-5)


def test_triton_per_token_temperature_in_the_full_tiles(triton_path):
    """Rows 3, 7, 8, 13, 18 have logits in {0, c_i} only (half the vocab each: every tile's
    candidates tie at the k-th value), so their tiles are recomputed whole, which must take
    their own temperatures. All against fp64: exact ids, log-probs and tails."""
    gen = generator(next_seed())
    vocab, k = 300, 8
    hidden = torch.randn(20, 8, generator=gen)
    tied = torch.tensor([3, 7, 8, 13, 18])
    hidden[tied] = 0.0
    hidden[tied, 0] = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])
    weight = torch.randn(vocab, 8, generator=gen)
    weight[:, 0] = (torch.arange(vocab) % 2).float()
    temperature = token_temperatures((20,), gen)
    out = triton_topk(hidden, weight, k, 2, temperature=temperature)
    assert triton_path == []
    full_rows = {row for pairs in triton_path.full_tiles for row, _ in pairs}
    assert set(tied.tolist()) <= full_rows
    ref = topk_reference(hidden, weight, k, temperature)
    assert torch.equal(out.ids[tied], ref.ids[tied])
    check_against_reference(out, ref, torch.float32, exact_ids=False)
