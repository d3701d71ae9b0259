"""One compiled variant per kernel whatever the micro-batch: no JIT compile in mid-training.

Triton compiles a kernel anew for every combination of integer arguments' divisibility by 16
and pointer arguments' 16-byte alignment it is called with (its *specialisation*). RL
micro-batches vary in token count, and the per-token vectors the head receives (upstream
gradients, labels) are often views at offsets that follow it; each new variant would cost a
~1 s compile in the middle of a training step. This test runs the head's forward and backward
(recompute and buffer modes) over token counts of every residue mod 16 it meets and upstream
gradients at odd offsets, records every kernel launch, and computes the specialisation key
with Triton's own binder: each kernel must have exactly one.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
triton_backend = pytest.importorskip("mcore_ppo.backends.triton_backend")
import mcore_ppo.kernels as kernels  # noqa: E402  (decorated now, under the interpreter on CPU)
from mcore_ppo import fused_log_probs_and_entropy  # noqa: E402
from mcore_ppo_testing.reference import IGNORE_INDEX  # noqa: E402
from mcore_ppo_testing.seeds import generator, next_seed  # noqa: E402

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = [name for name in kernels.__all__ if name.endswith("_kernel")]


def _binder(kernel):
    """Triton's argument binder for ``kernel``: returns ``(params, specialization, options)``."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):  # the interpreter's wrapper keeps the decorator's options
        keep = ("do_not_specialize", "do_not_specialize_on_alignment")
        kernel = JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k in keep})
    return create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


@pytest.fixture
def launches(monkeypatch):
    """Every launch of every kernel: ``{name: [specialisation key, ...]}`` (the backends here
    keep no compiled kernels: those skip ``kernel.run``)."""
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen: dict[str, list[str]] = {name: [] for name in KERNELS}
    for name in KERNELS:
        kernel = getattr(kernels, name)
        binder = _binder(kernel)
        original = kernel.run

        def run(*args, _name=name, _binder=binder, _original=original, grid, warmup, **kwargs):
            _, specialization, _ = _binder(
                *args, **{k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            )
            seen[_name].append(repr(specialization))
            return _original(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    yield seen


def _backend(budget: int, *, tma: bool) -> triton_backend.TritonBackend:
    """The triton backend with this probability-buffer budget, every launch through Triton's
    own dispatch, fp32 CUDA operands on the kernels' own dots (not cuBLAS's route); ``tma``:
    operands, dz and buffer tiles through the copy engine (the GPU's default configs already do;
    the interpreter's small tiles are switched to it)."""
    config = triton_backend.TritonConfig(buffer_budget_bytes=budget, kept_kernels=False, ieee_gemms="kernels")
    forward, _ = config.resolved_forward()
    if tma and not forward.use_tma:
        backward, _ = config.resolved_backward()
        config = replace(
            config, forward_config=replace(forward, use_tma=True), backward_config=replace(backward, use_tma=True)
        )
    backend = triton_backend.TritonBackend(config)
    assert not tma or (backend.forward_config.use_tma and backend.backward_config.use_tma)
    return backend


@pytest.mark.parametrize("options", ["default", "T-tensor+no-entropy"])
@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["recompute", "buffer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-pointers", "bf16-tma"])
def test_one_variant_per_kernel_across_micro_batches(launches, budget, dtype, options):
    """Also with a per-token temperature (views at offsets that follow n) and the entropy off:
    their own variants (ROW_TEMP, the entropy's U_PLANE off, HAS_E), one each."""
    backend = _backend(budget, tma=dtype == torch.bfloat16)
    gen = generator(next_seed())
    h, v = 16, 72
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).to(DEVICE).requires_grad_(True)
    for n in (37, 40, 45, 48, 50, 51):  # residues 5, 8, 13, 0, 2, 3 mod 16; 1, 0, 1, 0, 2, 3 mod 4
        hidden = torch.randn(n, h, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
        labels = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
        labels[:3] = IGNORE_INDEX
        # Upstream gradients as views into one packed buffer, at offsets that follow n.
        packed = torch.randn(2 * n + 3, generator=gen).to(DEVICE)
        g, e = packed[1 : n + 1], packed[n + 2 : 2 * n + 2]
        if options == "default":
            logp, ent = fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.8, backend=backend)
            torch.autograd.backward([logp, ent], [g, e])
        else:
            temperature = 0.5 + packed[n + 1 : 2 * n + 1].abs()
            logp, ent = fused_log_probs_and_entropy(
                hidden, weight, labels, temperature=temperature, backend=backend, return_entropy=False
            )
            assert ent is None
            logp.backward(g)
    used = {name: set(keys) for name, keys in launches.items() if keys}
    assert "stats_kernel" in used and ("dz_from_buffer_kernel" if budget else "dz_kernel") in used
    several = {name: len(keys) for name, keys in used.items() if len(keys) > 1}
    assert not several, f"kernels specialised more than once across micro-batch sizes: {several}"
