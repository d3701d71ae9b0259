"""Host work per head call, counted: aten ops and kernel launches of the triton backend.

The host time of a call is mostly its number of small torch ops and Triton launches (each costs
microseconds of Python and dispatch, whatever the tensor sizes). Timing them would flake; their
number does not. At fixed shapes these tests count, for a no-grad forward, a forward that keeps
a backward, and the backward, every aten op the host issues (a ``TorchDispatchMode``; the ops
Triton's CPU interpreter runs inside a launch are not the host's and are left out) and every
launch (the backend's :class:`~mcore_ppo.backends.triton_launch.Launcher` counts them), and hold
them to upper bounds. Every backend here checks each launch site's key against Triton's own
specialisation of the arguments (:class:`mcore_ppo_testing.launch_checks.CheckedLauncher`).

They also check that the fused forward (``head_forward``: labels prepared and outputs finished
inside the kernels) equals the generic path over ``shard_statistics`` (to the last bit of the
interpreter's ``log``), and the fp64 reference, including ignored tokens, out-of-range labels
(NaN with ``validate=False``), the entropy off and a per-token temperature (the TP branch:
``tests/backends/test_triton_backend.py``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
import mcore_ppo.kernels as kernels  # noqa: E402  (decorated now, under the interpreter on CPU)
from mcore_ppo import fused_log_probs_and_entropy  # noqa: E402
from mcore_ppo import ops as head_ops  # noqa: E402
from mcore_ppo.backends import triton_config  # noqa: E402
from mcore_ppo_testing.launch_checks import CheckedLauncher  # noqa: E402
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, reference  # noqa: E402
from mcore_ppo_testing.seeds import generator, next_seed  # noqa: E402

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = [name for name in kernels.__all__ if name.endswith("_kernel")]
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="counts of the CPU interpreter's configs")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The interpreter on."""
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MCORE_PPO_BUFFER_BUDGET_BYTES", raising=False)


# The head's own ops, whose implementations (Python) issue the aten ops counted here.
_HEAD_OPS = {torch.ops.mcore_ppo.head_forward.default: head_ops._head_forward,
             torch.ops.mcore_ppo.head_backward.default: head_ops._head_backward}  # fmt: skip


class _Counting(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, except inside a kernel launch; the
    head's own ops are entered (their implementations' aten ops are counted)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        implementation = _HEAD_OPS.get(func)
        if implementation is not None:
            with self:
                return implementation(*args, **(kwargs or {}))
        if not self.inside_kernel:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counting(monkeypatch):
    """``measure(fn, backend) -> (aten ops, launches)`` of one call of ``fn`` (the launches
    through ``backend``'s launcher)."""
    mode = _Counting()
    for name in KERNELS:
        kernel = getattr(kernels, name)
        original = kernel.run

        def run(*args, _original=original, **kwargs):
            mode.inside_kernel += 1
            try:
                return _original(*args, **kwargs)
            finally:
                mode.inside_kernel -= 1

        monkeypatch.setattr(kernel, "run", run)

    def measure(fn, backend):
        mode.ops.clear()
        before = backend.launcher.launches
        with mode:
            fn()
        return dict(mode.ops), backend.launcher.launches - before

    return measure


def _case(n=37, h=16, v=40, *, dtype=torch.float32, seed=None, ignored=0.3, bad_label=False):
    gen = generator(next_seed() if seed is None else seed)
    hidden = (torch.randn(n, h, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype).to(DEVICE)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = IGNORE_INDEX
    if bad_label:
        labels[1], labels[2] = v + 3, -7
    grads = [torch.randn(n, generator=gen).to(DEVICE) for _ in range(2)]
    return hidden.requires_grad_(True), weight.requires_grad_(True), labels.to(DEVICE), grads


def _backend(*, tma: bool = False, **settings) -> triton_backend.TritonBackend:
    """A triton backend with ``settings`` (:class:`TritonConfig` fields) whose launcher checks
    every site; ``tma``: operands and dz through TMA descriptors (what the H200 runs), in the
    interpreter's small tiles."""
    if tma:
        settings |= {
            "forward_config": replace(triton_config.INTERPRETER_FORWARD, use_tma=True),
            "backward_config": replace(triton_config.INTERPRETER_BACKWARD, use_tma=True),
        }
    return triton_backend.TritonBackend(triton_backend.TritonConfig(**settings), launcher=CheckedLauncher())


# (no-grad forward, forward, backward): most aten ops, launches. The fused forward's ops are its
# allocations only (one of them the op's empty stand-in for the Σπ² output it was not asked for);
# the backward's its buffers and GEMMs (on CPU, fp32 products added separately) and, inside the
# op, the upstream gradients' conversions to fp32 (no-ops for fp32 gradients, still dispatched).
BOUNDS = {
    ("fp32", "recompute"): ((8, 3), (11, 3), (12, 3)),
    ("bf16-tma", "buffer"): ((9, 4), (14, 4), (14, 3)),
}


@pytest.mark.parametrize(("dtype", "mode"), list(BOUNDS), ids=["-".join(k) for k in BOUNDS])
def test_ops_and_launches_per_call(counting, dtype, mode):
    budget = (1 << 30) if mode == "buffer" else 0
    backend = _backend(tma=dtype == "bf16-tma", buffer_budget_bytes=budget)
    torch_dtype = torch.bfloat16 if dtype == "bf16-tma" else torch.float32
    hidden, weight, labels, grads = _case(dtype=torch_dtype, seed=7)

    def call():
        return fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend=backend, validate=False)

    def nograd():
        with torch.no_grad():
            call()

    kept = {}
    for _ in range(2):  # every plan and compile made
        nograd()
        torch.autograd.backward(list(call()), grads)
    counts = [counting(nograd, backend), counting(lambda: kept.setdefault("out", call()), backend)]
    counts.append(counting(lambda: torch.autograd.backward(list(kept.pop("out")), grads), backend))
    for (ops, launches), (max_ops, max_launches), what in zip(
        counts, BOUNDS[(dtype, mode)], ("no-grad forward", "forward", "backward"), strict=True
    ):
        assert sum(ops.values()) <= max_ops, f"{what}: {sum(ops.values())} aten ops > {max_ops}: {ops}"
        assert launches <= max_launches, f"{what}: {launches} launches > {max_launches}"
    # No host sync, no view and no per-token torch arithmetic in the forward: allocations only.
    forward_ops = set(counts[0][0]) | set(counts[1][0])
    assert forward_ops == {"empty.memory_format", "new_empty.default"}, forward_ops


def test_fused_forward_has_fewer_ops_than_the_generic_path(counting):
    hidden, weight, labels, _ = _case(seed=11)
    fused, generic = _backend(), _backend(fused_forward=False)
    assert fused.capabilities.fused_forward and not generic.capabilities.fused_forward

    def nograd(backend):
        with torch.no_grad():
            fused_log_probs_and_entropy(hidden, weight, labels, backend=backend, validate=False)

    nograd(fused)
    fused_ops, fused_launches = counting(lambda: nograd(fused), fused)
    nograd(generic)
    generic_ops, generic_launches = counting(lambda: nograd(generic), generic)
    assert sum(fused_ops.values()) * 2 < sum(generic_ops.values()), (fused_ops, generic_ops)
    assert fused_launches <= generic_launches


def spy_head_forward(monkeypatch, calls: list[bool]) -> None:
    """Every call of ``TritonBackend.head_forward`` appends its backend's ``fused_forward``."""
    original = triton_backend.TritonBackend.head_forward

    def head_forward(self, *args, **kwargs):
        calls.append(self.capabilities.fused_forward)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(triton_backend.TritonBackend, "head_forward", head_forward)


def _run(backend, hidden, weight, labels, temperature, grads, return_entropy, validate):
    h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    logp, ent = fused_log_probs_and_entropy(
        h, w, labels, temperature=temperature, backend=backend, return_entropy=return_entropy, validate=validate
    )
    outs = [logp] if ent is None else [logp, ent]
    torch.autograd.backward(outs, grads[: len(outs)])
    return logp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["recompute", "buffer"])
@pytest.mark.parametrize(
    "options",
    ["default", "bad-labels", "no-entropy", "T-tensor", "vocab-chunks"],
)
def test_fused_forward_equals_generic_path_and_reference(monkeypatch, budget, options):
    hidden, weight, labels, grads = _case(bad_label=options == "bad-labels")
    temperature = 0.8
    if options == "T-tensor":
        temperature = 0.5 + torch.rand(labels.shape[0], generator=generator(next_seed())).to(DEVICE)
    return_entropy = options != "no-entropy"
    validate = options != "bad-labels"
    # "vocab-chunks": a dz workspace of one 32-column chunk, so the recompute runs two chunks.
    settings = {"workspace_bytes": labels.shape[0] * 4 * 32} if options == "vocab-chunks" else {}
    settings["buffer_budget_bytes"] = budget
    args = (hidden, weight, labels, temperature, grads, return_entropy, validate)
    heads = []
    spy_head_forward(monkeypatch, heads)
    fused = _run(_backend(**settings), *args)
    generic = _run(_backend(fused_forward=False, **settings), *args)
    assert heads == [True]  # the generic path never asks the backend for its fused forward
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), fused, generic, strict=True):
        if a is None:
            assert b is None
            continue
        # The interpreter's log (numpy's) and torch's CPU log may differ in the last bit, and so
        # may everything downstream of lse; on CUDA both are libdevice's logf (bitwise there:
        # tests/gpu/test_gpu_fast_launch.py).
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)
    ok = labels != IGNORE_INDEX
    if options == "bad-labels":
        assert fused[0][1:3].isnan().all() and not fused[0][3:].isnan().any()
        ok[1:3] = False
    safe = torch.where(ok, labels, IGNORE_INDEX)
    e = grads[1].double() if return_entropy else None
    ref = reference(hidden.detach().double(), weight.detach().double(), safe, temperature, grads[0].double(), e)
    keep = ok | (labels == IGNORE_INDEX)
    tol = {"dtype": torch.float32, "rtol": 2e-6, "atol": 1e-6}
    assert_close(fused[0][keep].cpu(), ref["log_prob"][keep], name="log_prob", **tol)
    if return_entropy:
        assert_close(fused[1][keep].cpu(), ref["entropy"][keep], name="entropy", **tol)
    if options != "bad-labels":  # a NaN log-prob poisons its token's gradients, as it should
        assert_close(fused[2].cpu(), ref["d_hidden"], name="d_hidden", dtype=torch.float32, rtol=1e-5, atol=1e-6)
        assert_close(fused[3].cpu(), ref["d_weight"], name="d_weight", dtype=torch.float32, rtol=1e-5, atol=1e-6)


def test_no_fast_launch_under_the_interpreter():
    """The interpreter has no compiled kernels: every launch takes ``kernel[grid](...)``."""
    backend = triton_backend.TritonBackend()
    assert not backend.launcher.fast()
    hidden, weight, labels, _ = _case(seed=3)
    with torch.no_grad():
        fused_log_probs_and_entropy(hidden, weight, labels, backend=backend)
    assert all(not backend.launcher.fast_level(getattr(kernels, name)) for name in KERNELS)


def test_rescale_in_fewer_ops_gives_the_same_bits():
    """The TP combine's rescaling (``masked_fill`` instead of ``where`` against ``zeros_like``)
    gives the former formula's values bit for bit, empty parts (``s = 0``, ``m = -inf``) too."""
    from mcore_ppo.parallel.combine import rescale_factor
    from mcore_ppo.statistics import DEFAULT

    gen = generator(next_seed())
    m = torch.randn(64, generator=gen) * 30
    s = torch.rand(64, generator=gen) * 5
    u = -torch.rand(64, generator=gen) * 3
    m[:8], s[:8], u[:8] = -torch.inf, 0.0, 0.0
    new_max = torch.maximum(m, torch.randn(64, generator=gen) * 30)
    new_max[:4] = -torch.inf  # both -inf: the shift is NaN and must not leak
    scale = torch.exp(m - new_max)
    scale = torch.where(s == 0, torch.zeros_like(scale), scale)
    shift = torch.where(s == 0, torch.zeros_like(m), m - new_max)
    want = (s * scale, (u + s * shift) * scale)
    got = DEFAULT.rescale(m, torch.stack([s, u]), new_max)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) and not a.isnan().any()
    assert torch.equal(rescale_factor(m, s, new_max), scale)
