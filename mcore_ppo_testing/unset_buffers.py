"""Unfilled weight-gradient buffers made visible: ``d_W`` buffers handed to a backend unzeroed
(``GradientRequest.weight_grad_unset``) start as NaN, so a row the backend failed to write shows
in the gradient instead of passing as whatever memory held (often zeros on the CPU)."""

from __future__ import annotations


def nan_filled_unset_buffers(monkeypatch) -> list[bool]:
    """From now on every ``d_W`` buffer of the head that is handed over unset is NaN-filled
    first. Returns the ``unset`` flag of every buffer made (the list grows)."""
    from mcore_ppo import shard

    made: list[bool] = []
    original = shard.weight_grad_buffer

    def nan_filled(*args, **kwargs):
        buffer, unset = original(*args, **kwargs)
        if unset:
            buffer.fill_(float("nan"))
        made.append(unset)
        return buffer, unset

    monkeypatch.setattr(shard, "weight_grad_buffer", nan_filled)
    return made
