"""The Triton kernels on a GPU at the benchmark's full shapes, against float64 (marked ``gpu``).

Run on the lent H200 (``pytest tests/gpu -m gpu``); skipped without CUDA. Errors are
norm-wise relative (‖out − ref‖₂ / ‖ref‖₂) against an fp64 reference computed on the GPU
from the same bf16 inputs, all tokens, row chunk by row chunk.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo_testing.reference import normwise_relative_error, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N_TOKENS = 16384
GIB = 2**30


def fp64_reference(x, w, labels, g, e, temperature, chunk=2048):
    """``(log_prob, entropy, d_hidden, d_weight)`` in fp64, on the GPU, row chunk by chunk."""
    ref = reference(x, w, labels, temperature, g, e, rows_per_chunk=chunk, with_terms=False)
    return ref["log_prob"], ref["entropy"], ref["d_hidden"], ref["d_weight"]


rel = normwise_relative_error


def make(n, h, v, dtype=torch.bfloat16, ignored=0.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if ignored:
        labels[torch.rand(n, device="cuda", generator=gen) < ignored] = -100
    g = torch.randn(n, device="cuda", generator=gen)
    e = torch.randn(n, device="cuda", generator=gen)
    return x, w, labels, g, e


@pytest.fixture(autouse=True)
def no_budget_from_the_environment(monkeypatch):
    """``backend="triton"`` by name builds its budget from the environment: the default here."""
    monkeypatch.delenv("MCORE_PPO_BUFFER_BUDGET_BYTES", raising=False)


def triton(*, tma: bool = True, shard: int | None = None, **settings):
    """A triton backend built with ``settings`` (:class:`TritonConfig` fields): the recompute
    path unless a budget is given (the default budget would pick the buffer at the small
    shards). ``tma=False``: gathered pointer loads instead of the copy engine (the GPU default),
    with the default's forward tiles for a shard of ``shard`` rows."""
    from dataclasses import replace

    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig
    from mcore_ppo.backends.triton_config import GPU_BACKWARD

    settings.setdefault("buffer_budget_bytes", 0)
    if not tma:
        forward = TritonBackend().forward_config_for(shard)
        settings["forward_config"] = replace(forward, use_tma=False)
        settings["backward_config"] = replace(GPU_BACKWARD, use_tma=False)
    backend = TritonBackend(TritonConfig(**settings))
    assert backend.forward_config.use_tma == tma and backend.backward_config.use_tma == tma
    return backend


@pytest.fixture(params=[False, True], ids=["pointer", "tma"])
def use_tma(request):
    """Both operand paths of the kernels: gathered pointer loads and the copy engine."""
    return request.param


def run(x, w, labels, g, e, temperature, backend=None):
    """Forward and backward through the API (``backend`` None: :func:`triton`'s default)."""
    from mcore_ppo import fused_log_probs_and_entropy

    backend = triton() if backend is None else backend
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(xg, wg, labels, temperature=temperature, backend=backend)
    torch.autograd.backward([logp, ent], [g, e])
    return logp.detach(), ent.detach(), xg.grad, wg.grad


@pytest.mark.gpu_heavy  # peaks of 9 GiB and more: the card to itself
@pytest.mark.parametrize(
    ("h", "v", "ignored"),
    [(3584, 152064, 0.0), (3584, 38016, 0.3), (4096, 16032, 0.0), (4096, 64128, 0.5)],
    ids=["qwen7b-tp1", "qwen7b-tp4-ignored", "llama8b-tp8", "llama8b-tp2-half-ignored"],
)
def test_full_shape_vs_fp64(h, v, ignored, use_tma):
    temperature = 0.7
    x, w, labels, g, e = make(N_TOKENS, h, v, ignored=ignored)
    logp, ent, dh, dw = run(x, w, labels, g, e, temperature, triton(tma=use_tma, shard=v))
    ref = fp64_reference(x, w, labels, g, e, temperature)
    valid = labels != -100
    errs = {
        "log_prob": rel(logp[valid], ref[0][valid]),
        "entropy": rel(ent[valid], ref[1][valid]),
        "d_hidden": rel(dh, ref[2]),
        "d_weight": rel(dw, ref[3]),
    }
    print(f"h={h} V={v} ignored={ignored} tma={use_tma}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert errs["log_prob"] <= 1e-5 and errs["entropy"] <= 1e-5
    assert errs["d_hidden"] <= 5e-3 and errs["d_weight"] <= 5e-3
    assert (logp[~valid] == 0).all() and (dh[~valid] == 0).all()


def test_fp32_inputs_odd_shape(use_tma):
    x, w, labels, g, e = make(777, 1000, 5003, dtype=torch.float32, ignored=0.2, seed=1)
    logp, ent, dh, dw = run(x, w, labels, g, e, 1.3, triton(tma=use_tma, shard=5003, ieee_gemms="kernels"))
    ref = fp64_reference(x, w, labels, g, e, 1.3)
    assert rel(logp, ref[0]) <= 1e-6 and rel(ent, ref[1]) <= 1e-6
    assert rel(dh, ref[2]) <= 1e-5 and rel(dw, ref[3]) <= 1e-5


def test_matches_torch_backend():
    x, w, labels, g, e = make(1024, 512, 9000, ignored=0.25, seed=2)
    ours = run(x, w, labels, g, e, 0.9)
    theirs = run(x, w, labels, g, e, 0.9, backend="torch")
    assert rel(ours[0], theirs[0]) <= 2e-6 and rel(ours[1], theirs[1]) <= 2e-6
    assert rel(ours[2], theirs[2]) <= 5e-3 and rel(ours[3], theirs[3]) <= 5e-3


def test_all_ignored(use_tma):
    x, w, labels, g, e = make(300, 256, 1000, ignored=1.0, seed=3)
    for t in run(x, w, labels, g, e, 1.0, triton(tma=use_tma, shard=1000)):
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.gpu_heavy  # peaks of 9 GiB and more: the card to itself
@pytest.mark.parametrize(("h", "v"), [(3584, 152064), (4096, 128256)], ids=["qwen7b", "llama3-8b"])
def test_no_grad_forward_keeps_nothing_and_memory_budget(h, v):
    from mcore_ppo import fused_log_probs_and_entropy

    x, w, labels, g, e = make(N_TOKENS, h, v, seed=4)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        logp, ent = fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend="triton")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base == logp.numel() * 4 + ent.numel() * 4
    del logp, ent
    # One step first: what a process allocates once (cuBLAS's workspace, ~32 MiB on Hopper, on its
    # first GEMM) is not the head's, and whether this test is a worker's first GEMM varies.
    run(x, w, labels, g, e, 0.7)  # its outputs are freed at once
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(x, w, labels, g, e, 0.7)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    grads = (x.numel() + w.numel()) * 2 / GIB
    print(f"peak extra {peak:.3f} GiB, output grads {grads:.3f} GiB")
    assert peak <= grads + 0.5


def test_main_grad_fp32():
    from mcore_ppo import fused_log_probs_and_entropy

    x, w, labels, g, e = make(2048, 1024, 20000, seed=5)
    wg = w.detach().requires_grad_(True)
    wg.main_grad = torch.randn(w.shape, device="cuda")
    before = wg.main_grad.clone()
    logp, ent = fused_log_probs_and_entropy(
        x, wg, labels, temperature=0.7, ignore_index=-100, backend=triton(), accumulate_into_main_grad=True
    )
    torch.autograd.backward([logp, ent], [g, e])
    ref = fp64_reference(x, w, labels, g, e, 0.7)
    assert rel(wg.main_grad - before, ref[3]) <= 5e-3


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
def test_cuda_graph_capture(use_tma, budget):
    """No host synchronisation: the forward statistics and the backward capture in a CUDA graph
    (with the buffer too: the forward keeps it, the backward consumes it, inside the graph)."""
    from mcore_ppo.backends.base import GradientRequest, SavedTokens
    from mcore_ppo.statistics import DEFAULT

    x, w, labels, g, e = make(2048, 1024, 20000, ignored=0.3, seed=6)
    valid = labels != -100
    local = torch.where(valid, labels, -1)
    backend = triton(tma=use_tma, shard=20000, buffer_budget_bytes=budget)
    lse, ent = torch.rand(2048, device="cuda") + 5, torch.rand(2048, device="cuda")

    def statistics():
        return backend.shard_statistics(x, w, local, valid, 0.7, grad_needed=True, statistics=DEFAULT)

    def gradients(stats):  # consumes the forward's buffer, if it kept one
        saved = SavedTokens(local, valid, lse, ent, stats.residual)
        request = GradientRequest(g, e, need_hidden_grad=True, weight_grad=torch.zeros_like(w))
        return backend.shard_gradients(x, w, saved, request, temperature=0.7)

    eager = statistics()
    gradients(eager)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stats = statistics()
        grads = gradients(stats)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((stats.m, stats.sums, stats.y), (eager.m, eager.sums, eager.y), strict=True):
        assert torch.equal(a[..., valid], b[..., valid])
    eager_grads = gradients(statistics())  # eagerly again: the same path (buffer kept or not)
    assert torch.equal(grads[0], eager_grads[0]) and torch.equal(grads[1], eager_grads[1])


@pytest.mark.gpu_heavy  # peaks of 9 GiB and more: the card to itself
@pytest.mark.parametrize(("h", "v"), [(3584, 152064), (3584, 19008)], ids=["qwen7b-tp1", "qwen7b-tp8"])
def test_buffer_mode_full_shape(h, v, monkeypatch):
    """The budgeted bf16 probability buffer (no recompute) at full shapes vs fp64."""
    from mcore_ppo.backends import triton_backend as tb

    backward = []  # the backward takes the buffer (no recompute)
    original = tb.gradients_from_buffer
    monkeypatch.setattr(tb, "gradients_from_buffer", lambda *a, **k: backward.append(1) or original(*a, **k))
    x, w, labels, g, e = make(N_TOKENS, h, v, ignored=0.25, seed=7)
    logp, ent, dh, dw = run(x, w, labels, g, e, 0.7, triton(buffer_budget_bytes=1 << 40))
    assert backward == [1]
    ref = fp64_reference(x, w, labels, g, e, 0.7)
    valid = labels != -100
    errs = [rel(logp[valid], ref[0][valid]), rel(ent[valid], ref[1][valid]), rel(dh, ref[2]), rel(dw, ref[3])]
    print(f"buffer mode h={h} V={v}: " + ", ".join(f"{x:.2e}" for x in errs))
    assert errs[0] <= 1e-5 and errs[1] <= 1e-5 and errs[2] <= 5e-3 and errs[3] <= 5e-3


@pytest.mark.parametrize("buffer", [False, True], ids=["recompute", "buffer"])
def test_inf_padding_in_ignored_rows(buffer):
    """Ignored rows full of inf (padding) change nothing: no 0·inf = NaN in d_W, same outputs."""
    backend = triton(buffer_budget_bytes=(1 << 40) if buffer else 0)
    x, w, labels, g, e = make(4096, 1024, 30016, ignored=0.3, seed=8)
    clean = run(x, w, labels, g, e, 0.7, backend)
    padded = x.clone()
    padded[labels == -100] = float("inf")
    dirty = run(padded, w, labels, g, e, 0.7, backend)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.isfinite(b).all() and torch.equal(a, b)
