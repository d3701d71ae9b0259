"""What a ``main_ppo`` run on the CPU leaves for its test: head calls per rank, per-token log-probs.

With ``MCORE_PPO_VERL_RECORD_DIR`` set in the run's environment:

- every process that runs the head counts its passes (:func:`count_head_passes`): forwards
  without a gradient (verl's log-prob pass), forwards that record one (the update's
  micro-batches) and backwards, written after each to ``head_calls.<pid>.json`` with the
  process's ``RANK``. The counter wraps what the head's ops run (``mcore_ppo.shard.forward`` and
  ``backward``), so it counts what ran on the head whatever verl's route to it was.
- the trainer saves each step's batch after verl's log-prob pass (:func:`record_old_log_probs`):
  the responses, their mask, verl's ``old_log_probs``, entropy and (when asked) Σπ², and the
  rollout's fp32 log-probs of the same tokens, to ``old_log_probs.step<N>.pt``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["RECORD_DIR", "count_head_passes", "read_head_calls", "record_old_log_probs"]

RECORD_DIR = "MCORE_PPO_VERL_RECORD_DIR"


def _record_dir() -> Path | None:
    folder = os.environ.get(RECORD_DIR)
    return Path(folder) if folder else None


def count_head_passes(shard_module: Any) -> None:
    """Wrap the head's forward and backward in ``mcore_ppo.shard`` with per-process counters."""
    folder = _record_dir()
    if folder is None or getattr(shard_module, "_mcore_ppo_counted", False):
        return
    counts = {"rank": int(os.environ.get("RANK", "-1")), "forward_no_grad": 0, "forward_grad": 0, "backward": 0}
    path = folder / f"head_calls.{os.getpid()}.json"

    def bump(key: str) -> None:
        counts[key] += 1
        path.write_text(json.dumps(counts))

    forward, backward = shard_module.forward, shard_module.backward

    @functools.wraps(forward)
    def counted_forward(*args, grad_needed: bool, **kwargs):
        bump("forward_grad" if grad_needed else "forward_no_grad")
        return forward(*args, grad_needed=grad_needed, **kwargs)

    @functools.wraps(backward)
    def counted_backward(*args, **kwargs):
        bump("backward")
        return backward(*args, **kwargs)

    shard_module.forward = counted_forward
    shard_module.backward = counted_backward
    shard_module._mcore_ppo_counted = True


def read_head_calls(folder: Path) -> list[dict[str, int]]:
    """Every process's head counters in ``folder`` (one dict per process that ran the head)."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("head_calls.*.json"))]


def record_old_log_probs(trainer_module: Any) -> None:
    """Wrap ``RayPPOTrainer._compute_old_log_prob`` so each step's log-probs are saved."""
    folder = _record_dir()
    trainer_class = trainer_module.RayPPOTrainer
    if folder is None or getattr(trainer_class, "_mcore_ppo_recorded", False):
        return
    compute = trainer_class._compute_old_log_prob

    @functools.wraps(compute)
    def recorded(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = compute(self, batch, *args, **kwargs)
        old = result[0] if isinstance(result, tuple) else result
        fields = {
            key: batch.batch[key] for key in ("responses", "response_mask", "rollout_log_probs") if key in batch.batch
        }
        fields.update({k: old.batch[k] for k in ("old_log_probs", "entropys", "sum_pi_squared") if k in old.batch})
        torch.save(
            {k: v.detach().cpu().clone() for k, v in fields.items()},
            folder / f"old_log_probs.step{self.global_steps}.pt",
        )
        return result

    trainer_class._compute_old_log_prob = recorded
    trainer_class._mcore_ppo_recorded = True
