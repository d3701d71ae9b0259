"""verl plugin: verl's Megatron fused log-prob/entropy path runs on the fused head, verl unedited.

verl's Megatron actor computes per-token log-probs and entropy from the hidden states with its
Triton kernel ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, which its modules
bind **at import time** (``from ... import linear_cross_entropy``):

- ``verl.models.mcore.model_forward_fused``: both routes, megatron-core >= 0.18's
  ``output_processor`` hook (``fused_output_processor``) and the older patched
  ``GPTModel.forward`` (``_fused_GPTModel_forward``);
- ``verl.models.mcore.model_forward_1f1b_overlap``: the 1F1B-overlap schedule's postprocess.

(Read from verl-project/verl at 1dda039b and from the verl 0.9.1 wheel.) The plugin rebinds that
module-level name in those two modules, when they are imported (an import hook) or at once if
they already are, to :func:`linear_cross_entropy` below: verl's own code still gathers the
sequence-parallel hidden states, picks the weight, passes the temperature and builds its
``CausalLMOutputForPPO``, so verl's return types and call sites stay as they are. verl's FSDP
models import the kernel inside their functions and are not touched.

Switching it on (off unless asked):

- verl loads every entry point of the ``verl.plugins`` group when ``verl`` is imported, in every
  Ray worker; this module is one (``pyproject.toml``). Loaded so, it switches verl's path only
  with ``MCORE_PPO_VERL=1`` in the workers' environment (verl config:
  ``+ray_kwargs.ray_init.runtime_env.env_vars.MCORE_PPO_VERL=1``).
- ``VERL_USE_EXTERNAL_MODULES=mcore_ppo.integrations.verl`` names this module, which is asking:
  it switches on unless ``MCORE_PPO_VERL=0``.
- ``MCORE_PPO_VERL=0`` keeps it off in both cases; :func:`install` / :func:`uninstall` do it
  from code. ``MCORE_PPO_VERL_BACKEND`` picks the head's backend (default ``auto``).

It logs what it did on the ``mcore_ppo`` logger (INFO; DEBUG when loaded but not switched on).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from mcore_ppo.logs import log_once, logger

__all__ = [
    "ENV_BACKEND",
    "ENV_SWITCH",
    "TARGET_MODULES",
    "install",
    "is_installed",
    "linear_cross_entropy",
    "uninstall",
]

ENV_SWITCH = "MCORE_PPO_VERL"
ENV_BACKEND = "MCORE_PPO_VERL_BACKEND"
# verl's modules that bind its kernel at import time, and the name they bind it to.
TARGET_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
BOUND_NAME = "linear_cross_entropy"

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
_LOCK = threading.RLock()
_ORIGINALS: dict[str, Callable[..., Any]] = {}  # module name -> verl's function it replaced
_finder: _RebindAfterImport | None = None

# Autograd nodes of an SP all-gather whose backward reduce-scatters (sums over TP): Megatron's
# gather_from_sequence_parallel_region, which verl calls right before the kernel, and ours.
_SP_GATHER_NODES = frozenset({"_GatherFromSequenceParallelRegionBackward", "_GatherSequenceParallelBackward"})
# Nodes that pass a gradient through unchanged in kind (views, copies, casts): looked through.
_PASS_THROUGH_NODES = frozenset(
    {
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "UnsafeViewBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "AliasBackward0",
    }
)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | None = 1.0,
    reduction: str | None = "none",
    dist_process_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` (same signature, outputs and flattening) on the fused head.

    What differs from verl's kernel is the TP reduction of ``d_hidden``, made complete: verl's
    call sites gather the hidden states with Megatron's SP all-gather when sequence parallelism
    is on, whose backward reduce-scatters (sums) ``d_hidden`` over TP; then this returns the
    partial, as verl's kernel does. Without SP nothing in verl sums it (verl's kernel leaves
    each rank its own vocab shard's part), so here the head all-reduces it. Which case applies
    is read from ``hidden``'s autograd node: Megatron's SP gather (through views or copies)
    or not.
    """
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy as compat_linear_cross_entropy

    reduce_here = _needs_tp_reduction(hidden, dist_process_group)
    return compat_linear_cross_entropy(
        hidden,
        weight,
        labels,
        temperature,
        reduction,
        dist_process_group,
        backend=os.environ.get(ENV_BACKEND, "auto").strip() or "auto",
        reduce_hidden_grad=reduce_here,
    )


def _needs_tp_reduction(hidden: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> bool:
    """Whether the head must sum ``d_hidden`` over TP: a backward will run, TP > 1, and ``hidden``
    does not come straight out of an SP gather (whose backward sums it)."""
    if group is None or not torch.is_grad_enabled() or not hidden.requires_grad:
        return False
    if torch.distributed.get_world_size(group) == 1:
        return False
    node, steps = hidden.grad_fn, 0
    while node is not None and type(node).__name__ in _PASS_THROUGH_NODES and steps < 4:
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        node, steps = (parents[0] if len(parents) == 1 else None), steps + 1
    from_gather = node is not None and type(node).__name__ in _SP_GATHER_NODES
    log_once(
        logging.INFO,
        ("verl-dhidden", from_gather),
        "mcore_ppo verl plugin: hidden states %s: d_hidden %s",
        "come from the SP all-gather" if from_gather else "are not SP-gathered (sequence parallelism off)",
        "is summed over TP by that gather's reduce-scatter" if from_gather else "is all-reduced over TP by the head",
    )
    return not from_gather


# ---------------------------------------------------------------------------------------------
# Rebinding verl's modules
# ---------------------------------------------------------------------------------------------


def _rebind(module: ModuleType) -> None:
    """Point ``module.linear_cross_entropy`` at this head (once; verl's original is kept)."""
    with _LOCK:
        current = getattr(module, BOUND_NAME, None)
        if current is linear_cross_entropy:
            return
        if current is None:
            log_once(
                logging.WARNING,
                ("verl-missing", module.__name__),
                "mcore_ppo verl plugin: %s has no %s (a verl version this plugin does not know); left as it is",
                module.__name__,
                BOUND_NAME,
            )
            return
        _ORIGINALS[module.__name__] = current
        setattr(module, BOUND_NAME, linear_cross_entropy)
    log_once(
        logging.INFO,
        ("verl-rebound", module.__name__),
        "mcore_ppo verl plugin: %s.%s -> mcore_ppo.integrations.verl.linear_cross_entropy (was %s.%s)",
        module.__name__,
        BOUND_NAME,
        getattr(current, "__module__", "?"),
        getattr(current, "__qualname__", "?"),
    )


class _RebindingLoader(importlib.abc.Loader):
    """Runs the real loader, then rebinds the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _finder is not None:  # not uninstalled meanwhile
            _rebind(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real loader
        return getattr(self._loader, name)


class _RebindAfterImport(importlib.abc.MetaPathFinder):
    """Import hook for :data:`TARGET_MODULES`: the other finders find them, a wrapper loader
    rebinds them right after they execute (their import-time ``from ... import`` has run)."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in TARGET_MODULES:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RebindingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Route verl's Megatron fused path to the head (idempotent; see the module doc).

    Modules already imported are rebound now; the others when verl imports them.

    Raises:
        ValueError: ``MCORE_PPO_VERL_BACKEND`` is not a backend name.
    """
    global _finder
    from mcore_ppo.backends import check_backend

    backend = os.environ.get(ENV_BACKEND, "auto").strip() or "auto"
    check_backend(backend)
    with _LOCK:
        if _finder is None:
            _finder = _RebindAfterImport()
            sys.meta_path.insert(0, _finder)
        loaded = [sys.modules[name] for name in TARGET_MODULES if name in sys.modules]
    for module in loaded:
        _rebind(module)
    log_once(
        logging.INFO,
        ("verl-install", backend),
        "mcore_ppo verl plugin: on (backend=%r); verl's Megatron fused log-prob/entropy path runs on the fused "
        "head: %s rebound now, the rest when imported",
        backend,
        ", ".join(m.__name__ for m in loaded) or "none",
    )


def uninstall() -> None:
    """Give verl's modules their own kernel back and remove the import hook."""
    global _finder
    with _LOCK:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for name, original in list(_ORIGINALS.items()):
            module = sys.modules.get(name)
            if module is not None and getattr(module, BOUND_NAME, None) is linear_cross_entropy:
                setattr(module, BOUND_NAME, original)
            del _ORIGINALS[name]
    logger.info("mcore_ppo verl plugin: off; verl's own linear_cross_entropy restored")


def is_installed() -> bool:
    """Whether the plugin is on (the import hook is in place)."""
    return _finder is not None


def _named_in_external_modules() -> bool:
    return __name__ in {name.strip() for name in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")}


def activate_from_environment() -> bool:
    """What loading this module does (module doc): install when asked; True when it did."""
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch and switch not in _ON + _OFF:
        logger.warning("mcore_ppo verl plugin: %s=%r is not one of %s; staying off", ENV_SWITCH, switch, _ON + _OFF)
        return False
    if switch in _OFF or not (switch in _ON or _named_in_external_modules()):
        log_once(
            logging.DEBUG,
            ("verl-off", switch),
            "mcore_ppo verl plugin: loaded, not switched on (%s)",
            f"{ENV_SWITCH}={switch}" if switch else f"set {ENV_SWITCH}=1 to switch it on",
        )
        return False
    try:
        install()
    except Exception:
        # verl swallows a failing plugin's error into a DEBUG line: say it where it is seen.
        logger.exception("mcore_ppo verl plugin: switching on failed")
        raise
    return True


activate_from_environment()
