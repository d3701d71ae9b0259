"""The ``triton`` backend's kernels against the fp64 reference and the torch backend.

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be set
before :mod:`mcore_ppo.kernels` is decorated (imported), so this module sets it at import and
keeps it set only while its own tests run (``interpreter`` fixture). Shapes are tiny and odd
(no size divisible by a block) and the inputs fp32: the interpreter's bf16 arithmetic is wrong,
so the one bf16 test relies on the kernels' upcast-after-load path.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
import mcore_ppo.kernels  # noqa: E402,F401  (decorated now, under the interpreter on CPU)
from mcore_ppo.api import fused_log_probs_and_entropy  # noqa: E402
from mcore_ppo.backends import resolve_backend, triton_config  # noqa: E402
from mcore_ppo.backends.torch_backend import TorchBackend  # noqa: E402
from mcore_ppo.backends.triton_host import compact_rows, descriptor_ok  # noqa: E402
from mcore_ppo.backends.triton_launch import Launcher  # noqa: E402
from mcore_ppo.statistics import DEFAULT, Statistics  # noqa: E402
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference  # noqa: E402
from mcore_ppo_testing.seeds import generator, next_seed  # noqa: E402
from mcore_ppo_testing.unset_buffers import nan_filled_unset_buffers  # noqa: E402

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]  # the rest of the suite never sees it


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Interpreter on for this module's tests only (the host wrappers read it per call)."""
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MCORE_PPO_BUFFER_BUDGET_BYTES", raising=False)
    yield


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton(*, tma: bool = False, **settings) -> triton_backend.TritonBackend:
    """A triton backend built with ``settings`` (:class:`TritonConfig` fields). The recompute
    path unless a budget is given (these tiny problems would all fit the default buffer budget);
    the kernels' own IEEE dots for fp32 CUDA operands (cuBLAS's route is the torch backend's,
    tested in ``tests/gpu/test_gpu_precision.py``). ``tma``: operands, dz and buffer tiles
    through the copy engine (the GPU's default configs already are; the interpreter's small
    tiles are switched to it)."""
    settings.setdefault("buffer_budget_bytes", 0)
    settings.setdefault("ieee_gemms", "kernels")
    config = triton_backend.TritonConfig(**settings)
    forward, _ = config.resolved_forward()
    if tma and not forward.use_tma:
        backward = replace(config.resolved_backward()[0], use_tma=True)
        config = replace(config, forward_config=replace(forward, use_tma=True), backward_config=backward)
    backend = triton_backend.TritonBackend(config)
    assert not tma or (backend.forward_config.use_tma and backend.backward_config.use_tma)
    return backend


def make_case(n, h, v, *, seed, scale=1.0, shift=0.0, ignored=0.3, dtype=torch.float32):
    gen = generator(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64) * scale
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5
    if shift:
        # A constant logit offset: the extra hidden column meets a weight column of ones.
        hidden[:, 0] = shift
        weight[:, 0] = 1.0
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = IGNORE_INDEX
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    e = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), labels.to(DEVICE), g.float(), e.float()


def run_head(hidden, weight, labels, temperature, g, e, backend=None, **kw):
    """Forward and backward through the API with ``backend`` (None: :func:`triton`'s default)."""
    x = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    backend = triton() if backend is None else backend
    logp, ent = fused_log_probs_and_entropy(x, w, labels, temperature=temperature, backend=backend, **kw)
    outs, grads = [], []
    if g is not None:
        outs.append(logp)
        grads.append(g.to(DEVICE))
    if e is not None:
        outs.append(ent)
        grads.append(e.to(DEVICE))
    torch.autograd.backward(outs, grads)
    return logp.detach(), ent.detach(), x.grad, w.grad


def check_against_reference(hidden, weight, labels, temperature, g, e, *, rtol=2e-6, atol=1e-6, grad_rtol=2e-5, **kw):
    logp, ent, dh, dw = run_head(hidden, weight, labels, temperature, g, e, **kw)
    ref = reference(hidden.cpu(), weight.cpu(), labels.cpu(), temperature, g, e)
    dtype = hidden.dtype
    assert_close(logp.cpu(), ref["log_prob"], name="log_prob", dtype=dtype, rtol=rtol, atol=atol)
    assert_close(ent.cpu(), ref["entropy"], name="entropy", dtype=dtype, rtol=rtol, atol=atol)
    # atol: gradient entries below ~1e-38 underflow in fp32 (p = exp(-1000) is 0 there).
    for name, got in (("d_hidden", dh), ("d_weight", dw)):
        terms = ref[f"{name}_terms"]
        assert_close(got.cpu(), ref[name], name=name, dtype=dtype, rtol=grad_rtol, atol=1e-30, terms=terms)
    valid = labels.cpu() != IGNORE_INDEX
    assert (logp.cpu()[valid] <= 0).all() and (ent.cpu() >= 0).all()
    return logp, ent, dh, dw


def test_backend_resolves():
    backend = resolve_backend("triton", DEVICE)
    assert isinstance(backend, triton_backend.TritonBackend)
    assert backend.forward_config.block_m <= 128
    # Built from the environment's budget, the defaults otherwise.
    assert backend.config == triton_backend.TritonConfig.from_environment() == triton_backend.TritonConfig()


@pytest.mark.parametrize(
    ("n", "h", "v", "temperature"),
    [(37, 24, 150, 0.7), (5, 17, 33, 1.0), (40, 32, 197, 2.5)],
)
def test_head_matches_fp64(n, h, v, temperature):
    """Outputs and both gradients vs fp64, odd sizes, ignored tokens, T ≠ 1."""
    hidden, weight, labels, g, e = make_case(n, h, v, seed=next_seed())
    check_against_reference(hidden, weight, labels, temperature, g, e)


def test_statistics_match_torch_backend():
    """The raw shard statistics (m, s, u, y) equal the torch backend's, labels of other shards too."""
    hidden, weight, labels, _, _ = make_case(33, 20, 101, seed=next_seed(), ignored=0.0)
    valid = torch.ones(33, dtype=torch.bool, device=DEVICE)
    valid[::4] = False
    local = labels.clone()
    local[1::3] = -1  # label owned by another TP rank: y must be 0, the row still counted
    local[~valid] = -1
    flags = {"grad_needed": False, "statistics": DEFAULT}
    ours = _planes(triton().shard_statistics(hidden, weight, local, valid, 0.9, **flags))
    ref = _planes(TorchBackend().shard_statistics(hidden.double(), weight.double(), local, valid, 0.9, **flags))
    for name, a, b in zip("msuy", ours, ref, strict=True):
        assert a.dtype == torch.float32
        assert_close(a[valid].cpu(), b[valid].cpu(), name=f"stat_{name}", dtype=torch.float32, rtol=2e-6, atol=1e-6)
    assert (ours[3][1::3] == 0).all()
    # Ignored rows get the neutral (0, 1, 0, 0): finite downstream, never NaN.
    assert (ours[0][~valid] == 0).all() and (ours[1][~valid] == 1).all() and (ours[2][~valid] == 0).all()


def _planes(stats) -> tuple[torch.Tensor, ...]:
    """``(m, s, u, y)`` of default statistics."""
    return stats.m, *stats.sums.unbind(0), stats.y


def test_all_ignored_is_zero():
    hidden, weight, labels, g, e = make_case(19, 16, 70, seed=next_seed(), ignored=1.0)
    logp, ent, dh, dw = run_head(hidden, weight, labels, 1.3, g, e)
    for t in (logp, ent, dh, dw):
        assert torch.isfinite(t).all()
        assert (t == 0).all()


@pytest.mark.parametrize(("scale", "shift"), [(300.0, 0.0), (1.0, -5000.0), (1.0, 8000.0)])
def test_extreme_logits(scale, shift):
    """Logits of size 1e3..1e4, far below and far above zero: exact to fp32 rounding."""
    hidden, weight, labels, g, e = make_case(16, 16, 45, seed=next_seed(), scale=scale, shift=shift)
    # The fp32 GEMM that forms logits of size L is itself off by ~sqrt(h)·eps32·L before the head
    # does anything, and every output is Lipschitz in the logits: tolerances scale with L (as in
    # test_head_reference.py), plus the head's own fp32 rounding.
    logit_scale = (hidden.double() @ weight.double().t()).abs().max().item() / 0.8
    atol = 4e-6 * logit_scale
    check_against_reference(hidden, weight, labels, 0.8, g, e, rtol=2e-6, atol=atol, grad_rtol=2e-5 + 2 * atol)


def test_equal_logits_entropy_is_log_v():
    n, h, v = 9, 16, 77
    hidden = torch.randn(n, h, generator=generator(next_seed())).to(DEVICE)
    weight = torch.ones(v, h, device=DEVICE)
    labels = torch.arange(n, device=DEVICE) * 7
    logp, ent = fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.5, backend="triton")
    expected = torch.full((n,), torch.log(torch.tensor(float(v))).item(), device=DEVICE)
    assert_close(ent.cpu(), expected.cpu(), name="entropy", dtype=torch.float32, rtol=1e-6)
    assert_close(logp.cpu(), -expected.cpu(), name="log_prob", dtype=torch.float32, rtol=1e-6)


@pytest.mark.parametrize("which", ["log_prob", "entropy"])
def test_one_output_used(which):
    """An unused output passes no gradient (None); the other's gradient is still exact."""
    hidden, weight, labels, g, e = make_case(21, 24, 66, seed=next_seed())
    g, e = (g, None) if which == "log_prob" else (None, e)
    check_against_reference(hidden, weight, labels, 1.1, g, e)


def test_several_backward_chunks():
    """A workspace smaller than the shard splits the backward into vocab chunks (last one ragged)."""
    block_n = triton().backward_config.block_n
    backend = triton(workspace_bytes=30 * 4 * 2 * block_n)  # two tiles for n=30 fp32
    v = 4 * block_n + 22
    hidden, weight, labels, g, e = make_case(30, 16, v, seed=next_seed())
    assert backend.vocab_chunk(30, v, 4) == 2 * block_n
    check_against_reference(hidden, weight, labels, 0.6, g, e, backend=backend)


# Vocab rows per shard -> the forward's tiles per split (qwen7b, llama3-8b, V 262144 at TP 1-8).
MEASURED_SHARDS = {152064: 8, 131072: 8, 128256: 8, 262144: 8, 76032: 4, 65536: 4, 64128: 4}
MEASURED_SHARDS |= {38016: 2, 32064: 2, 19008: 2, 16032: 2, 1000: 2, 1: 2}


def test_forward_tiles_per_split_follow_the_shard(monkeypatch):
    """The default GPU config folds 8, 4 or 2 vocab tiles per forward program by shard size,
    as measured (docs/kernels.md), keeping at least ``min_forward_splits`` splits where it can;
    a config the caller gives is used as given."""
    monkeypatch.setattr(triton_config, "interpreting", lambda: False)  # the GPU's defaults
    backend = triton_backend.TritonBackend()
    assert backend.tiles_by_shard and backend.forward_config == triton_config.GPU_FORWARD
    block_n = backend.forward_config.block_n
    for v, tiles in MEASURED_SHARDS.items():
        cfg = backend.forward_config_for(v)
        assert cfg.tiles_per_split == tiles, (v, cfg.tiles_per_split)
        assert cfg == replace(backend.forward_config, tiles_per_split=tiles)
        splits = -(-v // (tiles * block_n))
        assert tiles == 2 or splits >= backend.config.min_forward_splits
    given = replace(triton_config.GPU_FORWARD, tiles_per_split=4)
    assert (
        triton_backend.TritonBackend(triton_backend.TritonConfig(forward_config=given)).forward_config_for(152064)
        is given
    )


def test_fp32_operands_take_their_dots_tiles(monkeypatch):
    """On a GPU, fp32 operands under the default tiles take their dot's (IEEE: small tiles, the
    SIMT units' accumulators do not spill; fp32_faithful's fp16 parts: 128 × 128), forward and backward, at every
    shard; 16-bit operands keep the default's, and a config the caller gives is used as given."""
    monkeypatch.setattr(triton_config, "interpreting", lambda: False)  # the GPU's defaults
    for precision, dot in (("auto", "ieee"), ("ieee", "ieee"), ("fp32_faithful", "fp16x3")):
        backend = triton_backend.TritonBackend(triton_backend.TritonConfig(precision=precision))
        forward, backward = triton_config.FP32_TILES[dot]
        for v in MEASURED_SHARDS:
            cfg = backend.forward_config_for(v, torch.float32)
            assert cfg == replace(forward, tiles_per_split=cfg.tiles_per_split), (precision, v)
            # Tiles per split by the shard rule, at these tiles' width.
            splits = -(-v // (cfg.tiles_per_split * cfg.block_n))
            assert cfg.tiles_per_split == 2 or splits >= backend.config.min_forward_splits, (precision, v)
            assert backend.forward_config_for(v, torch.bfloat16).block_n == triton_config.GPU_FORWARD.block_n
        # At the shard the tiles were measured on, the fp16 parts keep the measured 2 tiles per split.
        assert dot != "fp16x3" or backend.forward_config_for(19008, torch.float32).tiles_per_split == 2
        assert backend.backward_config_for(torch.float32) == backward
        assert backend.backward_config_for(torch.bfloat16) == triton_config.GPU_BACKWARD
        given = replace(triton_config.GPU_FORWARD, block_m=32)
        mine = triton_backend.TritonBackend(
            triton_backend.TritonConfig(precision=precision, forward_config=given, backward_config=given)
        )
        assert mine.forward_config_for(19008, torch.float32) is given
        assert mine.backward_config_for(torch.float32) is given
    assert triton_config.FP32_TILES["ieee"][0].block_n < triton_config.GPU_FORWARD.block_n


def test_main_grad_accumulation():
    """With Megatron's gradient-accumulation fusion the weight gradient is added to main_grad."""
    hidden, weight, labels, g, e = make_case(18, 16, 50, seed=next_seed())
    w = weight.clone().requires_grad_(True)
    w.main_grad = torch.randn(w.shape, generator=generator(1)).to(DEVICE)
    before = w.main_grad.clone()
    logp, ent = fused_log_probs_and_entropy(
        hidden, w, labels, temperature=1.0, ignore_index=IGNORE_INDEX, backend=triton(), accumulate_into_main_grad=True
    )
    torch.autograd.backward([logp, ent], [g.to(DEVICE), e.to(DEVICE)])
    ref = reference(hidden.cpu(), weight.cpu(), labels.cpu(), 1.0, g, e)
    assert w.main_grad.dtype == torch.float32
    assert_close(
        (w.main_grad - before).cpu(),
        ref["d_weight"],
        name="main_grad",
        dtype=torch.float32,
        rtol=2e-5,
        terms=ref["d_weight_terms"],
    )


@pytest.fixture
def buffer_backwards(monkeypatch) -> list[int]:
    """One entry per backward that used the forward's probability buffer (no recompute)."""
    calls: list[int] = []
    original = triton_backend.gradients_from_buffer
    monkeypatch.setattr(
        triton_backend, "gradients_from_buffer", lambda backend, *a, **k: calls.append(1) or original(backend, *a, **k)
    )
    return calls


SIXTEEN_BIT_CASES = {
    # name: (dtype, n, v, ignored fraction, backward chunk in tiles or None)
    "bf16-v120-tma-stores": (torch.bfloat16, 26, 120, 0.3, None),
    "bf16-v117-pointer-stores": (torch.bfloat16, 26, 117, 0.3, None),
    "bf16-ragged-chunks-tma": (torch.bfloat16, 30, 152, 0.3, 2),
    "bf16-mostly-ignored": (torch.bfloat16, 40, 120, 0.9, None),
    "fp16-v120-tma-stores": (torch.float16, 26, 120, 0.3, None),
}


@pytest.mark.parametrize("buffer", [False, True], ids=["recompute", "buffer"])
@pytest.mark.parametrize("case", list(SIXTEEN_BIT_CASES))
def test_16bit_inputs_match_fp64(buffer_backwards, buffer, case):
    """bf16 / fp16 inputs (upcast after load in the interpreter): outputs fp32-exact, grads in
    the input dtype.

    With the copy engine on: dz tiles (and, with the buffer, its tiles) are stored by TMA when
    the row pitch allows it (V a multiple of 8) and through pointers otherwise (V = 117); TMA
    stores into the workspace view of several backward chunks, the last one ragged; whole row
    blocks past the valid count; the buffer's log2 from the bf16 bits (fp32 log2 for fp16).
    """
    dtype, n, v, ignored, chunk_tiles = SIXTEEN_BIT_CASES[case]
    settings = {"tma": True, "buffer_budget_bytes": (1 << 30) if buffer else 0}
    if chunk_tiles is not None:
        block_n = triton(**settings).backward_config.block_n
        if v <= 2 * chunk_tiles * block_n:  # CUDA's 256-column tiles: widen V past two chunks, still ragged
            v += 2 * chunk_tiles * block_n
        settings["workspace_bytes"] = n * 2 * chunk_tiles * block_n
        assert v > 2 * chunk_tiles * block_n and v % (chunk_tiles * block_n) != 0  # >2 chunks, ragged
    backend = triton(**settings)
    if chunk_tiles is not None and not buffer:
        assert backend.vocab_chunk(n, v, 2) == chunk_tiles * block_n
    hidden, weight, labels, g, e = make_case(n, 32, v, seed=next_seed(), dtype=dtype, ignored=ignored)
    labels[0] = 3  # at least one valid token
    logp, ent, dh, dw = run_head(hidden, weight, labels, 0.7, g, e, backend=backend)
    assert buffer_backwards == ([1] if buffer else [])
    ref = reference(hidden.cpu(), weight.cpu(), labels.cpu(), 0.7, g, e)
    assert dh.dtype == dw.dtype == dtype
    assert_close(logp.cpu(), ref["log_prob"], name="log_prob", dtype=dtype, rtol=2e-6, atol=1e-6)
    assert_close(ent.cpu(), ref["entropy"], name="entropy", dtype=dtype, rtol=2e-6, atol=1e-6)
    # dz is rounded to 16 bits before the d_hidden / d_W GEMMs, then the result once more.
    for name, got in (("d_hidden", dh), ("d_weight", dw)):
        assert_close(
            got.cpu(),
            ref[name],
            name=name,
            dtype=dtype,
            rtol=1e-2,
            elementwise_rtol=8e-3,
            terms=ref[f"{name}_terms"],
        )
    assert (dh[labels == IGNORE_INDEX] == 0).all()


def test_inf_in_ignored_rows_stays_out_of_gradients():
    """Padding rows full of inf (ignored labels) must not turn into 0·inf = NaN in d_W."""
    backend = triton(tma=True)
    hidden, weight, labels, g, e = make_case(21, 16, 40, seed=next_seed())
    ignored = labels == IGNORE_INDEX
    assert ignored.any()
    clean = check_against_reference(hidden, weight, labels, 0.8, g, e, backend=backend)
    padded = hidden.clone()
    padded[ignored] = float("inf")
    logp, _, dh, dw = run_head(padded, weight, labels, 0.8, g, e, backend=backend)
    assert torch.isfinite(dw).all() and torch.isfinite(dh).all()
    torch.testing.assert_close(dw, clean[3], rtol=0, atol=0)
    torch.testing.assert_close(logp, clean[0], rtol=0, atol=0)
    assert (dh[ignored] == 0).all()


def _label_pattern(name: str, n: int, block_m: int, gen: torch.Generator) -> torch.Tensor:
    """Which tokens are ignored, shaped like real batches: none, prompt/padding runs that cross
    row blocks, scattered tokens, a padded tail."""
    ignored = torch.zeros(n, dtype=torch.bool)
    if name == "prompt-runs":
        ignored[3:8] = True  # a short prompt, then a run longer than a block
        ignored[3 * block_m + 2 : 4 * block_m + 4] = True
    elif name == "scattered":
        ignored = torch.rand(n, generator=gen) < 0.2
    elif name == "padded-tail":
        ignored[n - block_m - 3 :] = True
    return ignored


@pytest.mark.parametrize("pattern", ["none-ignored", "prompt-runs", "scattered", "padded-tail"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-view"])
def test_blocks_of_consecutive_rows_read_in_place(pattern, strided):
    """Copy engine on: row blocks whose valid rows are consecutive in ``hidden`` are read in
    place, the others from the gathered copy; outputs and gradients equal the fp64 reference
    either way, for label patterns that make every block, some, or none direct; ignored rows
    full of inf stay out; a strided view of the hidden states (16-byte pitch) too."""
    backend = triton(tma=True)
    block_m = backend.forward_config.block_m
    n = 5 * block_m + 7  # a partial last block
    seed = next_seed()
    hidden, weight, labels, g, e = make_case(n, 32, 75, seed=seed, ignored=0.0)
    ignored = _label_pattern(pattern, n, block_m, generator(seed))
    labels[ignored] = IGNORE_INDEX
    clean = check_against_reference(hidden, weight, labels, 0.9, g, e, backend=backend)
    padded = hidden.clone()
    padded[ignored] = float("inf")
    if strided:
        wide = torch.full((n, 40), float("nan"), dtype=padded.dtype, device=padded.device)
        wide[:, :32] = padded
        padded = wide[:, :32]  # row pitch 40 elements (160 bytes), the rest NaN
    logp, ent, dh, dw = run_head(padded, weight, labels, 0.9, g, e, backend=backend)
    for got, want in zip((logp, ent, dh, dw), clean, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unaligned_hidden_is_gathered_whole():
    """Hidden states the copy engine cannot address in place (a view 4 bytes into its storage)
    take the gathered copy for every block, with the same results as an aligned copy."""
    backend = triton(tma=True)
    block_m = backend.forward_config.block_m
    n = 3 * block_m + 1
    hidden, weight, labels, g, e = make_case(n, 32, 60, seed=next_seed(), ignored=0.1)
    storage = torch.cat([torch.zeros(1, dtype=hidden.dtype), hidden.cpu().flatten()]).to(DEVICE)
    storage.requires_grad_(True)
    unaligned = storage[1:].view(n, 32)  # the head sees this view itself, not a copy of it
    assert not descriptor_ok(unaligned)
    want = run_head(hidden, weight, labels, 0.6, g, e, backend=backend)
    logp, ent = fused_log_probs_and_entropy(
        unaligned, weight.to(DEVICE), labels.to(DEVICE), temperature=0.6, backend=backend
    )
    torch.autograd.backward([logp, ent], [g.to(DEVICE), e.to(DEVICE)])
    torch.testing.assert_close(logp.detach(), want[0], rtol=0, atol=0)
    torch.testing.assert_close(ent.detach(), want[1], rtol=0, atol=0)
    torch.testing.assert_close(storage.grad[1:].view(n, 32), want[2], rtol=0, atol=0)


def test_gather_skips_exactly_the_blocks_read_in_place():
    """``gather_rows_kernel`` with a block size copies (or zeroes past the count) every row of a
    block that is not consecutive valid rows, and leaves the rows of the others untouched."""
    from mcore_ppo.kernels import gather_rows_kernel

    block_m, n, h = 4, 23, 8
    valid = torch.ones(n, dtype=torch.bool)
    valid[[5, 13, 14]] = False  # blocks 1 and 3 mix in a gap; block 5 is past the count
    hidden = torch.randn(n, h, generator=generator(next_seed())).to(DEVICE)
    perm, count = compact_rows(valid.to(DEVICE), Launcher().bound())
    dst = torch.full((n, h), -7.0, device=DEVICE)
    gather_rows_kernel[(n,)](hidden, perm, count, dst, n, h, hidden.stride(0), block_m, BLOCK_H=16)
    k = int(valid.sum())
    order = perm.cpu().tolist()
    for block in range(-(-n // block_m)):
        rows = range(block * block_m, min((block + 1) * block_m, n))
        direct = rows[-1] < k and len(rows) == block_m and order[rows[-1]] - order[rows[0]] == block_m - 1
        for r in rows:
            want = torch.full((h,), -7.0) if direct else (hidden[order[r]].cpu() if r < k else torch.zeros(h))
            assert torch.equal(dst[r].cpu(), want), (block, r, direct)
    skipped = sum(
        1
        for b in range(n // block_m)
        if (b + 1) * block_m <= k and order[(b + 1) * block_m - 1] - order[b * block_m] == block_m - 1
    )
    assert 0 < skipped < n // block_m  # the case has both kinds of block


@pytest.mark.parametrize("n", [57, 9001], ids=["one-step", "three-steps"])
def test_compact_rows(n):
    """Valid rows first, in order, then the ignored ones; over several of the kernel's steps too."""
    gen = generator(next_seed())
    valid = torch.rand(n, generator=gen) < 0.6
    perm, count = compact_rows(valid.to(DEVICE), Launcher().bound())
    k = int(valid.sum())
    assert count.tolist() == [k] and count.dtype == torch.int32
    assert perm[:k].tolist() == torch.nonzero(valid).flatten().tolist()
    assert perm[k:].tolist() == torch.nonzero(~valid).flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_products_match_an_fp32_upcast(dtype):
    """``mm_fp32`` (a new fp32 result) and ``addmm_fp32`` (added into one) give the product of
    the fp32-upcast operands, the first as if added into zeros."""
    from mcore_ppo.backends import fp32_gemms

    gen = generator(next_seed())
    a = torch.randn(7, 33, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(33, 5, generator=gen).to(dtype).to(DEVICE)
    want = a.float() @ b.float()
    got = fp32_gemms.mm_fp32(a, b)
    assert got.dtype == torch.float32 and got.shape == (7, 5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    acc = torch.ones(7, 5, device=DEVICE)
    fp32_gemms.addmm_fp32(acc, a, b)
    torch.testing.assert_close(acc, want + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["recompute-chunks", "buffer", "fp64-reference"])
def test_unset_weight_grad_is_written_whole(monkeypatch, buffer_backwards, path):
    """The Function hands this backend ``d_W`` unfilled (``torch.empty``): every row must be
    written, in the recompute path's vocab chunks (last one ragged), in the buffer's one GEMM and
    in the fp64 fallback (which adds, so it zero-fills first). The buffer starts as NaN here."""
    made = nan_filled_unset_buffers(monkeypatch)
    block_n = triton().backward_config.block_n
    dtype = torch.float64 if path == "fp64-reference" else torch.float32
    settings = {}
    if path == "recompute-chunks":
        settings["workspace_bytes"] = 30 * 4 * 2 * block_n
    if path == "buffer":
        settings["buffer_budget_bytes"] = 1 << 30
    backend = triton(**settings)
    hidden, weight, labels, g, e = make_case(30, 16, 4 * block_n + 22, seed=next_seed(), dtype=dtype)
    tolerances = {"rtol": 1e-12, "grad_rtol": 1e-10} if dtype == torch.float64 else {}
    check_against_reference(hidden, weight, labels, 0.6, g, e, backend=backend, **tolerances)
    assert made == [True]
    assert buffer_backwards == ([1] if path == "buffer" else [])


def test_fp64_falls_back_to_reference():
    hidden, weight, labels, g, e = make_case(12, 8, 30, seed=next_seed(), dtype=torch.float64)
    check_against_reference(hidden, weight, labels, 1.0, g, e, rtol=1e-12, grad_rtol=1e-10)


def test_tma_operands():
    """The copy-engine path (rows gathered first, descriptors; zero-filled edges) is exact too."""
    backend = triton(tma=True)
    hidden, weight, labels, g, e = make_case(37, 28, 151, seed=next_seed())
    assert backend.forward_config.use_tma and backend.backward_config.use_tma
    check_against_reference(hidden, weight, labels, 0.7, g, e, backend=backend)


@pytest.mark.parametrize("which", ["both", "log_prob"])
def test_buffer_mode(buffer_backwards, which):
    """With a budget, the forward keeps 2^(z - tile max) and the backward skips the recompute."""
    hidden, weight, labels, g, e = make_case(29, 24, 130, seed=next_seed())
    if which == "log_prob":
        e = None
    check_against_reference(hidden, weight, labels, 0.7, g, e, backend=triton(buffer_budget_bytes=1 << 30))
    assert buffer_backwards == [1]


def test_buffer_not_kept_without_grad(monkeypatch):
    hidden, weight, labels, _, _ = make_case(9, 16, 40, seed=next_seed())
    backend = triton(buffer_budget_bytes=1 << 30)
    forwards = []  # (grad_needed, residual) of every forward: the backend keeps nothing itself
    head_forward = backend.head_forward

    def spied_forward(*args, grad_needed, **kwargs):
        out = head_forward(*args, grad_needed=grad_needed, **kwargs)
        forwards.append((grad_needed, out.saved.residual))
        return out

    monkeypatch.setattr(backend, "head_forward", spied_forward)
    with torch.no_grad():
        fused_log_probs_and_entropy(hidden.requires_grad_(True), weight, labels, backend=backend)
    ((grad_needed, residual),) = forwards
    assert grad_needed is False and residual == ()


def _other_shard_combine(other, statistics: Statistics, log: list[str]):
    """A ``combine`` for :meth:`TritonBackend.head_forward` that stands for a TP group of two:
    the other rank's statistics ``other`` (``shard_statistics`` of its shard) are folded in by
    torch ops (:meth:`Statistics.rescale`) where the collectives would add them, in the order
    :func:`~mcore_ppo.parallel.combine.reduce_shard_statistics` runs them (``log`` records it)."""

    def combine(shard_max, sums_relative_to):
        log.append("max")
        shard_max.copy_(torch.maximum(shard_max, other.m))  # the all-reduce MAX
        summed = sums_relative_to(shard_max)
        log.append("sum")
        # the all-reduce SUM (the packed planes: y, then the terms)
        summed += torch.cat([other.y[None], statistics.rescale(other.m, other.sums, shard_max)])
        return shard_max, summed

    return combine


# Several vocab splits per shard (the interpreter's splits are 128 columns, a GPU's wider).
_SPLIT_SHAPE = (300, 64, 4000) if DEVICE.type == "cuda" else (37, 16, 300)


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("with_q", [False, True], ids=["", "sum-pi-squared"])
@pytest.mark.parametrize("grad_needed", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("shape", [(37, 16, 40), _SPLIT_SHAPE], ids=["small", "splits"])
def test_tp_branch_over_two_shards_equals_the_whole_vocab(with_entropy, with_q, grad_needed, shape):
    """The TP branch of ``head_forward`` (the shard's max, the merge to the group's max, the
    caller's combine between them, ``finish_kernel``) on the first of two vocab shards, the
    second's statistics folded in where the collectives would add them: the one-shard forward
    over the whole vocab, and fp64, with ignored tokens, out-of-range labels and labels on both
    shards. The two shards' maxima differ per token, so the rescale to the group's max is exercised."""
    hidden, weight, labels, _, _ = make_case(*shape, seed=next_seed(), scale=2.0)
    labels[1], labels[2] = weight.shape[0] + 3, -7  # out of range: NaN log-probs
    vocab, split = weight.shape[0], weight.shape[0] // 2 + 3
    backend = triton(buffer_budget_bytes=1 << 30)  # the buffer where a gradient is needed
    statistics = Statistics.named([*(["entropy"] if with_entropy else []), *(["sum_pi_squared"] if with_q else [])])
    kw = {"ignore_index": IGNORE_INDEX, "vocab_size": vocab, "labels_in_range": False, "grad_needed": grad_needed,
          "statistics": statistics, "max_entropy": float(torch.tensor(vocab).log())}  # fmt: skip
    valid = labels != IGNORE_INDEX
    local = labels - split
    local = torch.where(valid & (local >= 0) & (local < vocab - split), local, -1)
    log: list[str] = []
    with torch.no_grad():
        other = backend.shard_statistics(
            hidden, weight[split:], local, valid, 0.9, grad_needed=False, statistics=statistics
        )
        combine = _other_shard_combine(other, statistics, log)
        tp = backend.head_forward(hidden, weight[:split], labels, 0.9, vocab_start=0, combine=combine, **kw)
        whole = backend.head_forward(hidden, weight, labels, 0.9, vocab_start=0, combine=None, **kw)
    assert log == ["max", "sum"]
    close = {"rtol": 2e-6, "atol": 2e-6, "equal_nan": True}
    torch.testing.assert_close(tp.log_prob, whole.log_prob, **close)
    assert torch.equal(tp.log_prob.isnan(), valid & ((labels < 0) | (labels >= vocab)))
    outputs = [("entropy", tp.entropy, whole.entropy), ("detached", tp.detached, whole.detached)]
    if grad_needed:
        outputs += [("lse", tp.saved.lse, whole.saved.lse), ("saved entropy", tp.saved.entropy, whole.saved.entropy)]
    for name, got, want in outputs:
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, **close, msg=lambda m, name=name: f"{name}: {m}")
    if grad_needed:
        assert torch.equal(tp.saved.lse[~valid], torch.zeros_like(tp.saved.lse[~valid]))
    # fp64 over the whole vocab, at the valid in-range tokens
    logits = (hidden.double() @ weight.double().T).cpu() / 0.9
    labels, valid = labels.cpu(), valid.cpu()
    lse = logits.logsumexp(-1)
    ok = valid & (labels >= 0) & (labels < vocab)
    want_lp = logits.gather(1, labels.clamp(0, vocab - 1)[:, None])[:, 0] - lse
    torch.testing.assert_close(tp.log_prob.cpu()[ok].double(), want_lp[ok], rtol=0, atol=1e-5)
    probs = logits.softmax(-1)
    if with_entropy:
        want_h = -(probs * (logits - lse[:, None])).sum(-1)
        torch.testing.assert_close(tp.entropy.cpu()[valid].double(), want_h[valid], rtol=0, atol=1e-5)
    if with_q:
        want_q = (probs**2).sum(-1)
        got_q = tp.detached[statistics.detached_names.index("sum_pi_squared")]
        torch.testing.assert_close(got_q.cpu()[valid].double(), want_q[valid], rtol=0, atol=1e-5)
    in_first = valid & (labels >= 0) & (labels < split)
    assert torch.equal(tp.saved.local_labels.cpu(), torch.where(in_first, labels, -1))
