"""The student's log-probs at k ids per token (the head with ``[..., k]`` labels:
``fused_log_probs_and_entropy``, ``mcore_ppo.fused_log_probs_at``) on one rank, against the fp64
full-logits reference (``mcore_ppo_testing.student_reference``).

Every layout ([s,b,h], packed [t,1,h], [n,h]) × k ∈ {1, 8, 64} × fp64/fp32/bf16 × the torch and
triton backends, with the chunks shrunk (torch backend 5 × 32, gather chunks of a few tokens),
ignored slots, fully ignored tokens and duplicate ids in a row; per-token temperatures; entropy
off and unused outputs; V = 262,144 at a few tokens; bad inputs.

Tolerances as for the head (tests/core/head_checks.py): outputs 1e-5 relative to the tensor's
max; gradients 1e-5 relative to the magnitudes of the terms they sum (bf16: plus the final
cast, 2^-8 per element).
"""

from __future__ import annotations

import os

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import TorchBackend, TorchConfig, import_optional
from mcore_ppo.main_grad import dummy_weight_grad
from mcore_ppo_testing.reference import assert_close
from mcore_ppo_testing.seeds import generator, next_seed
from mcore_ppo_testing.student_fold import record_folds
from mcore_ppo_testing.student_reference import student_reference
from mcore_ppo_testing.unset_buffers import nan_filled_unset_buffers

pytestmark = pytest.mark.usefixtures("one_thread")

TRITON_ON_CPU = pytest.mark.skipif(
    import_optional("triton") is None or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the triton backend runs CPU tensors only in the interpreter (TRITON_INTERPRET=1)",
)
IGNORE = -100
HIDDEN = 16
OUT_RTOL = 1e-5
BF16_CAST_RTOL = 2.0**-8
# layout -> (hidden's leading shape, the per-token shape of the ids)
LAYOUTS = {"sbh": ((5, 3), (3, 5)), "thd": ((13, 1), (1, 13)), "nh": ((14,), (14,))}


def small_torch(gather_elements: int = 1 << 25) -> TorchBackend:
    return TorchBackend(TorchConfig(token_chunk=5, vocab_chunk=32, gather_elements=gather_elements))


def make_case(layout: str, vocab: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Random hidden/weight, ids with ignored slots (a quarter), one token fully ignored, a
    duplicate id in every row (slot 1 repeats slot 0), and upstream gradients."""
    lead, token_shape = LAYOUTS[layout]
    hidden = torch.randn(*lead, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, vocab, (*token_shape, k), generator=gen)
    if k > 1:
        ids[..., 1] = ids[..., 0]
        flat = ids.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 4]] = IGNORE
    ids.view(-1, k)[2] = IGNORE
    g = torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    e = torch.randn(token_shape, generator=gen, dtype=torch.float64)
    return {"hidden": hidden, "weight": weight, "ids": ids, "g": g, "e": e}


def run(case: dict, temperature=0.7, *, use_entropy=True, **kwargs) -> dict:
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    log_q, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["ids"], temperature=temperature, **kwargs
    )
    loss = (log_q * case["g"].to(log_q.dtype)).sum()
    if use_entropy and entropy is not None:
        loss = loss + (entropy * case["e"].to(entropy.dtype)).sum()
    loss.backward()
    return {"log_q": log_q, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}


def compare(out: dict, ref: dict, dtype: torch.dtype, *, with_entropy=True, grad_rtol=OUT_RTOL, cast=None) -> None:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert out["log_q"].dtype == acc
    names = ("log_q", "entropy") if with_entropy else ("log_q",)
    for name in names:
        assert_close(out[name], ref[name], name=f"student {name}", dtype=dtype, rtol=OUT_RTOL)
    if cast is None:
        cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    for name in ("d_hidden", "d_weight"):
        assert out[name] is not None and out[name].dtype == dtype, name
        assert_close(
            out[name],
            ref[name],
            name=f"student {name}",
            dtype=dtype,
            rtol=grad_rtol,
            atol=1e-30,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
        )


def reference_of(case: dict, temperature=0.7, *, use_entropy=True) -> dict:
    return student_reference(
        case["hidden"], case["weight"], case["ids"], temperature, case["g"], case["e"] if use_entropy else None
    )


DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
# The torch backend in every combination; the triton one (Triton's interpreter: slow) in fp32 and
# bf16, k in {1, 8}, the [s, b, h] and [n, h] layouts.
CASES = [pytest.param("torch", layout, dtype, k, id=f"torch-{layout}-{dtype}-k{k}")
         for layout in LAYOUTS for dtype in DTYPES for k in (1, 8, 64)] + [
    pytest.param("triton", layout, dtype, k, id=f"triton-{layout}-{dtype}-k{k}", marks=TRITON_ON_CPU)
    for layout in ("sbh", "nh") for dtype in ("fp32", "bf16") for k in (1, 8)
]  # fmt: skip


@pytest.mark.parametrize("backend,layout,dtype_name,k", CASES)
def test_matches_fp64_reference(backend, layout, dtype_name, k, monkeypatch):
    """V = 100 (4 torch vocab chunks, the last ragged), gather chunks of 2-3 tokens."""
    dtype = DTYPES[dtype_name]
    case = make_case(layout, 100, k, dtype, generator(next_seed()))
    out = run(case, backend=small_torch(3 * k * HIDDEN - 1) if backend == "torch" else "triton")
    grad_rtol, cast = OUT_RTOL, None
    if backend == "triton" and dtype == torch.bfloat16:
        # The triton backend rounds dz to 16 bits before its GEMMs and returns d_hidden rounded
        # once (the head's own test_head_options bounds for this case).
        grad_rtol, cast = 1e-2, 8e-3
    compare(out, reference_of(case), dtype, grad_rtol=grad_rtol, cast=cast)
    ids = case["ids"]
    assert out["log_q"].shape == ids.shape and out["entropy"].shape == ids.shape[:-1]
    assert (out["log_q"][ids == IGNORE] == 0).all()
    assert (out["entropy"][(ids == IGNORE).all(-1)] == 0).all()
    assert (out["log_q"] <= 0).all()
    if k > 1:  # a duplicate id gets the same value in both slots
        both = (ids[..., 0] != IGNORE) & (ids[..., 1] != IGNORE)
        assert both.any() and torch.equal(out["log_q"][..., 0][both], out["log_q"][..., 1][both])


@pytest.mark.parametrize("layout", ["sbh", "nh"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_k1_slot_is_the_head(layout, backend):
    """Labels ``[..., 1]`` are the head's own path: the log-prob of the same label (labels
    ``[...]``), entropy and gradients, bit for bit."""
    gen = generator(next_seed())
    case = make_case(layout, 300, 1, torch.float32, gen)
    out = run(case, backend=backend)
    head_case = dict(case, ids=case["ids"][..., 0], g=case["g"][..., 0])
    head = run(head_case, backend=backend)
    assert torch.equal(out["log_q"][..., 0], head["log_q"])
    for name in ("entropy", "d_hidden", "d_weight"):
        assert torch.equal(out[name], head[name]), name


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_per_token_temperature(kind):
    """A temperature per token (``[b, s]``) or per sequence (``[b, 1]``) divides each token's logits."""
    gen = generator(next_seed())
    case = make_case("sbh", 100, 8, torch.float32, gen)
    shape = (3, 5) if kind == "token" else (3, 1)
    temperature = 0.3 + 2.2 * torch.rand(shape, generator=gen)
    out = run(case, temperature, backend=small_torch())
    compare(out, reference_of(case, temperature), torch.float32)


def test_entropy_off_and_unused_outputs():
    """``return_entropy=False`` → ``(log_q, None)`` with the log-q gradients alone; a loss on the
    entropy alone gives the entropy's gradients alone."""
    gen = generator(next_seed())
    case = make_case("nh", 100, 8, torch.float32, gen)
    out = run(case, backend=small_torch(), return_entropy=False)
    assert out["entropy"] is None
    compare(out, reference_of(case, use_entropy=False), torch.float32, with_entropy=False)
    entropy_only = dict(case, g=torch.zeros_like(case["g"]))
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    _, entropy = mcore_ppo.fused_log_probs_at(hidden, weight, case["ids"], temperature=0.7, backend=small_torch())
    (entropy * case["e"].float()).sum().backward()
    ref = reference_of(entropy_only)
    assert_close(hidden.grad, ref["d_hidden"], name="student d_hidden", dtype=torch.float32, rtol=OUT_RTOL,
                 atol=1e-30, terms=ref["d_hidden_terms"])  # fmt: skip


def test_large_vocab_few_tokens():
    """V = 262,144 (several default vocab chunks), k = 64, 6 tokens, fp32."""
    gen = generator(next_seed())
    vocab, k = 262_144, 64
    hidden = torch.randn(3, 2, HIDDEN, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen) * 0.5
    ids = torch.randint(0, vocab, (2, 3, k), generator=gen)
    ids[0, 1, 5:] = IGNORE
    case = {
        "hidden": hidden,
        "weight": weight,
        "ids": ids,
        "g": torch.randn(ids.shape, generator=gen, dtype=torch.float64),
        "e": torch.randn(2, 3, generator=gen, dtype=torch.float64),
    }
    out = run(case, 1.0, backend="torch")
    compare(out, reference_of(case, 1.0), torch.float32)


def test_ignored_tokens_with_inf_hidden_are_skipped():
    """A token whose slots are all ignored may carry inf/NaN hidden states (padding): its outputs
    are 0 and no NaN reaches a gradient."""
    gen = generator(next_seed())
    case = make_case("nh", 100, 8, torch.float32, gen)
    case["hidden"][2] = torch.inf  # token 2 is fully ignored (make_case)
    out = run(case, backend=small_torch())
    for name in ("log_q", "entropy", "d_hidden", "d_weight"):
        assert torch.isfinite(out[name]).all(), name
    assert (out["d_hidden"][2] == 0).all()


def test_no_grad_and_double_backward():
    gen = generator(next_seed())
    case = make_case("nh", 50, 4, torch.float32, gen)
    hidden = case["hidden"].detach().requires_grad_(True)
    with torch.no_grad():
        log_q, _ = mcore_ppo.fused_log_probs_at(hidden, case["weight"], case["ids"])
    assert not log_q.requires_grad
    log_q, _ = mcore_ppo.fused_log_probs_at(hidden, case["weight"], case["ids"])
    with pytest.raises(NotImplementedError, match="differentiable once"):
        torch.autograd.grad(log_q.sum(), hidden, create_graph=True)


def test_bad_inputs():
    gen = generator(next_seed())
    case = make_case("sbh", 50, 4, torch.float32, gen)
    hidden, weight, ids = case["hidden"], case["weight"], case["ids"]
    api = mcore_ppo.fused_log_probs_and_entropy
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        api(hidden, weight, ids.float())
    with pytest.raises(TypeError, match="hidden must be a floating-point"):
        api(hidden.long(), weight, ids)
    bad = ids.clone()
    bad[1, 2, 0] = 50
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\)"):
        api(hidden, weight, bad)
    bad[1, 2, 0] = -3
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\)"):
        api(hidden, weight, bad)
    # Without validation the bad slot is NaN, the others are values.
    log_q, _ = api(hidden, weight, bad, validate=False)
    assert torch.isnan(log_q[1, 2, 0]) and torch.isfinite(log_q[0]).all()
    with pytest.raises(ValueError, match="k >= 1"):
        api(hidden, weight, ids[..., :0])
    with pytest.raises(ValueError, match=r"labels must have shape \[b, s, k\] for hidden \[s, b, h\] with k ids"):
        api(hidden, weight, ids.transpose(0, 1))
    with pytest.raises(ValueError, match="temperature must be shaped like labels"):
        api(hidden, weight, ids, temperature=torch.ones(3, 5, 4))
    with pytest.raises(ValueError, match="temperature values"):
        api(hidden, weight, ids, temperature=torch.zeros(3, 1))
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        mcore_ppo.fused_log_probs_at(hidden, weight, ids, sequence_parallel=1)


def test_liger_is_not_a_backend():
    gen = generator(next_seed())
    case = make_case("nh", 50, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="liger_log_probs_and_entropy"):
        mcore_ppo.fused_log_probs_at(case["hidden"], case["weight"], case["ids"], backend="liger")


@TRITON_ON_CPU
def test_triton_recompute_mode():
    """The triton backend with no probability buffer (its backward recomputes the logits)."""
    from mcore_ppo.backends import TritonBackend, TritonConfig

    case = make_case("sbh", 100, 8, torch.float32, generator(next_seed()))
    out = run(case, backend=TritonBackend(TritonConfig(buffer_budget_bytes=0)))
    compare(out, reference_of(case), torch.float32)


def test_empty_and_all_ignored_batches():
    """No tokens: empty outputs and gradients; every slot ignored: exact zeros, no NaN."""
    weight = torch.randn(20, 8, requires_grad=True)
    hidden = torch.randn(0, 8, requires_grad=True)
    log_q, entropy = mcore_ppo.fused_log_probs_at(hidden, weight, torch.zeros(0, 4, dtype=torch.long))
    (log_q.sum() + entropy.sum()).backward()
    assert log_q.shape == (0, 4) and entropy.shape == (0,) and hidden.grad.shape == (0, 8)
    hidden = torch.randn(3, 2, 8, requires_grad=True)
    log_q, entropy = mcore_ppo.fused_log_probs_at(hidden, weight, torch.full((2, 3, 4), IGNORE))
    (log_q.sum() + entropy.sum()).backward()
    for value in (log_q, entropy, hidden.grad, weight.grad):
        assert torch.equal(value, torch.zeros_like(value))


def test_accumulate_into_main_grad():
    """Megatron's gradient-accumulation fusion: the weight gradient is added to ``weight.main_grad``
    (fp32), ``grad_added_to_main_grad`` is set and the returned gradient is zeros."""
    case = make_case("sbh", 100, 8, torch.float32, generator(next_seed()))
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    weight.main_grad = torch.ones(weight.shape, dtype=torch.float32)
    log_q, entropy = mcore_ppo.fused_log_probs_at(
        hidden, weight, case["ids"], temperature=0.7, backend=small_torch(), accumulate_into_main_grad=True
    )
    ((log_q * case["g"].float()).sum() + (entropy * case["e"].float()).sum()).backward()
    ref = reference_of(case)
    # Megatron's convention: autograd gets the one dummy gradient, not a fresh [V, h] tensor.
    assert weight.grad_added_to_main_grad and weight.grad.data_ptr() == dummy_weight_grad(weight).data_ptr()
    assert_close(weight.main_grad - 1, ref["d_weight"], name="student d_weight", dtype=torch.float32, rtol=OUT_RTOL,
                 atol=1e-6, terms=ref["d_weight_terms"])  # fmt: skip
    assert_close(hidden.grad, ref["d_hidden"], name="student d_hidden", dtype=torch.float32, rtol=OUT_RTOL,
                 atol=1e-30, terms=ref["d_hidden_terms"])  # fmt: skip


# The forward's gather kernel (mcore_ppo.kernels.gather) under the interpreter, with blocks shrunk
# so that every loop runs more than once: blocks of 4 in-shard slots, 16 hidden columns per step,
# and the scan over a token's ids 4 slots at a time. The fold: the triton backend adds the one-hot
# gradients to its dz (the onehot kernels) before its GEMMs, 4 slots per step (k = 8: a duplicate
# can sit in another step than its first) and 8 slots per add program.
SMALL_KERNELS = {"gather_rows": (4, 16, 1), "gather_scan_slots": 4, "onehot_block_k": 4, "onehot_add_elements": 8}


def small_triton(**settings):
    from mcore_ppo.backends import TritonBackend, TritonConfig

    return TritonBackend(TritonConfig(**SMALL_KERNELS, **settings))


def gather_case(dtype: torch.dtype, gen: torch.Generator, n=9, h=37, v=23, k=6) -> dict:
    """ids local to a shard of ``v`` rows: duplicates in a row, ids of other shards (-1: outside,
    or ignored), a token with every slot in the shard (two blocks), one with only its last slot
    in it, and a token with no slot in the shard whose hidden row is inf."""
    x = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    w = (0.5 * torch.randn(v, h, generator=gen, dtype=torch.float64)).to(dtype)
    local = torch.randint(0, v, (n, k), generator=gen)
    local[:, 1] = local[:, 0]
    local[torch.rand(n, k, generator=gen) < 0.25] = -1
    local[0] = torch.randint(0, v, (k,), generator=gen)
    local[5, :-1] = -1
    local[4] = -1
    x[4] = torch.inf
    return {"x": x, "w": w, "local": local}


@TRITON_ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gather_logits_kernel_matches_fp64(dtype):
    """The triton backend's gather of the ids' logits against fp64 (and the torch backend's);
    slots outside the shard and the inf token's row give exact zeros."""
    case = gather_case(dtype, generator(next_seed()))
    x, w, local = case["x"], case["w"], case["local"]
    ok = local >= 0
    x64 = torch.where(ok.any(1, keepdim=True), x.double(), 0.0)
    z_ref = torch.where(ok, torch.einsum("nkh,nh->nk", w.double()[local.clamp(min=0)], x64), 0.0) / 0.7
    for backend in (small_triton(), small_torch(2 * 6 * 37)):
        z = backend.gather_logits(x, w, local, 0.7)
        assert z.dtype == torch.float32 and torch.isfinite(z).all()
        assert (z[~ok] == 0).all()
        torch.testing.assert_close(z.double(), z_ref, rtol=1e-5, atol=1e-5 * z_ref.abs().max().item())


# In recompute mode vocab chunks of one 32-column tile (V = 100: chunks 0-31, 32-63, 64-95, 96-99).
FOLD_VOCAB, FOLD_K, FOLD_TOKENS = 100, 8, 15
BOUNDARY_IDS = (0, 31, 32, 63, 64, 95, 96, 99)


def fold_backend(mode: str):
    if mode == "recompute":  # no buffer; the smallest workspace: one tile of columns per chunk
        return small_triton(workspace_bytes=1, buffer_budget_bytes=0)
    return small_triton(buffer_budget_bytes=1 << 30)


def fold_case(dtype: torch.dtype, gen: torch.Generator) -> dict:
    """``[n, h]`` tokens, ``k = 8`` ids: slot 2 at the chunks' first and last columns, duplicates
    in the same step (slot 1 = slot 0) and across steps (slot 5 = slot 0), a token whose 8 slots
    hold one id, a quarter of the slots ignored, token 6 fully ignored with an inf hidden row."""
    n, k = FOLD_TOKENS, FOLD_K
    hidden = torch.randn(n, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(FOLD_VOCAB, HIDDEN, generator=gen, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, FOLD_VOCAB, (n, k), generator=gen)
    ids[:, 2] = torch.tensor(BOUNDARY_IDS).repeat(2)[:n]
    ids[:, 1] = ids[:, 0]
    ids[:, 5] = ids[:, 0]
    ids[torch.rand(n, k, generator=gen) < 0.25] = IGNORE
    ids[3] = ids[3, 2]
    ids[6] = IGNORE
    hidden[6] = torch.inf
    g = torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    e = torch.randn(n, generator=gen, dtype=torch.float64)
    return {"hidden": hidden, "weight": weight, "ids": ids, "g": g, "e": e}


@TRITON_ON_CPU
@pytest.mark.parametrize("temperature_kind", ["scalar", "per_token"])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["recompute", "buffer"])
def test_fold_matches_fp64(mode, dtype_name, temperature_kind, monkeypatch):
    """The one-hot gradients folded into the triton backend's dz, in both backward modes, against
    fp64 (and, in fp32, against the torch backend, which folds them into its own fp32 dz: the
    same gradients to fp32 rounding)."""
    dtype = DTYPES[dtype_name]
    gen = generator(next_seed())
    case = fold_case(dtype, gen)
    temperature = 0.7 if temperature_kind == "scalar" else 0.3 + 2.2 * torch.rand(FOLD_TOKENS, generator=gen)
    calls = record_folds(monkeypatch)
    unset_buffers = nan_filled_unset_buffers(monkeypatch)  # d_W comes unfilled: every row written
    out = run(case, temperature, backend=fold_backend(mode))
    expected = [(0, 32), (32, 32), (64, 32), (96, 4)] if mode == "recompute" else [(0, FOLD_VOCAB)]
    assert calls == expected
    assert unset_buffers == [True]
    grad_rtol, cast = (1e-2, 8e-3) if dtype == torch.bfloat16 else (OUT_RTOL, None)
    compare(out, reference_of(case, temperature), dtype, grad_rtol=grad_rtol, cast=cast)
    for name in ("d_hidden", "d_weight"):
        assert torch.isfinite(out[name]).all(), name
    assert (out["d_hidden"][6] == 0).all()
    if dtype == torch.float32:
        by_torch = run(case, temperature, backend=small_torch())
        for name in ("d_hidden", "d_weight"):
            scale = by_torch[name].abs().max().item()
            torch.testing.assert_close(out[name], by_torch[name], rtol=0, atol=2e-6 * scale)


@TRITON_ON_CPU
def test_onehot_kernels():
    """The merge (compacted rows, each id once per row with its slots' sum times 1/T per row,
    -1 past the valid count and for slots outside the shard, whose g may be NaN) and the add
    into a bf16 chunk view at an offset (fp32 sum, one rounding; every other element untouched)."""
    from mcore_ppo.backends import TritonConfig, triton_ids
    from mcore_ppo.backends.base import SparseGradient
    from mcore_ppo.backends.triton_host import compact_rows
    from mcore_ppo.backends.triton_launch import Launcher

    config = TritonConfig(**SMALL_KERNELS)
    gen = generator(next_seed())
    n, k, v0, vc = 7, 10, 64, 17
    ids = torch.randint(v0 - 3, v0 + vc + 3, (n, k), generator=gen)
    ids[:, 4] = ids[:, 0]
    ids[:, 9] = ids[:, 0]
    ids[2] = v0 + vc - 1
    ids[:, 3] = -1
    g = torch.randn(n, k, generator=gen)
    g[:, 3] = torch.nan
    valid = torch.ones(n, dtype=torch.bool)
    valid[[1, 5]] = False
    ids[[1, 5]] = -1
    temperature = 0.5 + torch.rand(n, generator=gen)
    launch = Launcher().bound()
    perm, count = compact_rows(valid, launch)
    ids_m, g_m = triton_ids.merged_onehot(config, launch, SparseGradient(ids, g), perm, count, temperature, temperature)
    inv_t = (1.0 / temperature.double()).float()
    want_ids = torch.full((n, k), -1, dtype=torch.int64)
    want_g = torch.zeros(n, k)
    for r, t in enumerate(perm[: int(count)].tolist()):
        for i in range(k):
            same = ids[t] == ids[t, i]
            if ids[t, i] >= 0 and not same[:i].any():
                want_ids[r, i] = ids[t, i]
                want_g[r, i] = g[t][same].double().sum().float() * inv_t[t]
    assert torch.equal(ids_m, want_ids)
    picked = want_ids >= 0
    torch.testing.assert_close(g_m[picked], want_g[picked], rtol=1e-6, atol=0)

    workspace = torch.randn(n, 32, generator=gen).to(torch.bfloat16)
    before = workspace.clone()
    dz = workspace[:, :vc]
    triton_ids.add_onehot(config, launch, dz, (ids_m, g_m), v0, vc)
    exact = before.float()
    hit = torch.zeros(n, 32, dtype=torch.bool)
    for r in range(n):
        for i in range(k):
            col = int(ids_m[r, i]) - v0
            if ids_m[r, i] >= 0 and 0 <= col < vc:
                exact[r, col] += g_m[r, i]
                hit[r, col] = True
    assert hit.any() and torch.equal(workspace[~hit], before[~hit])
    # One rounding of the fp32 sum to bf16: to nearest on a GPU; Triton's interpreter truncates.
    ulp = torch.finfo(torch.bfloat16).eps * exact[hit].abs().clamp(min=2.0**-126)
    assert ((workspace[hit].float() - exact[hit]).abs() <= ulp).all()


@TRITON_ON_CPU
def test_fold_into_main_grad_and_fp64_reference(monkeypatch):
    """Folded with Megatron's ``main_grad`` (fp32, holding values): the weight gradient is added
    to it. fp64 inputs on the triton backend run its torch reference inside, which folds the
    one-hot gradients into its own dz: to fp64 rounding."""
    from mcore_ppo.backends import TritonBackend

    calls = record_folds(monkeypatch)
    case = fold_case(torch.float32, generator(next_seed()))
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    weight.main_grad = torch.ones(weight.shape, dtype=torch.float32)
    log_q, entropy = mcore_ppo.fused_log_probs_at(
        hidden, weight, case["ids"], temperature=0.7, backend=fold_backend("buffer"), accumulate_into_main_grad=True
    )
    ((log_q * case["g"].float()).sum() + (entropy * case["e"].float()).sum()).backward()
    assert calls == [(0, FOLD_VOCAB)]
    ref = reference_of(case)
    # Megatron's convention: autograd gets the one dummy gradient, not a fresh [V, h] tensor.
    assert weight.grad_added_to_main_grad and weight.grad.data_ptr() == dummy_weight_grad(weight).data_ptr()
    assert_close(weight.main_grad - 1, ref["d_weight"], name="student d_weight", dtype=torch.float32, rtol=OUT_RTOL,
                 atol=1e-6, terms=ref["d_weight_terms"])  # fmt: skip

    calls.clear()
    case64 = fold_case(torch.float64, generator(next_seed()))
    compare(run(case64, backend=TritonBackend()), reference_of(case64), torch.float64)
    assert calls == []  # no kernel fold for fp64


@pytest.mark.parametrize("terms", ["lse", "entropy", "entropy-sum-pi"])
@pytest.mark.parametrize("dtype_name", ["fp64", "fp32"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_given_statistics_of_the_topk_pass_stand_in_for_the_statistics(backend, dtype_name, terms):
    """The ids pass given the top-k pass's finished statistics (verl's top-k distillation route:
    one pass over the vocab, no statistics pass of its own, the backward recomputes) against
    fp64, per-token temperature: ``lse`` alone, with the entropy (its value and its gradient),
    and with Σπ² too; refused for one label per token and where the rows do not fit the call."""
    from mcore_ppo.distill.topk import topk_and_statistics
    from mcore_ppo.head_call import run_head, statistics_of
    from mcore_ppo.options import HiddenGrad, Layout, TokenOrder, call_options

    dtype = DTYPES[dtype_name]
    case = make_case("nh", 100, 8, dtype, generator(next_seed()))
    temperature = 0.5 + torch.rand(case["ids"].shape[0], generator=generator(next_seed()), dtype=torch.float64)
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    # The top-k pass on the head's own kind of kernels (the triton one under the interpreter,
    # but for fp64, which it does not take).
    impl, backend_object = ("torch", small_torch()) if backend == "torch" else ("triton", backend)
    if dtype == torch.float64:
        impl = "torch"
    options = call_options(
        None, ignore_index=IGNORE, backend=backend_object, return_entropy=terms != "lse",
        return_sum_pi_squared=terms == "entropy-sum-pi", validate=True,
    )  # fmt: skip
    layout = Layout(TokenOrder.MEGATRON, HiddenGrad.PARTIAL)
    _, given = topk_and_statistics(
        hidden, weight, 8, statistics=statistics_of(options), temperature=temperature, impl=impl
    )
    out = run_head(
        hidden, weight, case["ids"], temperature, options, tp_group=None, layout=layout, ids=True,
        given_statistics=given,
    )  # fmt: skip
    log_q, entropy = out[:2]
    assert (entropy is None) == (terms == "lse") and not given.requires_grad
    loss = (log_q * case["g"].to(log_q.dtype)).sum()
    if entropy is not None:
        loss = loss + (entropy * case["e"].to(entropy.dtype)).sum()
    loss.backward()
    result = {"log_q": log_q, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}
    compare(result, reference_of(case, temperature, use_entropy=entropy is not None), dtype,
            with_entropy=entropy is not None)  # fmt: skip
    if terms == "entropy-sum-pi":
        z = case["hidden"].double() @ case["weight"].double().t() / temperature[:, None]
        valid = (case["ids"] != IGNORE).any(dim=1)
        want = torch.where(valid, torch.softmax(z, dim=1).square().sum(dim=1), 0.0)
        assert_close(out[2], want, name="sum_pi_squared", dtype=dtype, rtol=OUT_RTOL)
    with pytest.raises(ValueError, match="given_statistics"):  # one label per token
        run_head(hidden, weight, case["ids"][:, 0], temperature, options, tp_group=None, layout=layout,
                 given_statistics=given)  # fmt: skip
    wrong = {
        ValueError: [given[1:], given[:, 1:], given[None], torch.cat([given, given])],
        TypeError: [given.to(torch.float16), given.tolist()],
    }
    for error, values in wrong.items():
        for value in values:
            with pytest.raises(error, match="given_statistics must be"):
                run_head(hidden, weight, case["ids"], temperature, options, tp_group=None, layout=layout,
                         ids=True, given_statistics=value)  # fmt: skip


def test_sparse_on_torch_is_a_backend_object_that_matches_fp64():
    """The benchmark's ``SparseOnTorch`` (the ids' part on a torch path around another backend)
    passes the head's backend check, so it stays a valid backend object as the protocol grows,
    and its outputs and gradients match the fp64 reference around the torch backend."""
    from mcore_ppo_testing.bench_student import SparseOnTorch

    case = make_case("nh", 100, 8, torch.float32, generator(next_seed()))
    out = run(case, backend=SparseOnTorch(small_torch(), gather_elements=3 * 8 * HIDDEN))
    compare(out, reference_of(case), torch.float32, grad_rtol=OUT_RTOL, cast=None)
