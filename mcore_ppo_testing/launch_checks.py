"""A launcher that checks every launch site against Triton itself, for the triton backend's tests.

:class:`~mcore_ppo.backends.triton_launch.Launcher` trusts a site key to be no coarser than
Triton's own specialisation key (the site's plan promises that). :class:`CheckedLauncher`
verifies it on every launch given a site: where a compiled kernel is kept, ``kernel.warmup``
(Triton's dispatch for the actual arguments, without the launch) must return that very kernel;
elsewhere (the interpreter, ``kept=False``) Triton's own argument binder must give one
specialisation per site. Pass it to a backend: ``TritonBackend(config, launcher=CheckedLauncher())``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_ppo.backends.triton_launch import Kept, Launcher


class SiteKeyError(RuntimeError):
    """A launch site key met arguments that Triton specialises differently."""


def triton_binder(kernel) -> Callable:
    """Triton's own argument binder of ``kernel``: ``binder(*args, **kwargs)`` returns
    ``(bound arguments, specialisation, options)``, what Triton's dispatch keys its cache on.
    Under the interpreter ``kernel`` is an ``InterpretedFunction``: the binder is that of the
    ``JITFunction`` its decorator would have made. The NVIDIA backend specialises as the base
    backend does (it overrides none of its specialisation methods), so the base backend serves."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        options = kernel.kwargs
        keep = ("do_not_specialize", "do_not_specialize_on_alignment")
        kernel = JITFunction(kernel.fn, **{k: v for k, v in options.items() if k in keep})
    return create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


class CheckedLauncher(Launcher):
    """A :class:`Launcher` that raises :class:`SiteKeyError` when a site key is coarser than
    Triton's specialisation key (module doc); otherwise it launches as its base does."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # (id(kernel), site) -> the first specialisation Triton's binder gave it.
        self.site_specialisations: dict[tuple, str] = {}
        self.binders: dict[int, tuple[Any, Callable]] = {}

    def launch_normal(self, kernel, grid, args, kwargs, site):
        if site is not None:
            self.check_binder(kernel, site, args, kwargs)
        return super().launch_normal(kernel, grid, args, kwargs, site)

    def launch_kept(self, kept: Kept, kernel, grid, args, kwargs, site, stream) -> None:
        found = kernel.warmup(*args, grid=grid, **kwargs)
        if found is not kept.compiled:
            raise SiteKeyError(
                f"launch site {site!r} of {kernel}: triton dispatches these arguments to another compiled "
                f"kernel than the one kept for the site (the site key is coarser than triton's)"
            )
        super().launch_kept(kept, kernel, grid, args, kwargs, site, stream)

    def check_binder(self, kernel, site: object, args: tuple, kwargs: dict) -> None:
        """Raise :class:`SiteKeyError` when Triton's argument binder specialises these arguments
        differently from the site's first launch."""
        binder = self.binders.get(id(kernel))
        if binder is None:
            binder = self.binders[id(kernel)] = (kernel, triton_binder(kernel))
        _, specialization, options = binder[1](*args, **kwargs)
        found = repr((specialization, sorted(options.items())))
        first = self.site_specialisations.setdefault((id(kernel), site), found)
        if first != found:
            raise SiteKeyError(
                f"launch site {site!r} of {kernel} met two specialisations of triton's: {first} and {found}"
            )
