"""The triton backend's kept-kernel launches and fused forward on a GPU (marked ``gpu``; skipped without CUDA).

:mod:`mcore_ppo.backends.triton_launch` launches a call site through Triton's ``kernel[grid]``
the first time it is seen on a device and through the ``CompiledKernel`` that call returned
afterwards (its runner, ``compiled[grid]``). These tests check, at a few shapes and with the key
changing between calls (token count, a misaligned ``hidden``, the dtype), that the kept-kernel
path gives the normal path's (a backend with ``kept_kernels=False``) outputs and gradients bit
for bit, with every site launch checked against Triton's own dispatch
(:class:`~mcore_ppo_testing.launch_checks.CheckedLauncher`: ``kernel.warmup`` must return the
kept kernel); that the check catches a site key coarser than Triton's; that launch hooks
(profilers) see the kept-kernel launches; that the fused forward (``head_forward``) gives the
generic path's bit for bit, and both the fp64 reference. One test prints the host time per
launch of both paths (host descriptors included: Triton's launcher encodes them per launch).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from mcore_ppo_testing.reference import normwise_relative_error as rel
from mcore_ppo_testing.reference import reference

try:  # importable (and collected, then skipped) where triton is missing
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _make(n, h, v, dtype=torch.bfloat16, ignored=0.0, seed=0, offset=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # ``offset`` elements into a larger buffer: a hidden whose rows are not 16-byte aligned.
    base = torch.randn(n * h + offset, device="cuda", generator=gen).to(dtype)
    x = base[offset:].view(n, h)
    w = (torch.randn(v, h, device="cuda", generator=gen) * (2 / math.sqrt(h))).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if ignored:
        labels[torch.rand(n, device="cuda", generator=gen) < ignored] = -100
    g = torch.randn(n, device="cuda", generator=gen)
    e = torch.randn(n, device="cuda", generator=gen)
    return x, w, labels, g, e


def _run(backend, x, w, labels, g, e, temperature=0.7, validate=False):
    from mcore_ppo import fused_log_probs_and_entropy

    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(xg, wg, labels, temperature=temperature, backend=backend, validate=validate)
    torch.autograd.backward([logp, ent], [g, e])
    with torch.no_grad():
        nograd = fused_log_probs_and_entropy(x, w, labels, temperature=temperature, backend=backend, validate=validate)
    return logp.detach(), ent.detach(), xg.grad, wg.grad, *nograd


NAMES = ("log_prob", "entropy", "d_hidden", "d_weight", "nograd log_prob", "nograd entropy")


def _assert_bitwise(a, b, what):
    for name, x, y in zip(NAMES, a, b, strict=True):
        assert torch.equal(x, y), f"{what}: {name} differs (max {(x.float() - y.float()).abs().max().item():.3e})"


# (n, h, v, dtype, ignored, offset, budget, workspace): the key changes from one case to the
# next (token count, alignment of hidden, dtype, buffer or recompute, vocab chunks).
CASES = [
    (4096, 3584, 19008, torch.bfloat16, 0.0, 0, 1 << 40, None),
    (4093, 3584, 19008, torch.bfloat16, 0.3, 0, 1 << 40, None),
    (4093, 3584, 19008, torch.bfloat16, 0.3, 3, 0, None),
    (4093, 3584, 19008, torch.bfloat16, 0.3, 0, 0, 4093 * 2 * 4096),  # five recompute chunks
    (1001, 1000, 5003, torch.float32, 0.2, 0, 0, None),
]


def test_fast_path_equals_normal_path_and_fp64():
    from mcore_ppo.kernels import stats_kernel, tokens_kernel
    from mcore_ppo_testing.launch_checks import CheckedLauncher

    # Every site launch is checked against Triton's dispatch as the shapes change.
    launcher = CheckedLauncher()
    assert launcher.fast()
    _fast_path_cases(launcher)
    levels = {**launcher.fast_level(stats_kernel), **launcher.fast_level(tokens_kernel)}
    print("kept-kernel levels:", sorted(set(levels.values())), "triton", __import__("triton").__version__)
    assert len(launcher.fast_level(stats_kernel)) >= 3  # dtypes, alignment, buffer: several sites
    assert set(levels.values()) == {"compiled"}


def _fast_path_cases(launcher):
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig

    for n, h, v, dtype, ignored, offset, budget, workspace in CASES:
        chunks = {} if workspace is None else {"workspace_bytes": workspace}
        # fp32 operands through the kernels' own IEEE dots (the default takes cuBLAS's).
        config = TritonConfig(buffer_budget_bytes=budget, ieee_gemms="kernels", **chunks)
        backend = TritonBackend(config, launcher=launcher)
        x, w, labels, g, e = _make(n, h, v, dtype, ignored, seed=n + offset, offset=offset)
        normal = _run(TritonBackend(replace(config, kept_kernels=False)), x, w, labels, g, e)
        before = launcher.launches
        first = _run(backend, x, w, labels, g, e)  # new sites: kernel[grid] once (compiling new variants)
        per_call = launcher.launches - before
        fast = _run(backend, x, w, labels, g, e)  # every site seen: the kept compiled kernels
        assert launcher.launches - before == 2 * per_call
        case = f"n={n} h={h} v={v} {dtype} ignored={ignored} offset={offset} budget={budget} workspace={workspace}"
        _assert_bitwise(first, normal, f"{case}, first call")
        _assert_bitwise(fast, normal, f"{case}, fast path")
        ref = reference(x.double(), w.double(), labels, 0.7, g.double(), e.double(), rows_per_chunk=1024)
        valid = labels != -100
        tol = 1e-5 if dtype == torch.bfloat16 else 1e-6
        gtol = 5e-3 if dtype == torch.bfloat16 else 1e-5
        assert rel(fast[0][valid], ref["log_prob"][valid]) <= tol
        assert rel(fast[1][valid], ref["entropy"][valid]) <= tol
        assert rel(fast[2], ref["d_hidden"]) <= gtol and rel(fast[3], ref["d_weight"]) <= gtol
        assert (fast[0][~valid] == 0).all() and (fast[2][~valid] == 0).all()


def scale_fn(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask) * scale
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=mask)


def desc_copy_fn(src_desc, dst_desc, BM: tl.constexpr, BN: tl.constexpr):
    tile = src_desc.load([tl.program_id(0) * BM, tl.program_id(1) * BN])
    dst_desc.store([tl.program_id(0) * BM, tl.program_id(1) * BN], tile)


def _jit(fn, **options):
    import triton

    return triton.jit(**options)(fn)  # a new JITFunction: its own compiled-kernel cache


def test_kept_kernel_is_tritons_choice_and_the_check_catches_a_coarse_site():
    from mcore_ppo_testing.launch_checks import CheckedLauncher, SiteKeyError

    kernel = _jit(scale_fn)
    x = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    launcher = CheckedLauncher()
    for n in (1024, 2048, 4096):  # all multiples of 16: one specialisation
        launcher.launch(kernel, (n // 256,), (x, out, n, 0.5), {"BLOCK": 256, "SQUARE": True}, "site")
        torch.testing.assert_close(out[:n], (x[:n] * 0.5) ** 2)
    assert set(launcher.fast_level(kernel).values()) == {"compiled"}
    with pytest.raises(SiteKeyError):  # 1000 is not: Triton picks another variant
        launcher.launch(kernel, (4,), (x, out, 1000, 0.5), {"BLOCK": 256, "SQUARE": True}, "site")
    with pytest.raises(SiteKeyError):  # nor is a misaligned pointer
        launcher.launch(kernel, (4,), (x[1:], out, 1024, 0.5), {"BLOCK": 256, "SQUARE": True}, "site")
    torch.cuda.synchronize()


def test_launch_hooks_see_the_kept_kernel_launches():
    """Profilers hook Triton's launches (``knobs.runtime.launch_enter_hook``): the kept-kernel
    path goes through ``CompiledKernel.__getitem__``, which calls them."""
    import triton.knobs

    from mcore_ppo.backends.triton_launch import Launcher

    launcher = Launcher()
    kernel = _jit(scale_fn)
    x = torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            launcher.launch(kernel, (4,), (x, out, 1024, 2.0), {"BLOCK": 256}, "hooked")
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert launcher.fast_level(kernel) == {(torch.cuda.current_device(), "hooked"): "compiled"}
    assert len(seen) == 3 and all("scale_fn" in name for name in seen), seen  # the first launch and two kept
    torch.testing.assert_close(out, x * 2.0)


def _host_us(fn, calls):
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the GPU busy: launches queue, the host time alone is measured
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _caller(launch, kernel, grid, args, kwargs, site):
    return lambda: launch(kernel, grid, args(), kwargs, site)


def device_desc_copy_fn(src_ptr, dst_ptr, n, BM: tl.constexpr, BN: tl.constexpr):
    src = tl.make_tensor_descriptor(src_ptr, [n, n], [n, 1], [BM, BN])
    dst = tl.make_tensor_descriptor(dst_ptr, [n, n], [n, 1], [BM, BN])
    dst.store([tl.program_id(0) * BM, tl.program_id(1) * BN], src.load([tl.program_id(0) * BM, tl.program_id(1) * BN]))


def test_host_time_per_launch_kept_kernel_vs_normal():
    """Host microseconds per launch of the normal path and of the kept kernel, for a pointer
    kernel, a kernel of two host TMA descriptors (encoded per launch by Triton's launcher) and
    one that builds its two descriptors itself (a scratch allocation per launch). Printed for
    the GPU report, not asserted (a loaded host would make it flake); asserted: each site ran on
    the kept compiled kernel, and both paths computed the same."""
    from mcore_ppo.backends.triton_launch import Launcher, host_descriptor

    scale = _jit(scale_fn)
    x = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    copy = _jit(desc_copy_fn)
    device_copy = _jit(device_desc_copy_fn)
    src = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst2 = torch.empty_like(src)
    cases = {
        "pointers": (scale, (16,), lambda: (x, out, 4096, 0.5), {"BLOCK": 256}),
        "2 host tma descriptors": (
            copy, (4, 4), lambda: (host_descriptor(src, (64, 64)), host_descriptor(dst, (64, 64))),
            {"BM": 64, "BN": 64},
        ),
        "2 in-kernel tma descriptors": (device_copy, (4, 4), lambda: (src, dst2, 256), {"BM": 64, "BN": 64}),
    }  # fmt: skip
    kept_launcher, normal_launcher = Launcher(), Launcher(kept=False)
    for name, (kernel, grid, args, kwargs) in cases.items():
        site = ("host-time", name)
        kept_launch, normal_launch = kept_launcher.bound(), normal_launcher.bound()
        kept_launch(kernel, grid, args(), kwargs, site)  # compiled and kept
        kept = _host_us(_caller(kept_launch, kernel, grid, args, kwargs, site), 500)
        normal = _host_us(_caller(normal_launch, kernel, grid, args, kwargs, site), 500)
        print(f"host us per launch, {name}: kept kernel {kept:.1f}, kernel[grid] {normal:.1f}")
        assert set(kept_launcher.fast_level(kernel).values()) == {"compiled"}, name
    torch.testing.assert_close(dst, src)
    torch.testing.assert_close(dst2, src)


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
def test_fused_forward_equals_generic_path(budget, monkeypatch):
    """``head_forward`` (labels and epilogue in the kernels, libdevice's log) against the
    Function's generic path (torch ops around ``shard_statistics``, ``fused_forward=False``):
    bit for bit."""
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig

    x, w, labels, g, e = _make(3000, 3584, 19008, ignored=0.3, seed=5)
    labels[7], labels[11] = 19008 + 5, -3  # out of range with validate=False: NaN log-probs
    heads = []  # fused_forward of the backend of every head_forward that runs
    original = TritonBackend.head_forward

    def head_forward(self, *args, **kwargs):
        heads.append(self.capabilities.fused_forward)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, "head_forward", head_forward)
    fused = _run(TritonBackend(TritonConfig(buffer_budget_bytes=budget)), x, w, labels, g, e)
    generic = _run(TritonBackend(TritonConfig(buffer_budget_bytes=budget, fused_forward=False)), x, w, labels, g, e)
    assert heads == [True, True]  # the fused backend's forward with grad and without; never the generic one's
    for name, a, b in zip(NAMES, fused, generic, strict=True):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: {(a - b).nan_to_num().abs().max().item():.3e}"
    assert fused[0][[7, 11]].isnan().all()


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["recompute", "buffer"])
def test_cuda_graph_capture_of_fused_forward_and_backward(budget):
    """No host synchronisation on the fast path: ``head_forward`` and the backward capture in a
    CUDA graph, and its replay equals the eager calls."""
    from mcore_ppo.backends.base import GradientRequest
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig
    from mcore_ppo.statistics import DEFAULT

    x, w, labels, g, e = _make(2048, 1024, 20000, ignored=0.3, seed=6)
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=budget))
    kw = {"ignore_index": -100, "vocab_start": 0, "vocab_size": 20000, "labels_in_range": False}

    def step():
        out = backend.head_forward(
            x, w, labels, 0.7, grad_needed=True, statistics=DEFAULT, max_entropy=math.log(20000) - 1e-6,
            combine=None, **kw,
        )  # fmt: skip
        request = GradientRequest(g, e, need_hidden_grad=True, weight_grad=torch.zeros_like(w))
        grads = backend.shard_gradients(x, w, out.saved, request, temperature=0.7)
        return out.log_prob, out.entropy, *grads

    eager = step()
    step()  # every key seen: the capture runs the fast path
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)
