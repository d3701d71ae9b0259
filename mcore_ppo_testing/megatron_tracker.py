"""Megatron's process-wide loss trackers, reset between tests.

``megatron.core.transformer.multi_token_prediction.MTPLossLoggingHelper.tracker`` is a dict on
the class, filled on the first MTP forward with tensors of the model's MTP depth and indexed by
layer number afterwards: a second model with more MTP layers in the same process fails with an
IndexError inside Megatron. Tests clear it (``tests/conftest.py``); Megatron refills it lazily.
"""

from __future__ import annotations

import sys

_MTP_MODULE = "megatron.core.transformer.multi_token_prediction"


def clear_mtp_tracker() -> None:
    """Empty Megatron's MTP loss tracker, if Megatron's MTP module is loaded (never imports it)."""
    helper = getattr(sys.modules.get(_MTP_MODULE), "MTPLossLoggingHelper", None)
    tracker = getattr(helper, "tracker", None)
    if isinstance(tracker, dict):
        tracker.clear()
