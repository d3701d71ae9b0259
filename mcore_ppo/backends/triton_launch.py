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
  kept, and later launches of the (device, site) call it through its public launch surface,
  ``compiled[grid](*args, *constexpr_tail, stream=...)``. That surface runs the launch hooks
  (profilers) and builds the launch metadata itself, and Triton's launcher encodes each host
  TMA descriptor (a :class:`TmaDesc`, passed as Triton's ``TensorDescriptor``) per launch.

The specialisation key is never computed here: a site key is the caller's promise that it is no
coarser than Triton's. :func:`checked_sites` (tests) makes every site launch verify it against
Triton itself: where a compiled kernel is kept, ``kernel.warmup(...)`` (Triton's dispatch for
the actual arguments, without the launch) must return that very kernel; elsewhere (the
interpreter, normal launches) Triton's own argument binder must give one specialisation per site.

The kept kernel is used only on the Triton versions it was verified against (3.6.x, 3.7.x:
:data:`SUPPORTED_TRITON`); on another version every launch takes ``kernel[grid](...)`` and that
is logged once. Every launch takes ``kernel[grid](...)`` too under the interpreter (it has no
compiled kernels), without a CUDA device, for a kernel with pre-run hooks (``kernel[grid]``
runs them; the kept kernel would not), for a site whose arguments do not map onto the compiled
kernel's parameters (a keyword naming a non-constexpr parameter, a non-constexpr parameter left
to its default), for a kernel that is not a plain ``JITFunction`` (an autotuner chooses per
call), and inside :func:`normal_launches`. Besides the key and the pre-run hooks, the
kept kernel skips one check of Triton's dispatch: that the module globals the kernel reads have
not changed since it was compiled (the kernels read constants only).

What remains per launch is Python: descriptors, the metadata, the launcher's arguments. CUDA
graphs are the supported way to remove it: capture the step once and replay it
(docs/megatron.md#cuda-graphs); a replay launches nothing from Python.

:func:`launch_count` counts launches (every path), for tests that bound the launches per call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from mcore_ppo.logs import log_once

try:
    import triton
    from triton.compiler import CompiledKernel
    from triton.runtime.driver import driver as triton_driver
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = CompiledKernel = JITFunction = triton_driver = TensorDescriptor = None

# Triton versions whose dispatch and CompiledKernel launch surface the kept-kernel path was
# checked against (JITFunction.run, .warmup, .pre_run_hooks; CompiledKernel.__getitem__).
SUPPORTED_TRITON = ("3.6.", "3.7.")
# Sites kept per kernel (a process meets a few per plan; a new one past the bound clears the table).
SITES_PER_KERNEL = 256


def supported_triton(version: str) -> bool:
    """The kept-kernel path may run on Triton ``version`` (one of :data:`SUPPORTED_TRITON`)."""
    return version.startswith(SUPPORTED_TRITON)


@dataclass(frozen=True)
class LaunchConfig:
    """How :func:`launch` launches.

    ``fast``: a site's kept compiled kernel is used (where the module doc allows); False: every
    launch is ``kernel[grid](...)`` (tests compare both paths). ``check_sites``: every launch
    given a site verifies against Triton that the site key is no coarser than Triton's own
    (tests; costs a Triton dispatch per launch)."""

    fast: bool = True
    check_sites: bool = False


class SiteKeyError(RuntimeError):
    """A launch site key met arguments that Triton specialises differently (check mode)."""


class TmaDesc:
    """A host TMA descriptor to be: the tensor and the block shape.

    Passed to Triton as ``triton.tools.tensor_descriptor.TensorDescriptor``, built per launch
    (Triton's launcher encodes it per launch either way)."""

    __slots__ = ("base", "block_shape")

    def __init__(self, base: torch.Tensor, block_shape: tuple[int, ...]):
        self.base = base
        self.block_shape = tuple(block_shape)

    def build(self):
        """Triton's ``TensorDescriptor`` of the whole tensor with this block shape."""
        return TensorDescriptor.from_tensor(self.base, list(self.block_shape))


def triton_args(args: tuple) -> list:
    """``args`` as Triton takes them: each :class:`TmaDesc` built into a ``TensorDescriptor``."""
    return [a.build() if type(a) is TmaDesc else a for a in args]


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


# A site not yet launched on this device (None in a table means "always the normal path").
_NEW = object()


class Launcher:
    """Launches kernels as the module doc says; one per process serves :func:`launch`.

    ``fast_here``: the kept-kernel path can run in this process (None: decided on the first
    site launch from the interpreter, the CUDA device and the Triton version). ``driver``: the
    object whose ``get_current_device()`` and ``get_current_stream(device)`` give the device and
    stream (None: Triton's active driver, the one its own dispatch asks). Tests pass both to
    drive stand-in kernels on a machine without a GPU.

    The configuration is one process-wide attribute, not a context variable: the autograd
    engine runs a CUDA backward in its own threads, which would not see a context variable set
    around ``backward()``."""

    def __init__(self, config: LaunchConfig | None = None, *, fast_here: bool | None = None, driver=None):
        self.config = config or LaunchConfig()
        self.fast_here = fast_here
        self.driver = driver
        self.launches = 0
        # id(kernel) -> (kernel, {(device, site): (compiled, constexpr tail) or None}); the
        # kernel is kept alive with its entry, so its id is not reused while the entry exists.
        self.tables: dict[int, tuple[Any, dict]] = {}
        # Check mode: (id(kernel), site) -> the first specialisation Triton's binder gave it.
        self.site_specialisations: dict[tuple, str] = {}
        self.binders: dict[int, tuple[Any, Callable]] = {}

    def decide(self) -> bool:
        """Whether the kept-kernel path can run here (decided once): Triton present, compiled
        kernels (not the interpreter, a CUDA device) and a supported Triton version; on another
        version this logs once that every launch takes ``kernel[grid](...)``."""
        # triton_host imports this module: its helper is imported when first needed.
        from mcore_ppo.backends.triton_host import interpreting

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

    def launch(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site: object = None) -> None:
        """``kernel[grid](*args, **kwargs)``, through the kept compiled kernel when ``site`` was
        launched on this device before (module doc). ``args`` are the positional (non-constexpr)
        arguments, with :class:`TmaDesc` for host descriptors; ``kwargs`` the constexprs and
        launch options.

        ``site``: a hashable key of the call site that determines every argument's
        specialisation (dtype, alignment, integer class) and every keyword, e.g. a cached
        per-shape plan object and the launch's role. :func:`checked_sites` verifies that."""
        self.launches += 1
        config = self.config
        fast = self.fast_here
        if site is None or not config.fast or not (fast or (fast is None and self.decide())):
            if site is not None and config.check_sites:
                self.check_binder(kernel, site, args, kwargs)
            kernel[grid](*triton_args(args), **kwargs)
            return
        driver = self.driver or triton_driver.active
        device = driver.get_current_device()
        table = self.tables.get(id(kernel)) or self.new_table(kernel)
        kept = table[1].get((device, site), _NEW)
        if kept is _NEW:
            # Triton's dispatch chooses (and compiles, the first time) the variant for these
            # arguments; its return value is that compiled kernel.
            compiled = kernel[grid](*triton_args(args), **kwargs)
            if len(table[1]) >= SITES_PER_KERNEL:
                table[1].clear()
            # Only a plain JITFunction's launch is what its CompiledKernel does: an autotuner
            # or heuristics wrapper chooses per call, which the kept kernel would skip.
            tail = constexpr_tail(kernel, len(args), kwargs) if isinstance(kernel, JITFunction) else None
            usable = isinstance(compiled, CompiledKernel) and tail is not None
            table[1][(device, site)] = (compiled, tail) if usable else None
            return
        if kept is None or kernel.pre_run_hooks:  # hooks may be added after the site was kept
            if config.check_sites:
                self.check_binder(kernel, site, args, kwargs)
            kernel[grid](*triton_args(args), **kwargs)
            return
        compiled, tail = kept
        passed = triton_args(args)
        if config.check_sites:
            found = kernel.warmup(*passed, grid=grid, **kwargs)
            if found is not compiled:
                raise SiteKeyError(
                    f"launch site {site!r} of {kernel}: triton dispatches these arguments to another compiled "
                    f"kernel than the one kept for the site (the site key is coarser than triton's)"
                )
        # CompiledKernel.__getitem__ reads grid[0], grid[1] and grid[2].
        grid3 = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
        compiled[grid3](*passed, *tail, stream=driver.get_current_stream(device))

    def new_table(self, kernel) -> tuple[Any, dict]:
        """``kernel``'s (new, empty) table of kept compiled kernels."""
        table = self.tables[id(kernel)] = (kernel, {})
        return table

    def check_binder(self, kernel, site: object, args: tuple, kwargs: dict) -> None:
        """Raise :class:`SiteKeyError` when Triton's argument binder specialises these arguments
        differently from the site's first launch (check mode, where no compiled kernel is kept)."""
        binder = self.binders.get(id(kernel))
        if binder is None:
            binder = self.binders[id(kernel)] = (kernel, triton_binder(kernel))
        _, specialization, options = binder[1](*triton_args(args), **kwargs)
        found = repr((specialization, sorted(options.items())))
        key = (id(kernel), site)
        first = self.site_specialisations.setdefault(key, found)
        if first != found:
            raise SiteKeyError(
                f"launch site {site!r} of {kernel} met two specialisations of triton's: {first} and {found}"
            )

    @contextlib.contextmanager
    def configured(self, **changes: Any) -> Iterator[LaunchConfig]:
        """Within: this launcher's config with ``changes`` (:class:`LaunchConfig` fields)."""
        before = self.config
        self.config = replace(before, **changes)
        try:
            yield self.config
        finally:
            self.config = before

    def fast_level(self, kernel) -> dict:
        """``{(device, site): "compiled" or "normal"}`` of the sites ``kernel`` was launched with
        on the kept-kernel path (empty where that path never ran)."""
        table = self.tables.get(id(kernel))
        return {} if table is None else {k: "normal" if v is None else "compiled" for k, v in table[1].items()}


def triton_binder(kernel) -> Callable:
    """Triton's own argument binder of ``kernel``: ``binder(*args, **kwargs)`` returns
    ``(bound arguments, specialisation, options)``, what Triton's dispatch keys its cache on.
    Under the interpreter ``kernel`` is an ``InterpretedFunction``: the binder is that of the
    ``JITFunction`` its decorator would have made. The NVIDIA backend specialises as the base
    backend does (it overrides none of its specialisation methods), so the base backend serves."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    if not isinstance(kernel, JITFunction):
        options = kernel.kwargs
        keep = ("do_not_specialize", "do_not_specialize_on_alignment")
        kernel = JITFunction(kernel.fn, **{k: v for k, v in options.items() if k in keep})
    return create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


_LAUNCHER = Launcher()
# The process's launcher's methods, imported by the backends (a bound method: no extra call).
launch = _LAUNCHER.launch


def launch_count() -> int:
    """Kernel launches through :func:`launch` since the process started."""
    return _LAUNCHER.launches


def launch_config(**changes: Any) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Within: :func:`launch` with its :class:`LaunchConfig` changed by ``changes``."""
    return _LAUNCHER.configured(**changes)


def normal_launches() -> contextlib.AbstractContextManager[LaunchConfig]:
    """Within: every launch goes through ``kernel[grid](...)`` (tests compare both paths)."""
    return _LAUNCHER.configured(fast=False)


def checked_sites() -> contextlib.AbstractContextManager[LaunchConfig]:
    """Within: every site launch verifies against Triton that its site key is no coarser than
    Triton's own specialisation key (module doc); a violation raises :class:`SiteKeyError`."""
    return _LAUNCHER.configured(check_sites=True)


def fast_available() -> bool:
    """The kept-kernel path can run here (compiled kernels, a supported Triton) and is on."""
    fast = _LAUNCHER.fast_here
    return _LAUNCHER.config.fast and (fast or (fast is None and _LAUNCHER.decide()))


def fast_level(kernel) -> dict:
    """``{(device, site): level}`` of the sites ``kernel`` was launched with (tests, scripts)."""
    return _LAUNCHER.fast_level(kernel)


__all__ = [
    "SITES_PER_KERNEL",
    "SUPPORTED_TRITON",
    "LaunchConfig",
    "Launcher",
    "SiteKeyError",
    "TmaDesc",
    "checked_sites",
    "constexpr_tail",
    "fast_available",
    "fast_level",
    "launch",
    "launch_config",
    "launch_count",
    "normal_launches",
    "supported_triton",
    "triton_args",
    "triton_binder",
]
