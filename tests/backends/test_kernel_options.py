"""The Triton kernels' option flags, at the backend's level: ``ROW_TEMP`` (1/T read per row from
a vector; a per-token temperature) and ``U_PLANE = 0`` / ``HAS_E`` off (the entropy off).

Under Triton's CPU interpreter on tiny odd shapes (fp32), as ``test_triton_backend.py``. The
per-row statistics and gradients match the torch backend given the same ``[n]`` temperature
vector (to fp32 rounding); the entropy off leaves ``m``, ``s``, ``y`` and the probability buffer
bit for bit as they are with it, and returns no ``u`` plane.
"""

from __future__ import annotations

import os

import pytest
import torch

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
import mcore_ppo.kernels  # noqa: E402,F401  (decorated now, under the interpreter on CPU)
from mcore_ppo.backends.base import GradientRequest, SavedTokens  # noqa: E402
from mcore_ppo.backends.torch_backend import TorchBackend  # noqa: E402
from mcore_ppo.statistics import DEFAULT, Statistics  # noqa: E402
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close  # noqa: E402
from mcore_ppo_testing.seeds import generator, next_seed  # noqa: E402

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _case(n=21, h=16, v=45):
    gen = generator(next_seed())
    hidden = torch.randn(n, h, generator=gen).to(DEVICE)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(DEVICE)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = IGNORE_INDEX
    labels = labels.to(DEVICE)
    valid = labels != IGNORE_INDEX
    local = torch.where(valid, labels, -1)
    temperature = (0.3 + 2.0 * torch.rand(n, generator=gen)).to(DEVICE)
    g, e = torch.randn(n, generator=gen).to(DEVICE), torch.randn(n, generator=gen).to(DEVICE)
    return hidden, weight, local, valid, temperature, g, e


def _kernels(budget: int) -> triton_backend.TritonBackend:
    """The triton backend with this buffer budget, on its kernels' own dots for fp32 CUDA operands
    too (their default IEEE route is cuBLAS's, the torch backend's pass)."""
    return triton_backend.TritonBackend(triton_backend.TritonConfig(buffer_budget_bytes=budget, ieee_gemms="kernels"))


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["recompute", "buffer"])
def test_row_temperature_statistics_and_gradients_match_torch(budget):
    hidden, weight, local, valid, temperature, g, e = _case()
    ours, oracle = _kernels(budget), TorchBackend()
    stats = ours.shard_statistics(hidden, weight, local, valid, temperature, grad_needed=True, statistics=DEFAULT)
    want = oracle.shard_statistics(hidden, weight, local, valid, temperature, grad_needed=False, statistics=DEFAULT)
    assert bool(stats.residual) == bool(budget)
    planes = ("m", "s", "u", "y")
    for name, got, exp in zip(planes, _planes(stats), _planes(want), strict=True):
        assert_close(got[valid].cpu(), exp[valid].cpu(), name=f"stat_{name}", dtype=torch.float32, rtol=2e-6, atol=1e-6)
    lse, values = DEFAULT.finish(want.m, want.sums)
    entropy = values["entropy"]
    grads = []
    for backend, residual in ((ours, stats.residual), (oracle, ())):
        saved = SavedTokens(local, valid, lse, entropy, residual)
        request = GradientRequest(g, e, True, torch.zeros_like(weight))
        grads.append(backend.shard_gradients(hidden, weight, saved, request, temperature=temperature))
    for name, got, exp in zip(("d_hidden", "d_weight"), grads[0], grads[1], strict=True):
        assert_close(got.float().cpu(), exp.cpu(), name=name, dtype=torch.float32, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["recompute", "buffer"])
@pytest.mark.parametrize("per_token", [False, True], ids=["T-float", "T-tensor"])
def test_entropy_off_keeps_m_s_y_and_buffer(budget, per_token):
    hidden, weight, local, valid, temperature, g, _ = _case()
    t = temperature if per_token else 0.8
    ours = _kernels(budget)
    on = ours.shard_statistics(hidden, weight, local, valid, t, grad_needed=True, statistics=DEFAULT)
    off = ours.shard_statistics(hidden, weight, local, valid, t, grad_needed=True, statistics=Statistics.named([]))
    assert off.sums.shape[0] == 1 and on.sums.shape[0] == 2
    for name, a, b in (("m", on.m, off.m), ("s", on.sums[0], off.sums[0]), ("y", on.y, off.y)):
        assert torch.equal(a, b), name
    if budget:
        (probs_on, tile_max_on, *_), (probs_off, tile_max_off, *_) = on.residual, off.residual
        assert torch.equal(probs_on[: int(valid.sum())], probs_off[: int(valid.sum())])
        assert torch.equal(tile_max_on[: int(valid.sum())], tile_max_off[: int(valid.sum())])
    # The backward without the entropy (HAS_E off) from the entropy-off forward's residual equals
    # the one from the entropy-on forward with no entropy gradient.
    lse, values = DEFAULT.finish(on.m, on.sums)
    entropy = values["entropy"]
    results = []
    for stats, ent in ((on, entropy), (off, None)):
        saved = SavedTokens(local, valid, lse, ent, stats.residual)
        request = GradientRequest(g, None, True, torch.zeros_like(weight))
        results.append(ours.shard_gradients(hidden, weight, saved, request, temperature=t))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _planes(stats) -> tuple[torch.Tensor, ...]:
    """``(m, s, u, y)`` of default statistics."""
    return stats.m, *stats.sums.unbind(0), stats.y


def test_merge_splits_without_u():
    from mcore_ppo.backends.triton_host import compact_rows, merge_options, merge_splits
    from mcore_ppo.backends.triton_launch import Launcher

    gen = generator(next_seed())
    n, splits = 70, 5
    parts = torch.randn(3, splits, n, generator=gen).to(DEVICE)
    parts[1] = parts[1].abs() + 0.1
    valid = (torch.rand(n, generator=gen) < 0.8).to(DEVICE)
    launch = Launcher().bound()
    perm, count = compact_rows(valid, launch)
    m, *sums = merge_splits(parts, perm, count, launch, options=merge_options(DEFAULT))
    m2, *sums2 = merge_splits(parts[:2].contiguous(), perm, count, launch, options=merge_options(Statistics.named([])))
    assert len(sums) == 2 and len(sums2) == 1 and sums[0].shape == (n,)
    assert torch.equal(m, m2) and torch.equal(sums[0], sums2[0])
