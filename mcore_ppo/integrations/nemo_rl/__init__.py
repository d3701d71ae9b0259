"""NeMo-RL: its Megatron fused log-prob path on the fused head, NeMo-RL unedited.

Two parts:

- :func:`from_parallel_hidden_states_to_logprobs` (:mod:`.adapter`): NeMo-RL's hidden-states
  call with everything its logits path has (TP with or without SP, CP, packed sequences,
  temperature, entropy), for code that calls it itself.
- :func:`enable` / :func:`disable`: NeMo-RL's own fused path (``policy.megatron_cfg.
  use_fused_linear_logprobs=true``) runs on the head. NeMo-RL's patched ``GPTModel.forward``
  (``nemo_rl.distributed.model_utils._gpt_forward_with_linear_ce_fusion``) looks up
  ``from_parallel_hidden_states_to_logprobs`` in its module's globals at call time, and
  ``nemo_rl.models.megatron.train.megatron_forward_backward`` looks up
  ``forward_with_post_processing_fn`` the same way; nothing imports either by name elsewhere
  (NVIDIA-NeMo/RL at 7ea279ab and v0.7.0). :func:`enable` rebinds those two module attributes,
  at once where the module is imported, else from an import hook right after it executes:
  the first to :func:`.fused.fused_hidden_states_to_logprobs`, the second to a wrapper that
  tells it the step's temperature (:mod:`.fused` says why it needs it).

Switching it on in NeMo-RL's Ray workers (processes NeMo-RL starts; no plugin entry point
exists there): NeMo-RL forwards the driver's whole environment to its workers, so
``MCORE_PPO_NEMO_RL=1`` exported where the job starts reaches them; a ``.pth`` file in the
workers' Python environment (:func:`install_pth`, once per environment) reads it at interpreter
start and calls :func:`activate_from_environment`. Without the variable the ``.pth`` line costs
one ``os.environ`` lookup. In a single process (a script that builds the model itself),
:func:`enable` is enough. ``MCORE_PPO_NEMO_RL_BACKEND`` picks the head's backend (default
``auto``).

This module imports only the standard library (the ``.pth`` line imports it in every
interpreter of that environment when switched on); torch and the head load when NeMo-RL's
modules are rebound or the adapter is used.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mcore_ppo.integrations.import_hook import AfterImportHook, backend_from_environment, precision_from_environment

if TYPE_CHECKING:
    from mcore_ppo.integrations.nemo_rl.adapter import from_parallel_hidden_states_to_logprobs

__all__ = [
    "ENV_BACKEND",
    "ENV_PRECISION",
    "ENV_SWITCH",
    "PTH_NAME",
    "TARGETS",
    "activate_from_environment",
    "disable",
    "enable",
    "from_parallel_hidden_states_to_logprobs",
    "install_pth",
    "is_enabled",
    "pth_line",
]

ENV_SWITCH = "MCORE_PPO_NEMO_RL"
ENV_BACKEND = "MCORE_PPO_NEMO_RL_BACKEND"
ENV_PRECISION = "MCORE_PPO_NEMO_RL_PRECISION"
PTH_NAME = "mcore_ppo_nemo_rl.pth"
# NeMo-RL module -> the module-level name this rebinds there (both looked up at call time).
TARGETS = {
    "nemo_rl.distributed.model_utils": "from_parallel_hidden_states_to_logprobs",
    "nemo_rl.models.megatron.train": "forward_with_post_processing_fn",
}
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

_logger = logging.getLogger("mcore_ppo")
_LOCK = threading.RLock()
_ORIGINALS: dict[str, Any] = {}  # module name -> NeMo-RL's object this replaced
_REPLACEMENTS: dict[str, Any] = {}  # module name -> what is bound there now


def __getattr__(name: str) -> Any:
    # The adapter imports torch and the head: loaded on first use, not by the .pth line.
    if name == "from_parallel_hidden_states_to_logprobs":
        from mcore_ppo.integrations.nemo_rl.adapter import from_parallel_hidden_states_to_logprobs

        globals()[name] = from_parallel_hidden_states_to_logprobs
        return from_parallel_hidden_states_to_logprobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _replacement(module_name: str, original: Any) -> Any:
    from mcore_ppo.integrations.nemo_rl import fused

    if module_name == "nemo_rl.distributed.model_utils":
        return fused.fused_hidden_states_to_logprobs
    return fused.with_step_temperature(original)


def _rebind(module: ModuleType) -> None:
    """Point the module's target name at the head's version (once; NeMo-RL's is kept)."""
    name, attribute = module.__name__, TARGETS[module.__name__]
    with _LOCK:
        current = getattr(module, attribute, None)
        if current is not None and current is _REPLACEMENTS.get(name):
            return
        if not callable(current):
            _logger.warning(
                "mcore_ppo NeMo-RL integration: %s has no function %s (a NeMo-RL version this integration does "
                "not know); left as it is%s",
                name,
                attribute,
                ": the fused log-probs would miss the temperature" if attribute.startswith("forward_") else "",
            )
            return
        replacement = _replacement(name, current)
        _ORIGINALS[name], _REPLACEMENTS[name] = current, replacement
        setattr(module, attribute, replacement)
    _logger.info("mcore_ppo NeMo-RL integration: %s.%s -> %s", name, attribute, replacement.__qualname__)


# Modules imported after switching on are patched as they load.
_HOOK = AfterImportHook(TARGETS, _rebind)


def enable() -> None:
    """Route NeMo-RL's Megatron fused log-prob path to the head, in this process (idempotent).

    NeMo-RL's modules already imported are rebound now, the others when they are imported.

    Raises:
        ValueError: ``MCORE_PPO_NEMO_RL_BACKEND`` is not a backend name, or
            ``MCORE_PPO_NEMO_RL_PRECISION`` not a precision (:data:`mcore_ppo.numerics.PRECISIONS`;
            unset, NeMo-RL's fp32 LM head, an fp32 weight, runs ``fp32_faithful``).
    """
    backend = backend_from_environment(ENV_BACKEND)
    precision_from_environment(ENV_PRECISION)
    with _LOCK:
        loaded = _HOOK.install()
    _logger.info(
        "mcore_ppo NeMo-RL integration: on (backend=%r); NeMo-RL's fused log-prob path runs on the fused head: "
        "%s rebound now, the rest when imported",
        backend,
        ", ".join(m.__name__ for m in loaded) or "none",
    )


def disable() -> None:
    """Give NeMo-RL's modules their own functions back and remove the import hook (idempotent)."""
    with _LOCK:
        _HOOK.remove()
        for name, original in list(_ORIGINALS.items()):
            module = sys.modules.get(name)
            if module is not None and getattr(module, TARGETS[name], None) is _REPLACEMENTS[name]:
                setattr(module, TARGETS[name], original)
            del _ORIGINALS[name], _REPLACEMENTS[name]
    _logger.info("mcore_ppo NeMo-RL integration: off; NeMo-RL's own functions restored")


def is_enabled() -> bool:
    """Whether :func:`enable` is in force (the import hook is in place)."""
    return _HOOK.installed


def activate_from_environment() -> bool:
    """:func:`enable` if ``MCORE_PPO_NEMO_RL`` says on (``1``/``true``/``on``/``yes``); True when it did.

    What the ``.pth`` line calls. An unknown value logs a warning and stays off; a failure to
    switch on is logged and raised (at interpreter start Python prints it and goes on).
    """
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch not in _ON:
        if switch and switch not in _OFF:
            _logger.warning(
                "mcore_ppo NeMo-RL integration: %s=%r is not one of %s; staying off", ENV_SWITCH, switch, _ON + _OFF
            )
        return False
    try:
        enable()
    except Exception:
        _logger.exception("mcore_ppo NeMo-RL integration: switching on failed")
        raise
    return True


def pth_line() -> str:
    """The ``.pth`` line: checks the variable itself, so an interpreter without it imports nothing."""
    return (
        f"import os; os.environ.get({ENV_SWITCH!r}, '').strip().lower() in {_ON!r} and "
        f"__import__('importlib').import_module({__name__!r}).activate_from_environment()\n"
    )


def install_pth(site_packages: str | os.PathLike[str] | None = None) -> Path:
    """Write :data:`PTH_NAME` (:func:`pth_line`) into ``site_packages`` and return its path.

    Args:
        site_packages: the ``site-packages`` folder of the Python environment NeMo-RL's Megatron
            workers run in; None: this interpreter's (``sysconfig``'s ``purelib``). Run it with
            the workers' interpreter, or pass their folder. Deleting the file undoes it.

    Raises:
        ValueError: ``site_packages`` is not an existing folder.
    """
    folder = Path(site_packages if site_packages is not None else sysconfig.get_paths()["purelib"])
    if not folder.is_dir():
        raise ValueError(f"site_packages must be an existing folder, got {str(folder)!r}")
    path = folder / PTH_NAME
    path.write_text(pth_line())
    return path
