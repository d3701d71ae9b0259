"""Instrumentation of the student's one-hot fold (``mcore_ppo.fused_log_probs_at`` on the triton
backend) for the single-rank, multi-rank and GPU tests: which ``dz`` chunks received the one-hot
gradients, and a refusal of the torch sparse path where the fold must run instead."""

from __future__ import annotations


def record_folds(monkeypatch) -> list[tuple[int, int]]:
    """The ``(v0, vc)`` of every one-hot add into a ``dz`` chunk from now on (the list grows as
    the backend adds)."""
    from mcore_ppo.backends import triton_backend

    calls: list[tuple[int, int]] = []
    add = triton_backend._add_onehot

    def recorded(dz, onehot, v0, vc):
        calls.append((v0, vc))
        add(dz, onehot, v0, vc)

    monkeypatch.setattr(triton_backend, "_add_onehot", recorded)
    return calls


def refuse_sparse_torch(monkeypatch) -> None:
    """From now on the student's torch sparse path raises: only the fold may compute the one-hot
    gradients."""
    from mcore_ppo.distill import student as student_module

    def refused(*args, **kwargs):
        raise AssertionError("the torch sparse path ran where the fold should have")

    monkeypatch.setattr(student_module, "_add_sparse_torch", refused)
