"""Instrumentation of the one-hot fold of ``k`` ids per token on the triton backend (labels
``[..., k]``), for the single-rank, multi-rank and GPU tests: which ``dz`` buffers or vocab
chunks received the one-hot gradients."""

from __future__ import annotations


def record_folds(monkeypatch) -> list[tuple[int, int]]:
    """The ``(v0, vc)`` of every one-hot add into a ``dz`` chunk from now on (the list grows as
    the backend adds)."""
    from mcore_ppo.backends import triton_gradients

    calls: list[tuple[int, int]] = []
    add = triton_gradients.add_onehot

    def recorded(config, launch, dz, onehot, v0, vc):
        calls.append((v0, vc))
        add(config, launch, dz, onehot, v0, vc)

    monkeypatch.setattr(triton_gradients, "add_onehot", recorded)
    return calls
