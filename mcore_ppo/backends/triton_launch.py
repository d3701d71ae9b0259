"""Kernel launches of the triton backend without Triton's per-call dispatch.

``kernel[grid](*args, **kwargs)`` re-derives on every call what a kernel's arguments specialise
to (one native call per argument), hashes that into the cache key, builds launch metadata and,
for host TMA descriptors, encodes every descriptor anew: ~0.1 ms of host time per launch on an
H200, several times the head's whole budget. :func:`launch` does that once per *specialisation
key* and keeps the :class:`CompiledKernel` that Triton returned; later calls with the same key
call its launcher directly.

The key is computed here from the arguments, no coarser than Triton's own (so two calls that
share it always share Triton's compiled variant): per tensor its dtype and, where the kernel
specialises on it, its 16-byte alignment; per int its width (int32, int64, uint64) and, where specialised,
whether it is 1 and a multiple of 16; per :class:`TmaDesc` its dtype and block; the keyword
constexprs and launch options by value; the current device. A call site whose cached plan
fixes all of that passes the plan as its ``site`` key instead (no per-argument work).

Three levels, decided per compiled kernel from what the installed Triton offers, never by
catching errors of a real launch:

- ``raw``: Triton 3.6's launcher layout (its C launch function behind the descriptor wrapper,
  13 base arguments): the descriptors' encoded TMA maps are cached per (tensor address, shape,
  strides, block), so a weight's map is encoded once.
- ``compiled``: any Triton whose ``CompiledKernel.run`` takes ``(gx, gy, gz, stream, function,
  metadata, launch_metadata, enter_hook, exit_hook, *args)`` (3.4 to 3.7): that call, with the
  descriptors Triton encodes per launch.
- ``normal``: ``kernel[grid](...)`` itself: under ``TRITON_INTERPRET`` (there is no compiled
  kernel), with launch hooks installed (profilers), for a new key, and when
  :data:`FAST_LAUNCH` is False.

:func:`launch_count` counts launches (all levels), for tests that bound the launches per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:
    import triton
    import triton.knobs
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    triton = None

# False: every launch goes through ``kernel[grid](...)`` (tests compare the two paths).
FAST_LAUNCH = True
# True: a launch given a ``site`` key also computes the argument key and checks that the site
# never meets two different argument keys (tests; off, the site key alone is used).
CHECK_SITES = False
# Encoded TMA maps kept per compiled kernel and descriptor argument (addresses the allocator
# hands out again are hits; a new one past the bound clears the table).
DESCRIPTOR_CACHE_SIZE = 32
# Keys kept per kernel (a process meets a few; a new one past the bound clears the table).
KEYS_PER_KERNEL = 256

_launches = 0


def launch_count() -> int:
    """Kernel launches through :func:`launch` since the process started."""
    return _launches


class TmaDesc:
    """A host TMA descriptor to be: the tensor and block shape.

    The normal launch turns it into Triton's ``TensorDescriptor``; the ``raw`` level reuses an
    encoded map with the same address and geometry, so nothing is built per call."""

    __slots__ = ("base", "block_shape")

    def __init__(self, base: torch.Tensor, block_shape: tuple[int, ...]):
        self.base = base
        self.block_shape = tuple(block_shape)

    def build(self):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor.from_tensor(self.base, list(self.block_shape))


def _param_flags(kernel) -> tuple[tuple[bool, bool], ...]:
    """Per parameter: ``(value specialised, alignment specialised)``, as the kernel's decorator
    set them (``do_not_specialize`` / ``do_not_specialize_on_alignment``, by name or index)."""
    options = getattr(kernel, "kwargs", None) or {}  # the interpreter's wrapper keeps them here
    no_value = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ()
    no_align = getattr(kernel, "do_not_specialize_on_alignment", None)
    no_align = no_align or options.get("do_not_specialize_on_alignment") or ()
    flags = []
    for i, name in enumerate(kernel.arg_names):
        value = i not in no_value and name not in no_value
        flags.append((value, value and i not in no_align and name not in no_align))
    return tuple(flags)


def _arg_key(arg: Any, flags: tuple[bool, bool]) -> Any:
    """What Triton's specialisation of one argument depends on (no coarser than its own)."""
    kind = type(arg)
    if kind is int:
        width = 0 if -(2**31) <= arg < 2**31 else (1 if arg < 2**63 else 2)  # Triton's i32 / i64 / u64
        if not flags[0]:
            return width
        return (arg == 1, width, flags[1] and arg & 15 == 0)
    if kind is float:
        return 0.0
    if kind is TmaDesc:
        return (arg.base.dtype, arg.block_shape)
    if kind is bool or arg is None:
        return arg
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0) if flags[1] else arg.dtype
    raise TypeError(f"triton_launch.launch: unsupported kernel argument of type {kind.__name__}")


def _normal_args(args: tuple) -> list:
    return [a.build() if type(a) is TmaDesc else a for a in args]


class _Fast:
    """One (kernel, key)'s compiled kernel and how to call it."""

    __slots__ = (
        "base",
        "desc_at",
        "desc_meta",
        "desc_order",
        "function",
        "level",
        "maps",
        "packed",
        "raw",
        "run",
        "tail",
    )

    def __init__(self, kernel, compiled, n_args: int, kwargs: dict):
        self.level = "normal"
        params = kernel.params
        # Parameters after the positional ones must all be constexprs (fixed by the key); their
        # values, passed or default, travel as the launcher's tail arguments.
        tail = []
        for param in params[n_args:]:
            if not param.is_constexpr:
                return
            tail.append(kwargs[param.name] if param.name in kwargs else param.default)
        if any(p.name in kwargs and not p.is_constexpr for p in params):
            return
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return
        self.tail = tuple(tail)
        self.run = compiled.run  # initialises the handles (the launch has happened)
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.maps: dict = {}
        self.level = "compiled"
        raw = _raw_launcher(self.run)
        if raw is not None and all(i < n_args for i in raw[1]):
            self.raw, self.desc_at, self.desc_meta, self.base = raw
            self.desc_order = tuple(sorted(self.desc_at))
            self.level = "raw"

    def call(self, grid: tuple, stream: int, args: tuple) -> None:
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if self.level == "compiled":
            self.run(g0, g1, g2, stream, self.function, self.packed, None, None, None, *_normal_args(args), *self.tail)
            return
        final = [g0, g1, g2, stream, self.function, *self.base, self.packed, None, None, None]
        start = 0
        for i in self.desc_order:  # positional arguments, in order (checked when built)
            final += args[start:i]
            final += self._encoded(i, args[i])
            start = i + 1
        final += args[start:]
        final += self.tail
        self.raw(*final)

    def _encoded(self, index: int, desc: TmaDesc) -> list:
        base = desc.base
        # The dtype and block are fixed by this entry's key; the geometry and address are not.
        key = (index, base.data_ptr(), base.shape, base.stride())
        found = self.maps.get(key)
        if found is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            meta = self.desc_meta[self.desc_at[index]] if self.desc_meta else None
            found = make_tensordesc_arg(desc.build(), meta)
            if meta is None:  # the tensor itself travels: nothing to reuse
                return found
            if len(self.maps) >= DESCRIPTOR_CACHE_SIZE:
                self.maps.clear()
            self.maps[key] = found
        return found


def _raw_launcher(launcher) -> tuple | None:
    """``(launch, {arg index: descriptor ordinal}, descriptor metadata, base args)`` when
    ``launcher`` has Triton 3.6's layout (a ``CudaLauncher`` whose ``launch`` is the C function
    or the descriptor wrapper around it, taking 13 base arguments) and needs no scratch
    memory; None otherwise (then the ``compiled`` level runs)."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:  # pragma: no cover - a build without the NVIDIA backend
        return None
    if not triton.__version__.startswith("3.6.") or getattr(nvidia_driver, "_BASE_ARGS_FORMAT_LEN", None) != 13:
        return None
    if not hasattr(nvidia_driver, "make_tensordesc_arg"):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    base = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)
    fn = launcher.launch
    code = getattr(fn, "__code__", None)
    if code is None:  # the C launch function itself: no descriptor arguments
        return fn, {}, None, base
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=False))
    if code.co_name != "inner" or not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    ordinal = {i: k for k, i in enumerate(sorted(cells["tensordesc_indices"]))}
    return cells["launcher"], ordinal, cells["tensordesc_meta"], base


_TABLES: dict[int, tuple[Any, dict, tuple]] = {}
_STREAM = None


def _hooks_idle() -> bool:
    """No launch hook (a profiler's) is installed: the fast levels pass none to the launcher.
    Triton 3.6+ keeps a HookChain (never None) whose ``calls`` list is empty when unused."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or (enter.__class__.__name__ == "HookChain" and not enter.calls)) and (
        leave is None or (leave.__class__.__name__ == "HookChain" and not leave.calls)
    )


_COMPILED: bool | None = None  # compiled kernels exist here (decided on the first launch)


def _compiled_kernels() -> bool:
    global _COMPILED
    if _COMPILED is None:
        from mcore_ppo.backends.triton_host import interpreting

        _COMPILED = triton is not None and not interpreting()
    return _COMPILED


def fast_available() -> bool:
    """The fast levels can run here: compiled kernels exist (not the interpreter) and
    :data:`FAST_LAUNCH` is on."""
    return FAST_LAUNCH and _compiled_kernels()


_SITE_KEYS: dict = {}


def _table(kernel) -> tuple:
    """``(kernel, {key: _Fast}, parameter flags)`` of ``kernel`` (kept alive with it: its id
    is never reused while the entry exists)."""
    table = _TABLES.get(id(kernel))
    if table is None:
        table = _TABLES[id(kernel)] = (kernel, {}, _param_flags(kernel))
    return table


def _argument_key(flags: tuple, args: tuple, kwargs: dict) -> tuple:
    return tuple(map(_arg_key, args, flags)), tuple(kwargs.items())


def _check_site(kernel, site, args: tuple, kwargs: dict) -> None:
    key = _argument_key(_table(kernel)[2], args, kwargs)
    seen = _SITE_KEYS.setdefault((id(kernel), site), key)
    if seen != key:
        raise AssertionError(f"launch site {site!r} of {kernel} met two argument keys: {seen} and {key}")


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, site: object = None) -> None:
    """``kernel[grid](*args, **kwargs)``, through the kept compiled kernel when this key was
    launched before (module doc). ``args`` are the positional (non-constexpr) arguments, with
    :class:`TmaDesc` for host descriptors; ``kwargs`` the constexprs and launch options.

    ``site``: a hashable key of the call site that determines every argument's dtype,
    alignment and integer class and every keyword (e.g. a cached per-shape plan object and the
    launch's role); it replaces the per-argument key, whose computation costs ~0.5 us per
    argument. :data:`CHECK_SITES` verifies that promise."""
    global _launches, _STREAM
    _launches += 1
    if site is not None and CHECK_SITES:
        _check_site(kernel, site, args, kwargs)
    if not (FAST_LAUNCH and (_COMPILED or (_COMPILED is None and _compiled_kernels())) and _hooks_idle()):
        kernel[grid](*_normal_args(args), **kwargs)
        return
    device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python wrapper
    table = _TABLES.get(id(kernel)) or _table(kernel)
    key = (device, site) if site is not None else (device, *_argument_key(table[2], args, kwargs))
    fast = table[1].get(key)
    if fast is None:
        compiled = kernel[grid](*_normal_args(args), **kwargs)
        if len(table[1]) >= KEYS_PER_KERNEL:
            table[1].clear()
        table[1][key] = _Fast(kernel, compiled, len(args), kwargs)
        return
    if fast.level == "normal":
        kernel[grid](*_normal_args(args), **kwargs)
        return
    if _STREAM is None:
        _STREAM = torch._C._cuda_getCurrentRawStream
    fast.call(grid, _STREAM(device), args)


def fast_level(kernel) -> dict:
    """``{key: level}`` of the keys ``kernel`` was launched with (tests)."""
    table = _TABLES.get(id(kernel))
    return {} if table is None else {key: fast.level for key, fast in table[1].items()}


@contextlib.contextmanager
def normal_launches() -> Iterator[None]:
    """Every launch inside goes through ``kernel[grid](...)`` (tests compare both paths)."""
    global FAST_LAUNCH
    before, FAST_LAUNCH = FAST_LAUNCH, False
    try:
        yield
    finally:
        FAST_LAUNCH = before
