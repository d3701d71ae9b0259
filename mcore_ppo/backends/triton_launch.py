"""Kernel launches of the triton backend: a call site's compiled kernel kept after its first launch.

``kernel[grid](*args, **kwargs)`` binds the arguments, derives what each one specialises to
(one native call per argument), hashes that into Triton's cache key and looks the compiled
variant up, on every call: host time that grows with the argument count. A call site whose
cached per-shape plan already fixes everything Triton specialises on can skip that lookup:

- A launch without ``site`` is ``kernel[grid](...)``: Triton's own dispatch.
- A launch with ``site`` (a hashable key: the plan object and the launch's role, plus whatever
  the plan leaves open, such as a dtype or an integer whose class varies) goes through
  ``kernel[grid](...)`` the first time it is seen on a device. What that returns is the
  :class:`triton.compiler.CompiledKernel` Triton's dispatch chose for these arguments; it is
  kept, and later launches of the (device, site) call its ``run`` with its ``function`` and
  ``packed_metadata``, the call Triton's own dispatch (and inductor's launcher) makes, on the
  grid and the positional and constexpr arguments: ``run(*grid, stream, function,
  packed_metadata, None, None, None, *args, *constexpr_tail)``. The three Nones are the
  launch metadata and the enter and exit hooks: while no launch hook is registered
  (``triton.knobs.runtime``'s hook chains are empty) Triton's runner would build the metadata
  for nobody and call two empty chains around the launch. With a hook registered (a
  profiler), the launch goes through ``compiled[grid]`` (kept per grid), whose runner builds
  the metadata and calls the hooks.

The specialisation key is never computed here: a site key is the caller's promise that it is no
coarser than Triton's (the tests check every site against Triton's own dispatch:
``mcore_ppo_testing.launch_checks``).

Descriptors: the backend's forward kernel builds its TMA descriptors itself
(``tl.make_tensor_descriptor``), so its launch carries plain pointers; the descriptors live in a
per-launch scratch that Triton's launcher asks of the allocator :func:`set_scratch_allocator`
installs (a stream-ordered ``torch.empty``). Triton keeps that allocator in a context variable,
which a thread does not inherit (autograd runs a CUDA backward in its own threads), so every
bound launcher (:meth:`Launcher.bound`, one per backend call) installs it again. Kernels that
take host descriptors get them from :func:`host_descriptor` (Triton's ``TensorDescriptor``,
which its launcher encodes per launch).

The kept kernel is used only on the Triton versions it was verified against (3.6.x, 3.7.x:
:data:`SUPPORTED_TRITON`); on another version every launch takes ``kernel[grid](...)`` and that
is logged once. Every launch takes ``kernel[grid](...)`` too under the interpreter (it has no
compiled kernels), without a CUDA device, for a kernel with pre-run hooks (``kernel[grid]``
runs them; the kept kernel would not), for a site whose arguments do not map onto the compiled
kernel's parameters (a keyword naming a non-constexpr parameter, a non-constexpr parameter left
to its default), for a kernel that is not a plain ``JITFunction`` (an autotuner chooses per
call), and for a :class:`Launcher` built with ``kept=False``. Besides the key and the pre-run
hooks, the kept kernel skips one check of Triton's dispatch: that the module globals the
kernel reads have not changed since it was compiled (the kernels read constants only).

A backend call launches through a :class:`BoundLauncher`, which launches a kept kernel itself
(the lookup of its site, then its ``run``) when, at binding, no launch hook was registered and the
launcher's class does not check kept launches (:attr:`Launcher.inline_kept`); else each launch
goes through :meth:`Launcher.launch`.

What remains per launch is Python: the launcher's arguments and its C call. CUDA graphs are the
supported way to remove it: capture the step once and replay it (docs/megatron.md#cuda-graphs).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from mcore_ppo.logs import log_once

try:
    import triton
    from triton import knobs
    from triton.compiler import CompiledKernel
    from triton.runtime.driver import driver as triton_driver
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = knobs = CompiledKernel = JITFunction = triton_driver = TensorDescriptor = None

# Triton versions whose dispatch and CompiledKernel launch surface the kept-kernel path was
# checked against (JITFunction.run, .warmup, .pre_run_hooks; CompiledKernel.run, .function,
# .packed_metadata, .__getitem__; knobs.runtime's launch hook chains).
SUPPORTED_TRITON = ("3.6.", "3.7.")
# Sites kept per kernel (a process meets a few per plan; a new one past the bound clears the table).
SITES_PER_KERNEL = 256


@functools.cache
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``; read once:
    Triton itself decides when its kernels are first decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supported_triton(version: str) -> bool:
    """The kept-kernel path may run on Triton ``version`` (one of :data:`SUPPORTED_TRITON`)."""
    return version.startswith(SUPPORTED_TRITON)


def host_descriptor(tensor: torch.Tensor, block_shape: tuple[int, ...]):
    """Triton's host ``TensorDescriptor`` of the whole ``tensor`` with this block shape."""
    return TensorDescriptor.from_tensor(tensor, list(block_shape))


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Triton launches on the current device and stream; the caching allocator's blocks are
    # 512-byte aligned (Triton asks 128 for descriptors) and ordered on the current stream.
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def set_scratch_allocator() -> None:
    """Install the allocator of the kernels' global scratch (in-kernel TMA descriptors) in this
    thread's context: ``torch.empty`` on the current CUDA device and stream."""
    if triton is not None:
        triton.set_allocator(_scratch)


def constexpr_tail(kernel, n_args: int, kwargs: dict) -> tuple | None:
    """The values, in parameter order, of ``kernel``'s parameters after the first ``n_args``
    (passed in ``kwargs`` or defaults): what a compiled kernel's launcher takes after the
    positional arguments. None when the launch does not map onto that layout: a parameter
    after them is not a constexpr, a keyword names a non-constexpr parameter, or a constexpr
    has neither a value nor a default (``kernel[grid]`` reports that one)."""
    params = kernel.params
    tail = []
    for param in params[n_args:]:
        if not param.is_constexpr:
            return None
        if param.name in kwargs:
            tail.append(kwargs[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None
    if any(p.name in kwargs and not p.is_constexpr for p in params):
        return None
    return tuple(tail)


def unhooked() -> bool:
    """No launch hook is registered with Triton (``knobs.runtime.launch_enter_hook`` and
    ``launch_exit_hook`` unset or empty chains): a launch may pass None for the hooks and their
    metadata."""
    return _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)


def _no_hook(hook) -> bool:
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)


class Kept:
    """A site's kept compiled kernel: its constexpr tail, one runner per grid (launches with
    hooks) and the three grid dimensions per grid."""

    __slots__ = ("compiled", "grids", "runners", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled = compiled
        self.tail = tail
        self.runners: dict[tuple, Callable] = {}
        self.grids: dict[tuple, tuple[int, int, int]] = {}

    def launch(self, grid: tuple[int, ...], args: tuple, stream) -> None:
        """The compiled kernel's ``run`` on ``grid`` without launch hooks (module doc)."""
        dims = self.grids.get(grid)
        if dims is None:
            dims = self.grids[grid] = (*grid, 1, 1)[:3]
        compiled = self.compiled
        compiled.run(
            dims[0], dims[1], dims[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *self.tail,
        )  # fmt: skip

    def runner(self, grid: tuple[int, ...]) -> Callable:
        """``compiled[grid]``, made once per grid (CompiledKernel.__getitem__ reads grid[0..2])."""
        runner = self.runners.get(grid)
        if runner is None:
            runner = self.runners[grid] = self.compiled[grid if len(grid) == 3 else (*grid, 1, 1)[:3]]
        return runner


class Launcher:
    """Launches kernels as the module doc says; each triton backend has one.

    ``kept``: a site's kept compiled kernel is used where the module doc allows (False: every
    launch is ``kernel[grid](...)``). ``fast_here``: the kept-kernel path can run in this
    process (None: decided on the first site launch from the interpreter, the CUDA device and
    the Triton version). ``driver``: the object whose ``get_current_device()`` and
    ``get_current_stream(device)`` give the device and stream (None: Triton's active driver, the
    one its own dispatch asks). Tests pass both to drive stand-in kernels without a GPU.

    :meth:`launch_normal` and :meth:`launch_kept` are the two ways a launch goes; a subclass
    may check them (``mcore_ppo_testing.launch_checks``)."""

    def __init__(self, *, kept: bool = True, fast_here: bool | None = None, driver=None):
        self.kept = kept
        self.fast_here = fast_here
        self.driver = driver
        self.launches = 0
        # Kept launches may bypass launch_kept (BoundLauncher): no subclass checks them.
        self.inline_kept = type(self).launch_kept is Launcher.launch_kept
        # id(kernel) -> (kernel, {(device, site): Kept or None}); the kernel is kept alive with
        # its entry, so its id is not reused while the entry exists.
        self.tables: dict[int, tuple[Any, dict]] = {}

    def decide(self) -> bool:
        """Whether the kept-kernel path can run here (decided once): Triton present, compiled
        kernels (not the interpreter, a CUDA device) and a supported Triton version; on another
        version this logs once that every launch takes ``kernel[grid](...)``."""
        fast = triton is not None and not interpreting() and torch.cuda.is_available()
        if fast and not supported_triton(triton.__version__):
            log_once(
                logging.WARNING,
                ("triton_launch", "unsupported", triton.__version__),
                "triton %s: kernel launches take triton's per-call dispatch (kept compiled kernels are used on "
                "triton %s only)",
                triton.__version__,
                "/".join(v + "x" for v in SUPPORTED_TRITON),
            )
            fast = False
        self.fast_here = fast
        return fast

    def fast(self) -> bool:
        """Kept compiled kernels are used by this launcher here."""
        fast = self.fast_here
        return self.kept and (fast or (fast is None and self.decide()))

    def bound(self) -> BoundLauncher:
        """This launcher for the launches of one backend call: the current device and stream
        asked once, the scratch allocator installed in this thread (module doc)."""
        set_scratch_allocator()
        if not self.fast():
            return BoundLauncher(self, None, None)
        driver = self.driver or triton_driver.active
        device = driver.get_current_device()
        return BoundLauncher(self, device, driver.get_current_stream(device), self.inline_kept and unhooked())

    def launch(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site: object = None, where=None) -> None:
        """``kernel[grid](*args, **kwargs)``, through the kept compiled kernel when ``site`` was
        launched on this device before (module doc). ``args``: the positional (non-constexpr)
        arguments; ``kwargs``: the constexprs and launch options; ``where``: ``(device,
        stream)`` of the launch (None: asked now).

        ``site``: a hashable key of the call site that determines every argument's
        specialisation (dtype, alignment, integer class) and every keyword, e.g. a cached
        per-shape plan object and the launch's role."""
        self.launches += 1
        if site is None or not self.fast():
            self.launch_normal(kernel, grid, args, kwargs, site)
            return
        if where is None:
            driver = self.driver or triton_driver.active
            device = driver.get_current_device()
            where = (device, driver.get_current_stream(device))
        table = self.tables.get(id(kernel)) or self.new_table(kernel)
        key = (where[0], site)
        kept = table[1].get(key, table)  # the table itself stands for "not seen yet"
        if kept is table:
            # Triton's dispatch chooses (and compiles, the first time) the variant for these
            # arguments; its return value is that compiled kernel.
            compiled = self.launch_normal(kernel, grid, args, kwargs, site)
            if len(table[1]) >= SITES_PER_KERNEL:
                table[1].clear()
            # Only a plain JITFunction's launch is what its CompiledKernel does: an autotuner
            # or heuristics wrapper chooses per call, which the kept kernel would skip.
            tail = constexpr_tail(kernel, len(args), kwargs) if isinstance(kernel, JITFunction) else None
            usable = isinstance(compiled, CompiledKernel) and tail is not None
            table[1][key] = Kept(compiled, tail) if usable else None
            return
        if kept is None or kernel.pre_run_hooks:  # hooks may be added after the site was kept
            self.launch_normal(kernel, grid, args, kwargs, site)
            return
        self.launch_kept(kept, kernel, grid, args, kwargs, site, where[1])

    def launch_normal(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site: object):
        """Triton's own dispatch; returns what ``kernel[grid](...)`` returns."""
        return kernel[grid](*args, **kwargs)

    def launch_kept(self, kept: Kept, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site, stream) -> None:
        """The site's kept compiled kernel: its ``run`` while no launch hook is registered, else
        its runner for ``grid`` (module doc)."""
        if unhooked():
            kept.launch(grid, args, stream)
        else:
            kept.runner(grid)(*args, *kept.tail, stream=stream)

    def new_table(self, kernel) -> tuple[Any, dict]:
        """``kernel``'s (new, empty) table of kept compiled kernels."""
        table = self.tables[id(kernel)] = (kernel, {})
        return table

    def fast_level(self, kernel) -> dict:
        """``{(device, site): "compiled" or "normal"}`` of the sites ``kernel`` was launched with
        on the kept-kernel path (empty where that path never ran)."""
        table = self.tables.get(id(kernel))
        return {} if table is None else {k: "normal" if v is None else "compiled" for k, v in table[1].items()}


class BoundLauncher:
    """A :class:`Launcher` with the device and stream of one backend call:
    ``launch(kernel, grid, args, kwargs, site=None)``.

    ``inline``: a site's kept kernel is launched here, without the launcher's dispatch (what
    :meth:`Launcher.launch` and :meth:`Launcher.launch_kept` would do for it, decided once per
    backend call: no launch hook registered, no subclass checking kept launches)."""

    __slots__ = ("kept", "launcher", "where")

    def __init__(self, launcher: Launcher, device: int | None, stream: int | None, inline: bool = False):
        self.launcher = launcher
        self.where = None if device is None else (device, stream)
        # Only a launcher on the kept-kernel path (a device) has kept kernels.
        self.kept = launcher.tables if inline and device is not None else None

    def __call__(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site: object = None) -> None:
        """:meth:`Launcher.launch` on this call's device and stream."""
        kept_tables, where = self.kept, self.where
        if kept_tables is not None and site is not None:
            table = kept_tables.get(id(kernel))
            kept = None if table is None else table[1].get((where[0], site))
            if kept is not None and not kernel.pre_run_hooks:
                self.launcher.launches += 1
                kept.launch(grid, args, where[1])
                return
        self.launcher.launch(kernel, grid, args, kwargs, site, where)


__all__ = [
    "SITES_PER_KERNEL",
    "SUPPORTED_TRITON",
    "BoundLauncher",
    "Kept",
    "Launcher",
    "constexpr_tail",
    "host_descriptor",
    "interpreting",
    "set_scratch_allocator",
    "supported_triton",
    "unhooked",
]
