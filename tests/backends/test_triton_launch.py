"""The launch module's paths, on CPU: stand-in kernels for the kept-kernel path, the interpreter for the rest.

:mod:`mcore_ppo.backends.triton_launch` launches a site's first call through ``kernel[grid]``
and later ones through the runner of the kept ``CompiledKernel`` (its ``__getitem__``, once per
grid). Without a GPU there is no compiled kernel, so the kept-kernel path runs here on
stand-ins: a kernel whose ``params`` are a real ``JITFunction``'s (Triton's own parameter
objects), a ``CompiledKernel`` subclass that records its launches, and a driver that names the
device and stream. The normal path and the site checks of
:class:`mcore_ppo_testing.launch_checks.CheckedLauncher` run real kernels in Triton's
interpreter. One test reads the module's source: it may reach nothing private of Triton's.
"""

from __future__ import annotations

import ast
import contextvars
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from mcore_ppo import logs  # noqa: E402
from mcore_ppo.backends import triton_launch  # noqa: E402
from mcore_ppo.backends.triton_launch import Launcher, host_descriptor  # noqa: E402
from mcore_ppo_testing.launch_checks import CheckedLauncher, SiteKeyError  # noqa: E402


def scale_fn(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask) * scale
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=mask)


def desc_copy_fn(src_desc, out_ptr, stride, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    tile = src_desc.load([tl.program_id(0) * BM, 0])
    tl.store(out_ptr + rows[:, None] * stride + tl.arange(0, BN)[None, :], tile)


# Decorated while the interpreter is on (on CPU): what the backend's kernels are here.
scale_kernel = triton.jit(scale_fn)
n_free_scale_kernel = triton.jit(do_not_specialize=["n"])(scale_fn)
desc_copy_kernel = triton.jit(desc_copy_fn)

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]  # the rest of the suite never sees it

INTERPRETED = not torch.cuda.is_available()


@pytest.fixture
def interpreter(monkeypatch):
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------------------------
# Stand-ins for the kept-kernel path


class Compiled(CompiledKernel):
    """A ``CompiledKernel`` (so the launcher keeps it) that records its launches: ``run`` as
    Triton's dispatch calls it, and ``self[grid](*args, stream=)`` with each grid it made a
    runner for (``hooked`` lists the launches that came through a runner)."""

    function = "cu_function"
    packed_metadata = (4, 1, 0)

    def __init__(self, name: str = "compiled"):  # no binary to load: none of the base's state
        self.name = name
        self.calls: list[tuple] = []
        self.runners: list[tuple] = []
        self.hooked: list[tuple] = []

    def run(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, metadata, enter, exit_, *args):
        assert (function, packed_metadata) == (self.function, self.packed_metadata)
        assert metadata is None and enter is None and exit_ is None  # launched without hooks
        self.calls.append(((grid_0, grid_1, grid_2), args, stream))

    def __getitem__(self, grid):
        self.runners.append(grid)

        def runner(*args, stream=None):
            self.calls.append((grid, args, stream))
            self.hooked.append((grid, args, stream))

        return runner


class Kernel(JITFunction):
    """A ``JITFunction`` of ``fn`` (Triton's own parameters and ``pre_run_hooks``) whose
    ``kernel[grid](...)`` records the call and returns ``returns`` (the compiled kernel Triton's
    dispatch chose) and whose ``warmup`` returns ``warmup_returns`` (default: the same one)."""

    def __init__(self, fn=scale_fn, returns=None):
        super().__init__(fn)
        self.returns = Compiled() if returns is None else returns
        self.warmup_returns = None
        self.normal: list[tuple] = []
        self.warmups: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.normal.append((grid, args, kwargs))
            return self.returns

        return run

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, args, kwargs))
        return self.returns if self.warmup_returns is None else self.warmup_returns


class Driver:
    """Triton's driver as the launcher asks it: the current device and its stream."""

    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


def _launcher(cls=Launcher, **settings) -> tuple[Launcher, Driver]:
    driver = Driver()
    return cls(fast_here=True, driver=driver, **settings), driver


X, OUT = torch.zeros(4), torch.zeros(4)


def test_first_launch_per_site_is_normal_then_the_kept_kernel_with_the_constexpr_tail():
    launcher, _ = _launcher()
    kernel = Kernel()
    site = ("plan", "scale")
    # SQUARE before BLOCK in kwargs: the tail follows the parameters' order, not the kwargs'.
    kwargs = {"SQUARE": True, "BLOCK": 16, "num_warps": 4}
    for n in (4, 5, 6):
        launcher.launch(kernel, (3, 2), (X, OUT, n, 0.5), kwargs, site)
    assert kernel.normal == [((3, 2), (X, OUT, 4, 0.5), kwargs)]
    compiled = kernel.returns
    assert compiled.calls == [
        ((3, 2, 1), (X, OUT, 5, 0.5, 16, True), 1000),
        ((3, 2, 1), (X, OUT, 6, 0.5, 16, True), 1000),
    ]
    assert launcher.launches == 3
    assert launcher.fast_level(kernel) == {(0, site): "compiled"}
    assert compiled.runners == [] and compiled.hooked == []  # no launch hook: run, no runner
    assert not kernel.warmups  # a plain launcher does not ask Triton's dispatch


def test_with_a_launch_hook_the_kept_kernel_launches_through_its_runner(monkeypatch):
    """A profiler's hook (Triton's hook chains) gets every kept launch: the runner calls it."""
    chain = triton.knobs.HookChain()
    chain.add(lambda metadata: None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    launcher, _ = _launcher()
    kernel = Kernel()
    for n in (4, 5, 6):
        launcher.launch(kernel, (3,), (X, OUT, n, 0.5), {"BLOCK": 16}, "site")
    compiled = kernel.returns
    assert compiled.hooked == [((3, 1, 1), (X, OUT, n, 0.5, 16, False), 1000) for n in (5, 6)]
    assert compiled.runners == [(3, 1, 1)]  # one runner per grid, kept
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", triton.knobs.HookChain())
    launcher.launch(kernel, (3,), (X, OUT, 7, 0.5), {"BLOCK": 16}, "site")
    assert len(compiled.hooked) == 2 and compiled.calls[-1] == ((3, 1, 1), (X, OUT, 7, 0.5, 16, False), 1000)
    assert triton_launch.unhooked()
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda metadata: None)  # a plain function
    assert not triton_launch.unhooked()


def test_a_bound_launcher_asks_the_device_and_stream_once_and_installs_the_scratch_allocator():
    launcher, driver = _launcher()
    kernel = Kernel()
    asked = []
    ask = driver.get_current_stream
    driver.get_current_stream = lambda device: asked.append(device) or ask(device)

    def call():
        launch = launcher.bound()
        for n in (4, 5, 6):
            launch(kernel, (2,), (X, OUT, n, 1.0), {"BLOCK": 8}, "site")
        return triton.runtime._allocation._allocator.get()

    # A fresh context, as a thread that did not inherit the caller's (autograd's backward threads).
    allocator = contextvars.Context().run(call)
    assert allocator is triton_launch.set_scratch_allocator.__globals__["_scratch"]
    assert asked == [0] and len(kernel.normal) == 1
    assert kernel.returns.calls[-1] == ((2, 1, 1), (X, OUT, 6, 1.0, 8, False), 1000)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(triton.runtime._allocation._allocator.get()))
    thread.start()
    thread.join()
    assert seen[0] is not allocator  # a new thread starts without it: each call installs it


def test_a_bound_launcher_launches_kept_kernels_as_the_launcher_does(monkeypatch):
    """A bound launcher launches a kept kernel itself (no hook registered when it was bound, no
    subclass checking kept launches): what :meth:`Launcher.launch` would do, launches counted; a
    hook registered before binding, a pre-run hook and a checking subclass each keep their path."""
    launcher, _ = _launcher()
    kernel = Kernel()
    launch = launcher.bound()
    for n in (4, 5, 6):
        launch(kernel, (2,), (X, OUT, n, 1.0), {"BLOCK": 8}, "site")
    compiled = kernel.returns
    assert len(kernel.normal) == 1 and launcher.launches == 3
    assert compiled.calls == [((2, 1, 1), (X, OUT, n, 1.0, 8, False), 1000) for n in (5, 6)]
    chain = triton.knobs.HookChain()
    chain.add(lambda metadata: None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    launcher.bound()(kernel, (2,), (X, OUT, 7, 1.0), {"BLOCK": 8}, "site")
    assert compiled.hooked == [((2, 1, 1), (X, OUT, 7, 1.0, 8, False), 1000)]  # through the runner
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", triton.knobs.HookChain())
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher.bound()(kernel, (2,), (X, OUT, 8, 1.0), {"BLOCK": 8}, "site")
    assert len(kernel.normal) == 2 and launcher.launches == 5
    checked, _ = _launcher(CheckedLauncher)
    checked_kernel = Kernel()
    launch = checked.bound()
    for n in (4, 5, 6):
        launch(checked_kernel, (2,), (X, OUT, n, 1.0), {"BLOCK": 8}, "site")
    assert len(checked_kernel.warmups) == 2  # every kept launch asked Triton's dispatch


def test_defaults_fill_the_tail_and_each_device_and_site_has_its_own_first_launch():
    launcher, driver = _launcher()
    kernel = Kernel()
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "a")
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "a")
    assert kernel.returns.calls[-1] == ((1, 1, 1), (X, OUT, 4, 1.0, 8, False), 1000)  # SQUARE's default
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "b")  # another site
    driver.device = 1
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "a")  # another device
    assert len(kernel.normal) == 3
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "a")
    assert kernel.returns.calls[-1][2] == 1001  # the stream of the current device
    assert set(launcher.fast_level(kernel)) == {(0, "a"), (0, "b"), (1, "a")}


def test_a_launch_without_site_is_always_normal():
    launcher, _ = _launcher()
    kernel = Kernel()
    for _ in range(3):
        launcher.launch(kernel, (2,), (X, OUT, 4, 1.0), {"BLOCK": 8})
    assert len(kernel.normal) == 3 and not kernel.returns.calls
    assert launcher.fast_level(kernel) == {}


def test_host_descriptors_reach_triton_as_given_on_both_paths():
    launcher, _ = _launcher()
    kernel = Kernel(desc_copy_fn)
    src, out = torch.zeros(8, 16), torch.zeros(8, 16)
    for _ in range(2):
        launcher.launch(kernel, (2,), (host_descriptor(src, (4, 16)), out, 16), {"BM": 4, "BN": 16}, "copy")
    (_, normal_args, _), (_, kept_args, _) = kernel.normal[0], kernel.returns.calls[0]
    for args in (normal_args, kept_args):
        desc = args[0]
        assert isinstance(desc, TensorDescriptor)
        assert desc.base is src and list(desc.block_shape) == [4, 16]
        assert list(desc.shape) == [8, 16] and list(desc.strides) == [16, 1]
    assert kept_args[1:] == (out, 16, 4, 16)


def test_a_kernel_with_pre_run_hooks_never_takes_the_kept_kernel():
    launcher, _ = _launcher()
    hooked = Kernel()
    hooked.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(3):
        launcher.launch(hooked, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert len(hooked.normal) == 3 and not hooked.returns.calls
    # A hook added after the site's compiled kernel was kept: the normal path from then on.
    kernel = Kernel()
    for _ in range(2):
        launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert len(kernel.normal) == 2 and len(kernel.returns.calls) == 1


class Wrapper:
    """Stands in for an autotuner around a kernel: it chooses the variant per call."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.pre_run_hooks: list = []

    def __getitem__(self, grid):
        return self.kernel[grid]


def test_sites_that_do_not_map_onto_the_compiled_kernel_stay_normal():
    launcher, _ = _launcher()
    # Not a plain JITFunction: its launches are its own choice each time.
    inner = Kernel()
    for _ in range(2):
        launcher.launch(Wrapper(inner), (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert len(inner.normal) == 2 and not inner.returns.calls
    # Triton's dispatch returned no CompiledKernel (a compile hook took over, an async compile).
    kernel = Kernel(returns=object())
    for _ in range(2):
        launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert len(kernel.normal) == 2 and launcher.fast_level(kernel) == {(0, "site"): "normal"}
    # A keyword names a non-constexpr parameter: it would be frozen into the tail.
    kernel = Kernel()
    for _ in range(2):
        launcher.launch(kernel, (1,), (X, OUT, 4), {"scale": 1.0, "BLOCK": 8}, "site")
    assert len(kernel.normal) == 2 and not kernel.returns.calls
    assert triton_launch.constexpr_tail(kernel, 3, {"scale": 1.0, "BLOCK": 8}) is None
    assert triton_launch.constexpr_tail(kernel, 4, {"BLOCK": 8}) == (8, False)
    assert triton_launch.constexpr_tail(kernel, 4, {}) is None  # BLOCK has no default


def test_a_launcher_without_kept_kernels_and_unsupported_triton_take_the_normal_path(monkeypatch, caplog):
    launcher, _ = _launcher(kept=False)
    kernel = Kernel()
    for _ in range(2):
        launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
        launcher.bound()(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert len(kernel.normal) == 4 and launcher.fast_level(kernel) == {} and not launcher.fast()

    # The decision itself, as on a GPU machine: only Triton 3.6.x and 3.7.x keep kernels.
    # (triton_launch.interpreting caches its answer for the process: replaced, not re-read.)
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    logs.forget_logged()
    for version, fast in (("3.6.0", True), ("3.7.1", True), ("3.5.1", False), ("3.8.0", False), ("4.0.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        with caplog.at_level(logging.WARNING, logger="mcore_ppo"):
            caplog.clear()
            assert Launcher(driver=Driver()).decide() is fast
            assert Launcher(driver=Driver()).decide() is fast
        logged = [r for r in caplog.records if "per-call dispatch" in r.getMessage()]
        assert len(logged) == (0 if fast else 1), version  # once per version, not per launcher
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    launcher = Launcher(driver=Driver())
    kernel = Kernel()
    for _ in range(3):
        launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, "site")
    assert launcher.fast_here is False and len(kernel.normal) == 3 and not kernel.returns.calls
    logs.forget_logged()


def test_the_checked_launcher_asks_tritons_dispatch_and_raises_on_another_compiled_kernel():
    launcher, _ = _launcher(CheckedLauncher)
    kernel = Kernel()
    launcher.launch(kernel, (1,), (X, OUT, 16, 1.0), {"BLOCK": 8}, "site")
    launcher.launch(kernel, (1,), (X, OUT, 32, 1.0), {"BLOCK": 8}, "site")
    assert kernel.warmups == [((1,), (X, OUT, 32, 1.0), {"BLOCK": 8})] and len(kernel.returns.calls) == 1
    kernel.warmup_returns = Compiled("another variant")  # Triton would launch another one
    with pytest.raises(SiteKeyError, match="coarser than triton's"):
        launcher.launch(kernel, (1,), (X, OUT, 17, 1.0), {"BLOCK": 8}, "site")
    assert len(kernel.returns.calls) == 1  # nothing launched


def test_the_kept_table_is_bounded(monkeypatch):
    monkeypatch.setattr(triton_launch, "SITES_PER_KERNEL", 3)
    launcher, _ = _launcher()
    kernel = Kernel()
    for site in range(4):
        launcher.launch(kernel, (1,), (X, OUT, 4, 1.0), {"BLOCK": 8}, site)
    assert list(launcher.fast_level(kernel)) == [(0, 3)]


# ---------------------------------------------------------------------------------------------
# The process's launcher, on real kernels (the interpreter on CPU)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's paths (a GPU runs tests/gpu/test_gpu_fast_launch.py)")
class TestInterpreter:
    def test_no_kept_kernels_under_the_interpreter(self, interpreter):
        x = torch.arange(37, dtype=torch.float32)
        out = torch.empty_like(x)
        launcher = Launcher()
        launch = launcher.bound()
        for square in (False, True, True):
            launch(scale_kernel, (3,), (x, out, 37, 0.5), {"BLOCK": 16, "SQUARE": square}, ("s", square))
            torch.testing.assert_close(out, (x * 0.5) ** 2 if square else x * 0.5)
        assert launcher.launches == 3
        assert not launcher.fast() and launcher.fast_level(scale_kernel) == {}

    def test_the_checked_launcher_uses_tritons_binder(self, interpreter):
        """Triton specialises an integer on divisibility by 16: a site that lets ``n`` change
        class is caught; with ``n`` unspecialised (``do_not_specialize``) it is not."""
        x = torch.arange(64, dtype=torch.float32)
        out = torch.empty_like(x)
        launch = CheckedLauncher().launch
        for n in (16, 32, 48):
            launch(scale_kernel, (4,), (x, out, n, 1.0), {"BLOCK": 16}, "coarse")
        for n in (16, 17, 1):
            launch(n_free_scale_kernel, (4,), (x, out, n, 1.0), {"BLOCK": 16}, "coarse")
        with pytest.raises(SiteKeyError, match="two specialisations"):
            launch(scale_kernel, (4,), (x, out, 17, 1.0), {"BLOCK": 16}, "coarse")
        with pytest.raises(SiteKeyError):  # a constexpr is part of the key too
            launch(scale_kernel, (4,), (x, out, 16, 1.0), {"BLOCK": 32}, "coarse")
        with pytest.raises(SiteKeyError):  # so is a pointer's 16-byte alignment
            launch(scale_kernel, (4,), (x[1:], out, 16, 1.0), {"BLOCK": 16}, "coarse")
        # A plain launcher trusts the site key.
        Launcher().launch(scale_kernel, (4,), (x, out, 17, 1.0), {"BLOCK": 16}, "coarse")

    def test_descriptors_under_the_interpreter_and_their_dtype_in_the_key(self, interpreter):
        src = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
        out = torch.zeros_like(src)
        launch = CheckedLauncher().launch
        launch(desc_copy_kernel, (2,), (host_descriptor(src, (4, 16)), out, 16), {"BM": 4, "BN": 16}, "d")
        assert torch.equal(out, src)
        with pytest.raises(SiteKeyError):
            half = src.half()
            launch(desc_copy_kernel, (2,), (host_descriptor(half, (4, 16)), out, 16), {"BM": 4, "BN": 16}, "d")


# ---------------------------------------------------------------------------------------------
# Nothing private of Triton's

SOURCE = Path(triton_launch.__file__).read_text()
# Public dunders the module names (in code or comments); any other ``._`` is a private access.
ALLOWED_DUNDERS = {"__version__", "__getitem__"}


def test_the_module_reads_nothing_private():
    for token in (
        "__closure__",
        "cell_contents",
        "__code__",
        "co_freevars",
        "_BASE_ARGS_FORMAT_LEN",
        "make_tensordesc_arg",
        "triton._C",
        "torch._C",
        "__dict__",
        "vars(",
    ):
        assert token not in SOURCE, token
    private = set(re.findall(r"\.(_\w*)", SOURCE)) - ALLOWED_DUNDERS
    assert not private, f"private attributes read: {sorted(private)}"
    tree = ast.parse(SOURCE)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert not node.attr.startswith("_") or node.attr in ALLOWED_DUNDERS, node.attr
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            parts = (node.module or "").split(".")
            assert not any(p.startswith("_") for p in parts), node.module
            assert not any(a.name.startswith("_") for a in node.names), node.module
        if isinstance(node, ast.Import):
            assert not any(p.startswith("_") for a in node.names for p in a.name.split(".")), ast.unparse(node)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert not any(n.startswith("_") for n in names), ast.unparse(node)


def test_the_forbidden_patterns_are_caught():
    """The checks above fail on the former closure-reading level's idioms."""
    former = "cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))"
    assert set(re.findall(r"\.(_\w*)", former)) - ALLOWED_DUNDERS == {"__code__", "__closure__"}
    assert set(re.findall(r"\.(_\w*)", "torch._C._cuda_getDevice()")) == {"_C", "_cuda_getDevice"}
