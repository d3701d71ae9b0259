"""The library's logger, ``logging.getLogger("mcore_ppo")``, and its one-line-per-decision rule.

The head runs once per micro-batch, often thousands of times a run, on every rank. What a user
needs from its log is *which* decisions were taken (the backend a configuration resolved to,
the triton probability buffer on or off and why, a fallback and its reason, an integration
switched on), not that they were taken again. :func:`log_once` logs a message the first time
its key is seen in this process and never again, so nothing is logged per call. The library
adds no handler (the application configures logging); ``MCORE_PPO_LOG_LEVEL`` (e.g. ``INFO``,
``DEBUG``) sets this logger's level where the application does not, for a quick look.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable

import torch

logger = logging.getLogger("mcore_ppo")
if os.environ.get("MCORE_PPO_LOG_LEVEL"):
    logger.setLevel(os.environ["MCORE_PPO_LOG_LEVEL"].strip().upper())

# Keys already logged. Decisions are few (a handful per backend and configuration), so the set
# stays small; the cap only guards against a caller keying on per-call values by mistake.
_SEEN: set[Hashable] = set()
_SEEN_CAP = 4096


def log_once(level: int, key: Hashable, message: str, *args: object) -> bool:
    """Log ``message % args`` at ``level`` the first time ``key`` is seen; True when it logged.

    ``key`` names the decision (e.g. ``("backend", "auto", "cuda", "triton")``); keep per-call
    values such as token counts out of it and in ``args`` instead. Nothing is logged while
    ``torch.compile`` traces (a log call would break its graph): the decision is logged by the
    next call made outside a compiled region, if any. No lock: two threads meeting a new key at
    once may both log it, which costs a duplicate line, not a wrong one.
    """
    if key in _SEEN or len(_SEEN) >= _SEEN_CAP or torch.compiler.is_compiling():
        return False
    _SEEN.add(key)
    logger.log(level, message, *args)
    return True


def forget_logged() -> None:
    """Forget every key, so each decision is logged again once (tests; a new phase of a run)."""
    _SEEN.clear()


__all__ = ["forget_logged", "log_once", "logger"]
