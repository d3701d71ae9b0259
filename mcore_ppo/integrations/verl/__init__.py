"""verl plugin: verl's Megatron fused log-prob/entropy path runs on the fused head, verl unedited.

verl's Megatron engine (``MegatronEngineWithLMHead.forward_step``) takes its fused path only
with ``actor_rollout_ref.model.use_fused_kernels=True`` (default False) and remove-padding on,
MTP off: it then calls ``fused_forward_model_engine``, which ends in verl's Triton kernel
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, bound **at import time** in
``verl.models.mcore.model_forward_fused`` and called from ``fused_output_processor``
(megatron-core >= 0.18's ``output_processor`` hook) or ``_fused_GPTModel_forward`` (the patched
``GPTModel.forward`` of older megatron-core). Read from verl 0.9.1 (the wheel) and
verl-project/verl at 1dda039b.

When switched on, an import hook rebinds, in verl's modules as they are imported (or at once if
they already are):

- ``model_forward_fused.linear_cross_entropy`` -> :func:`linear_cross_entropy` below; verl's
  code still gathers the SP hidden states, picks the weight and builds its outputs;
- the call sites around it and verl's engine hooks, :mod:`mcore_ppo.integrations.verl.engine`:
  the model's ``config.sequence_parallel`` (which decides the TP reduction of ``d_hidden``),
  ``calculate_entropy`` and per-sample temperatures reach the head, and an engine whose fused
  path is off says so (WARNING, naming the verl setting) at its first forward;
- verl's logits-only micro-batch outputs on the fused path: ``calculate_sum_pi_squared`` (verl
  refuses it there) and top-k distillation (``distillation_use_topk``, ``distillation_only``;
  verl drops them there), :mod:`mcore_ppo.integrations.verl.step_outputs` and
  :mod:`mcore_ppo.integrations.verl.distill_topk`.

``model_forward_1f1b_overlap`` (not called by verl 0.9.1 or main) keeps verl's own kernel: its
call runs later, from a schedule plan, where no wrapper can say what the model's SP setting is.
verl's FSDP models import the kernel inside their functions and are not touched.

Switching it on (off unless asked):

- verl loads every entry point of the ``verl.plugins`` group when ``verl`` is imported, in every
  Ray worker; this module is one (``pyproject.toml``). Loaded so, it switches on only with
  ``MCORE_PPO_VERL=1`` in the workers' environment (verl config:
  ``+ray_kwargs.ray_init.runtime_env.env_vars.MCORE_PPO_VERL=1``).
- ``VERL_USE_EXTERNAL_MODULES=mcore_ppo.integrations.verl`` (how verl <= 0.8 loads external
  code, and still honoured) names this module, which is asking: it switches on unless
  ``MCORE_PPO_VERL=0``.
- ``MCORE_PPO_VERL=0`` keeps it off in both cases; :func:`install` / :func:`uninstall` do it
  from code. ``MCORE_PPO_VERL_BACKEND`` picks the head's backend (default ``auto``), and
  ``MCORE_PPO_VERL_PRECISION`` how it multiplies an fp32 weight (unset: ``fp32_faithful`` for
  an fp32 weight, three fp16 products per product on the triton backend; ``ieee``; ``auto``: IEEE; docs/kernels.md).
- ``MCORE_PPO_VERL_MTP=1`` (off by default) keeps verl's fused path on with multi-token
  prediction, which verl turns off: :mod:`mcore_ppo.integrations.verl.mtp`.

It logs on the ``mcore_ppo`` logger: "installed" when switched on, "on" (INFO) once the head has
actually run for verl, a WARNING when verl's engine runs its non-fused path instead.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from mcore_ppo.integrations.import_hook import (
    AfterImportHook,
    backend_from_environment,
    head_backend_from_environment,
    precision_from_environment,
)
from mcore_ppo.integrations.verl.engine import WRAPPERS, current_call_site
from mcore_ppo.integrations.verl.step_outputs import current_collector
from mcore_ppo.logs import log_once, logger

__all__ = [
    "ENV_BACKEND",
    "ENV_PRECISION",
    "ENV_SWITCH",
    "TARGET_MODULES",
    "install",
    "is_installed",
    "linear_cross_entropy",
    "uninstall",
]

ENV_SWITCH = "MCORE_PPO_VERL"
ENV_BACKEND = "MCORE_PPO_VERL_BACKEND"
ENV_PRECISION = "MCORE_PPO_VERL_PRECISION"
# verl's module that binds its kernel at import time, and the name it binds it to.
KERNEL_MODULE = "verl.models.mcore.model_forward_fused"
BOUND_NAME = "linear_cross_entropy"
# Every module the import hook patches: the kernel's and the call sites' (engine.WRAPPERS).
TARGET_MODULES = tuple(dict.fromkeys((KERNEL_MODULE, *WRAPPERS)))
# Set on every replacement: the verl function it replaced (uninstall puts it back).
_ORIGINAL_ATTR = "__mcore_ppo_original__"

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
_LOCK = threading.RLock()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | None = 1.0,
    reduction: str | None = "none",
    dist_process_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """verl's ``linear_cross_entropy`` (same signature, outputs and flattening) on the fused head.

    Beyond verl's kernel, from the wrapped verl call site it runs in
    (:mod:`mcore_ppo.integrations.verl.engine`):

    - ``d_hidden`` is complete over TP: with the model's ``config.sequence_parallel`` on, verl
      gathered ``hidden`` with Megatron's SP all-gather, whose backward reduce-scatters (sums)
      over TP, so the head returns the partial as verl's kernel does; with it off nothing in
      verl sums the vocab shards' partials (verl's kernel leaves them incomplete), so the head
      all-reduces them.
    - verl's ``calculate_entropy=False`` skips the entropy (returned as None, which verl then
      does not read), and a per-sample temperature applies token by token.

    Raises:
        RuntimeError: called with TP > 1 and a gradient to compute outside verl's wrapped call
            sites, where the SP setting, and so the reduction ``d_hidden`` needs, is unknown.
    """
    from mcore_ppo.backends import backend_precision
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy as compat_linear_cross_entropy

    site = current_call_site()
    tp = 1 if dist_process_group is None else torch.distributed.get_world_size(dist_process_group)
    backward = torch.is_grad_enabled() and hidden.requires_grad
    sequence_parallel = None if site is None else site.sequence_parallel
    if tp > 1 and backward and sequence_parallel is None:
        raise RuntimeError(
            "mcore_ppo verl plugin: linear_cross_entropy was called with TP > 1 and a gradient outside verl's "
            "fused_output_processor / _fused_GPTModel_forward (the calls the plugin wraps), so whether the model "
            "runs sequence parallelism, and so how d_hidden must be reduced over TP, is unknown. Call it through "
            "verl's fused forward, or call mcore_ppo.integrations.verl.kernel.linear_cross_entropy with "
            "reduce_hidden_grad=not model.config.sequence_parallel"
        )
    reduce_here = tp > 1 and backward and not sequence_parallel
    extra: dict[str, Any] = {}
    if site is not None and site.temperature is not None:
        temperature = site.temperature  # per token; verl's call passed a placeholder float
    if site is not None and not site.return_entropy:
        extra["return_entropy"] = False
    backend = head_backend_from_environment(ENV_BACKEND, ENV_PRECISION, weight)
    collector = current_collector()
    if collector is not None and collector.wants_head_outputs and reduction in (None, "none"):
        # verl's micro-batch asked for Σπ² or top-k distillation: the same call, more outputs.
        outputs = collector.run_head(
            hidden, weight, labels, temperature, dist_process_group, reduce_hidden_grad=reduce_here,
            return_entropy=site is None or site.return_entropy, backend=backend,
        )  # fmt: skip
    else:
        outputs = compat_linear_cross_entropy(
            hidden,
            weight,
            labels,
            temperature,
            reduction,
            dist_process_group,
            backend=backend,
            reduce_hidden_grad=reduce_here,
            **extra,
        )
    # Keyed by the pass too: a forward-only pass needs no TP reduction, a training pass's is the
    # decision worth seeing, and the first pass is often forward-only (verl's old log-probs).
    log_once(
        logging.INFO,
        ("verl-on", backend, tp, sequence_parallel, backward),
        "mcore_ppo verl plugin: on: verl's fused log-prob/entropy path ran on the head (backend=%r%s, TP %d, %s pass: "
        "%s, called from %s)",
        backend if isinstance(backend, str) else backend.name,
        "" if isinstance(backend, str) else f", precision {backend_precision(backend)}",
        tp,
        "training" if backward else "forward-only",
        "no TP reduction needed"
        if tp == 1 or not backward
        else "sequence parallel: d_hidden summed by verl's SP gather"
        if sequence_parallel
        else "no sequence parallelism: d_hidden all-reduced over TP by the head",
        site.where if site is not None else "outside verl's wrapped call sites",
    )
    return outputs


# ---------------------------------------------------------------------------------------------
# Patching verl's modules
# ---------------------------------------------------------------------------------------------


def _replacements(module: ModuleType) -> list[tuple[str, Callable[[Any], Any]]]:
    """(attribute path, factory of the replacement given verl's original) for ``module``."""
    found: list[tuple[str, Callable[[Any], Any]]] = []
    if module.__name__ == KERNEL_MODULE:
        found.append((BOUND_NAME, lambda original: linear_cross_entropy))
    found.extend(WRAPPERS.get(module.__name__, ()))
    return found


def _resolve(module: ModuleType, path: str) -> tuple[Any, str]:
    owner: Any = module
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
    return owner, name


def _current(owner: Any, name: str) -> Any:
    """``owner.name``; for a class only its own attribute (a subclass's override is its own target)."""
    if owner is None:
        return None
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def _patch(module: ModuleType) -> None:
    """Replace verl's functions in ``module`` (once each; the originals are kept on the replacements)."""
    for path, make in _replacements(module):
        owner, name = _resolve(module, path)
        current = _current(owner, name)
        if current is None:
            log_once(
                logging.WARNING,
                ("verl-missing", module.__name__, path),
                "mcore_ppo verl plugin: %s has no %s (a verl version this plugin does not know); left as it is",
                module.__name__,
                path,
            )
            continue
        if hasattr(current, _ORIGINAL_ATTR) or current is linear_cross_entropy:
            continue  # already ours (e.g. the registry imported the wrapped function)
        with _LOCK:
            replacement = make(current)
            if replacement is linear_cross_entropy:
                _KERNEL_ORIGINALS[module.__name__] = current
            else:
                setattr(replacement, _ORIGINAL_ATTR, current)
            setattr(owner, name, replacement)
        logger.debug("mcore_ppo verl plugin: %s.%s replaced", module.__name__, path)


def _unpatch(module: ModuleType) -> None:
    for path, _make in _replacements(module):
        owner, name = _resolve(module, path)
        current = _current(owner, name)
        if current is linear_cross_entropy and module.__name__ in _KERNEL_ORIGINALS:
            setattr(owner, name, _KERNEL_ORIGINALS.pop(module.__name__))
        elif current is not None and hasattr(current, _ORIGINAL_ATTR):
            setattr(owner, name, getattr(current, _ORIGINAL_ATTR))


# verl's kernel per module it was replaced in (linear_cross_entropy is one shared function, so
# the original cannot be kept on it).
_KERNEL_ORIGINALS: dict[str, Callable[..., Any]] = {}


# Modules imported after switching on are patched as they load.
_HOOK = AfterImportHook(TARGET_MODULES, _patch)


def install() -> None:
    """Route verl's Megatron fused path to the head (idempotent; see the module doc).

    Modules already imported are patched now; the others when verl imports them.

    Raises:
        ValueError: ``MCORE_PPO_VERL_BACKEND`` is not a backend name, or
            ``MCORE_PPO_VERL_PRECISION`` not a precision.
    """
    backend = backend_from_environment(ENV_BACKEND)
    precision_from_environment(ENV_PRECISION)
    with _LOCK:
        loaded = _HOOK.install()
    log_once(
        logging.INFO,
        ("verl-install", backend),
        "mcore_ppo verl plugin: installed (backend=%r): %s patched now, the rest when imported; it runs once verl's "
        "Megatron engine takes its fused path (actor_rollout_ref.model.use_fused_kernels=True)",
        backend,
        ", ".join(m.__name__ for m in loaded) or "no verl module",
    )


def uninstall() -> None:
    """Give verl's modules their own functions back and remove the import hook."""
    with _LOCK:
        _HOOK.remove()
        for name in TARGET_MODULES:
            if name in sys.modules:
                _unpatch(sys.modules[name])
    logger.info("mcore_ppo verl plugin: off; verl's own functions restored")


def is_installed() -> bool:
    """Whether the plugin is on (the import hook is in place)."""
    return _HOOK.installed


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
