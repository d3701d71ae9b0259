"""The triton backend's host code on a CPU, its kernels never run: host work you can cut without a GPU.

:func:`stub_triton_backend` builds a :class:`~mcore_ppo.backends.triton_backend.TritonBackend`
whose launcher takes the kept-kernel path of a GPU (one launch through Triton's dispatch per
site, then the kept compiled kernel's ``run``) with a compiled kernel whose ``run`` does nothing,
and a driver that names device 0 and stream 0. A head call through it therefore runs every line
of the backend's Python (plans, allocations, argument tuples, launch sites) and the head's above
it, on CPU tensors, without a kernel: ``scripts/host_work.py --backend triton-stub`` times that
on any machine. It differs from a CUDA call in what CUDA alone does: the allocator is the CPU's,
a launch costs no C launcher, the operands take the pointer path (no TMA: no copy of gathered
rows), and the backward's GEMMs run on the CPU (keep shapes small). Label values are not read
on the host, as on CUDA (:func:`cuda_like_checks`). Outputs are garbage by design.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import torch

from mcore_ppo import execution, head_call
from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig
from mcore_ppo.backends.triton_launch import Launcher
from mcore_ppo_testing.launch_checks import CheckedLauncher

try:
    from triton.compiler import CompiledKernel
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without triton
    if err.name != "triton":
        raise
    CompiledKernel = object


class _IdleCompiled(CompiledKernel):
    """A compiled kernel as the launcher keeps it, whose launch does nothing."""

    def __init__(self) -> None:  # Triton's own __init__ loads a binary
        self.function = 0
        self.packed_metadata = ()

    def run(self, *args) -> None:
        """No kernel."""


class _Device0:
    """Triton's driver as the launcher asks it: device 0, stream 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


class StubLauncher(CheckedLauncher):
    """The kept-kernel path with kernels that do nothing (module doc). With ``check_sites``
    every launch with a site, kept or not, is checked against Triton's own argument binder (a
    site key coarser than Triton's specialisation raises
    :class:`~mcore_ppo_testing.launch_checks.SiteKeyError`); without, a launch costs what the
    launcher's own Python does (for timing)."""

    def __init__(self, *, check_sites: bool = True) -> None:
        super().__init__(fast_here=True, driver=_Device0())
        self.check_sites = check_sites
        self.inline_kept = not check_sites  # its launch_kept adds nothing then
        self.dispatched: Counter[str] = Counter()  # launches without a site, by kernel name

    def launch_normal(self, kernel, grid, args, kwargs, site):
        """What Triton's dispatch would return, without compiling or launching; a launch
        without a site (Triton's dispatch on every call) is counted."""
        if site is None:
            self.dispatched[getattr(kernel, "__name__", str(kernel))] += 1
        elif self.check_sites:
            self.check_binder(kernel, site, args, kwargs)
        return _IdleCompiled()

    def launch_kept(self, kept, kernel, grid, args, kwargs, site, stream) -> None:
        """The kept kernel's (idle) launch, with ``check_sites`` its arguments checked as the
        site's first were."""
        if self.check_sites:
            self.check_binder(kernel, site, args, kwargs)
        Launcher.launch_kept(self, kept, kernel, grid, args, kwargs, site, stream)


def stub_triton_backend(config: TritonConfig | None = None, *, check_sites: bool = True) -> TritonBackend:
    """A triton backend (of ``config``) that runs on CPU tensors without running a kernel (module
    doc); ``check_sites``: as for :class:`StubLauncher` (off for timing)."""
    backend = TritonBackend(config, launcher=StubLauncher(check_sites=check_sites))
    backend.unsupported = lambda hidden: None  # CPU tensors, no interpreter: its kernels never run
    return backend


@contextlib.contextmanager
def cuda_like_checks() -> Iterator[None]:
    """The head's checks read no label or temperature value on the host, as on CUDA (the checks
    themselves, and the test of whether a call may skip them)."""
    modules = (head_call, execution)
    readable = [module.values_readable for module in modules]
    for module in modules:
        module.values_readable = lambda tensor: False
    try:
        yield
    finally:
        for module, original in zip(modules, readable, strict=True):
            module.values_readable = original


class Mode(NamedTuple):
    """One way of calling the head, for :func:`launch_levels`."""

    precision: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    buffer_budget: int = 1 << 30
    row_temperature: bool = False
    entropy: bool = True
    sum_pi_squared: bool = False
    ignored: float = 0.0  # share of ignored tokens
    misaligned: bool = False  # hidden rows not 16-byte aligned, int32 labels (after a step without)
    ids: int = 0  # k ids per token (``fused_log_probs_at``); 0: one label
    tp_combine: bool = False  # the forward's TP branch (a one-rank combine), no backward
    fused_forward: bool = True  # False: the generic one-label forward (statistics, then torch ops)


#: The head's modes :func:`launch_levels` runs.
MODES = {
    "buffer": Mode(),
    "recompute": Mode(buffer_budget=0),
    "ignored_rows": Mode(ignored=0.3),
    "row_temperature": Mode(row_temperature=True),
    "no_entropy": Mode(buffer_budget=0, entropy=False, ignored=0.2),
    "sum_pi_squared": Mode(dtype=torch.float16, sum_pi_squared=True),
    "fp32_parts": Mode(precision="fp32_faithful", dtype=torch.float32, ignored=0.2),
    "misaligned": Mode(ignored=0.2, misaligned=True),
    "fp32_parts_misaligned": Mode(
        precision="fp32_faithful", dtype=torch.float32, buffer_budget=0, ignored=0.2, misaligned=True
    ),
    "ids": Mode(ids=4, ignored=0.2),
    "ids_recompute": Mode(ids=4, buffer_budget=0, row_temperature=True),
    "ids_misaligned": Mode(ids=4, ignored=0.2, misaligned=True, sum_pi_squared=True),
    "generic_forward": Mode(ignored=0.2, fused_forward=False),
    "generic_recompute": Mode(buffer_budget=0, row_temperature=True, fused_forward=False),
    "tp_combine": Mode(ignored=0.2, tp_combine=True),
    "tp_combine_row_temperature": Mode(row_temperature=True, sum_pi_squared=True, tp_combine=True),
}

#: The launches each mode makes without a site in a step (Triton's dispatch on every call): fp32
#: inputs' parts recompute ``dz`` in the backward without the forward's plan (it was keyed by
#: the parts), one launch each of the gather, the recompute's one chunk and the scatter.
_PARTS_RECOMPUTE = {"gather_rows_kernel": 1, "dz_kernel": 1, "scatter_rows_kernel": 1}
DISPATCHED = {mode: _PARTS_RECOMPUTE if mode.startswith("fp32_parts") else {} for mode in MODES}


def launch_levels(mode: str, seed: int) -> dict:
    """Two steps (a forward with its backward, then a no-grad forward; with ``tp_combine`` the
    backend's forward over TP with and without a backward to follow) of the head in ``mode``
    (:data:`MODES`) through a stub triton backend: the launches of each step, per kernel the
    launch levels its sites reached after each (``compiled``: kept; ``normal``: Triton's
    dispatch per call), and the second step's launches made without a site (``dispatched``, by
    kernel). A misaligned mode first runs a step on aligned rows with int64 labels, so that the
    same launcher meets both (a site key that left the difference out raises). Run it where
    Triton compiles (``TRITON_INTERPRET`` unset): under the interpreter no site is kept."""
    import mcore_ppo.kernels as kernels
    from mcore_ppo import fused_log_probs_and_entropy, fused_log_probs_at
    from mcore_ppo.statistics import Statistics

    spec = MODES[mode]
    config = TritonConfig(
        precision=spec.precision, buffer_budget_bytes=spec.buffer_budget, fused_forward=spec.fused_forward
    )
    backend = stub_triton_backend(config)
    gen = torch.Generator().manual_seed(seed)
    n, h, v = 48, 32, 96
    base = torch.randn(n * h + 1, generator=gen).to(spec.dtype)
    w = torch.randn(v, h, generator=gen).to(spec.dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n, spec.ids) if spec.ids else (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < spec.ignored] = -100
    temperature = torch.rand(n, generator=gen) + 0.5 if spec.row_temperature else 0.7
    head = fused_log_probs_at if spec.ids else fused_log_probs_and_entropy
    statistics = Statistics.named(["entropy", *(["sum_pi_squared"] if spec.sum_pi_squared else [])])

    def levels() -> dict[str, list[str]]:
        out = {}
        for name in kernels.__all__:
            found = sorted(set(backend.launcher.fast_level(getattr(kernels, name)).values()))
            if found:
                out[name] = found
        return out

    def combine(shard_max: torch.Tensor, sums_relative_to) -> tuple[torch.Tensor, torch.Tensor]:
        return shard_max, sums_relative_to(shard_max)  # one rank's all-reduces: the identity

    def step(offset: int, labels: torch.Tensor) -> int:
        # ``offset`` elements in: rows that are not 16-byte aligned (Triton specialises on it).
        x = base[offset : offset + n * h].view(n, h).detach().requires_grad_(True)
        before = backend.launcher.launches
        if spec.tp_combine:  # the backend's forward over TP, with and without a backward to follow
            for grad_needed in (True, False):
                backend.head_forward(
                    x.detach(), w.detach(), labels, temperature, ignore_index=-100, vocab_start=0, vocab_size=v,
                    labels_in_range=True, grad_needed=grad_needed, statistics=statistics, max_entropy=1.0,
                    combine=combine,
                )  # fmt: skip
            return backend.launcher.launches - before
        outputs = head(
            x, w, labels, temperature=temperature, backend=backend, return_entropy=spec.entropy,
            return_sum_pi_squared=spec.sum_pi_squared,
        )  # fmt: skip
        torch.autograd.backward(outputs[0], torch.ones_like(outputs[0]))
        with torch.no_grad():
            head(x, w, labels, temperature=temperature, backend=backend)
        return backend.launcher.launches - before

    with cuda_like_checks():
        if spec.misaligned:
            step(0, labels)
            labels = labels.int()
        first = step(int(spec.misaligned), labels)
        after_first = levels()
        backend.launcher.dispatched.clear()
        second = step(int(spec.misaligned), labels)
    dispatched = dict(backend.launcher.dispatched)
    return {"launches": [first, second], "levels": [after_first, levels()], "dispatched": dispatched}


if __name__ == "__main__":  # python -m mcore_ppo_testing.stub_launch SEED: every mode's levels as JSON
    print(json.dumps({mode: launch_levels(mode, int(sys.argv[1])) for mode in MODES}))
