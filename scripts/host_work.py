#!/usr/bin/env python
"""Host work of one head call: the CPU time the caller's thread spends in it, GPU kept busy.

A model step is host-bound when the head's Python and kernel launches take longer than the GPU
work queued before them. This measures that cost alone: before each timed call the GPU is given
a long spin (``torch.cuda._sleep``), so every launch returns at once and the wall time of the call
on the host is its host work (Python, argument checks, descriptor builds, launch overhead), with
no wait on the GPU inside it. Medians over ``--reps`` calls after warm-up, for the no-grad forward,
the forward that keeps a backward, and the backward, each call timed alone after a wait for the
GPU; then the same calls back to back behind one spin (``*_steady``: the thread never idles, as in
a training loop; as many calls as the GPU's launch queue holds, so the host never waits on it);
then a cProfile of such calls. The backward's steady time includes what autograd's engine pays
for any custom Function (``autograd_noop_backward_ms_steady``: a no-op Function's backward);
``backward_node_host_ms_steady`` is the rest, the head's own.

The head runs with the API's default options (``validate=True``, ``--no-validate`` turns it
off): on CUDA its checks read no device value back (the verdict over TP is shared once per call
signature), so a steady call does not wait for the spin.

It also records, per call, the aten ops the host issued (a ``TorchDispatchMode``), the kernel
launches of the triton backend (counted by its launcher, ``backend.launcher.launches``), the GPU
work items queued (``gpu_items``, CUDA only: what sizes the steady runs), and which
launch level each kernel reached (``fast_launch_levels``: ``compiled`` where a site keeps its
compiled kernel, ``normal`` where it takes ``kernel[grid]``; empty under the interpreter and
without CUDA).

``--tp-combine`` also times the forward's TP branch, which a one-rank call never takes: the
backend's ``head_forward`` with the combine of ``mcore_ppo.parallel.combine`` over a one-rank
process group (NCCL on a GPU, gloo on the CPU), its multi-rank code path forced (the collectives
of one rank return their input), steady calls; the host time is split at the combine's entry
and exit (before it: the labels, the statistics and the shard's max; the combine itself: its
two all-reduces and, between them, the merge launch; after it: the finish launch), and beside
it the two all-reduces alone and the one-rank ``head_forward`` (``tp_combine`` in the JSON).

Usage (GPU):  python scripts/host_work.py [--shape qwen7b] [--tp 8] [--tokens 16384] [--graphed] [--tp-combine]
              [--out DIR]
Without CUDA it times the torch backend on small CPU tensors. ``--backend null``
(:class:`mcore_ppo_testing.null_backend.NullBackend`: allocations, no compute) times the head's
host work above its backend alone, on any machine: the part a CPU can measure and cut.
``--backend triton-stub`` (:mod:`mcore_ppo_testing.stub_launch`) times the triton backend's host
code too, its kernels never run, on CPU bf16 tensors of the CPU's default small shapes (the
label values unread, as on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo import HeadOptions, fused_log_probs_and_entropy
from mcore_ppo.backends import resolve_backend
from mcore_ppo_testing.bench import SHAPES

_SPIN_CYCLES = 200_000_000  # ~0.1 s at 1.98 GHz: far longer than any call's host work
_QUEUED_LAUNCHES = 400  # per steady measurement


def _host_ms(fn, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(_SPIN_CYCLES)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def _steady_host_ms(fn, calls: int, cuda: bool) -> float:
    """Host time per call of ``calls`` back-to-back calls of ``fn`` behind one long GPU spin: the
    thread never waits in between (as in a training step's loop), where :func:`_host_ms` times
    each call after a wait for the GPU (a thread that has just idled: colder caches)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(_SPIN_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - start) * 1e3 / calls
    if cuda:
        torch.cuda.synchronize()
    return per_call


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _counts(fn, launcher) -> dict:
    """Aten ops and kernel launches (through ``launcher``, a triton backend's; None: not counted)
    of one call of ``fn``, and on CUDA the GPU work items the call queued (``gpu_items``: every
    kernel, copy and memset, the cuBLAS GEMMs inside the head's ops included, by
    ``torch.profiler``), which size the steady measurements."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    before = launcher.launches if launcher is not None else 0
    mode = _CountOps()
    with profile(activities=[ProfilerActivity.CUDA]) if cuda else contextlib.nullcontext() as prof, mode:
        fn()
        if cuda:
            torch.cuda.synchronize()
    launches = (launcher.launches - before) if launcher is not None else None
    out = {"aten_ops": sum(mode.ops.values()), "launches": launches, "ops": dict(sorted(mode.ops.items()))}
    if cuda:
        out["gpu_items"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # pragma: no cover - no triton
        return None
    return triton.__version__


def _levels(launcher) -> dict:
    if launcher is None:
        return {}
    import mcore_ppo.kernels as kernels

    out = {}
    for name in kernels.__all__:
        levels = sorted(set(launcher.fast_level(getattr(kernels, name)).values()))
        if levels:
            out[name] = levels
    return out


def _profile(name: str, fn, calls: int, cuda: bool) -> str:
    """cProfile of ``calls`` back-to-back calls of ``fn`` behind one GPU spin (as
    :func:`_steady_host_ms`): per call, in microseconds, the functions with the most time of
    their own, then the most cumulative time."""
    profile = cProfile.Profile()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(_SPIN_CYCLES)
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(profile).stats
    rows = [(tt / calls * 1e6, ct / calls * 1e6, nc / calls, func) for func, (_, nc, tt, ct, _) in stats.items()]
    lines = [f"== {name}: {sum(r[0] for r in rows):.0f} us per call under the profiler, {calls} calls back to back"]
    for title, key in (("own time", 0), ("cumulative time", 1)):
        lines.append(f"-- by {title}: own_us cum_us calls/call  function")
        for own, cum, calls_per, (path, line, func) in sorted(rows, key=lambda r: -r[key])[:30]:
            lines.append(f"{own:8.1f} {cum:8.1f} {calls_per:6.1f}  {Path(path).name}:{line}({func})")
    return "\n".join(lines) + "\n\n"


class _NoOp(torch.autograd.Function):
    """The cheapest node autograd can run: what any custom Function's backward pays before its
    own work (the engine's start, its hand-over to the device's thread, the gradient's return)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _queue_calls(counts: dict, reps: int) -> int:
    """Back-to-back calls that keep the GPU's launch queue (about a thousand entries) well short
    of full: past it the host would wait for the GPU, and time the GPU's work instead."""
    per_call = max(1, counts.get("gpu_items") or counts["aten_ops"] + (counts["launches"] or 0))
    return max(2, min(reps, _QUEUED_LAUNCHES // per_call))


def _tp_combine(backend, x, w, labels, vocab_size: int, reps: int, cuda: bool) -> dict:
    """Host ms of the forward's TP branch, steady, split at the combine (module doc)."""
    import torch.distributed as dist

    from mcore_ppo.numerics import max_entropy

    try:
        from mcore_ppo.parallel import combine as combine_module
    except ImportError:  # an older checkout's top-level package, for A/B runs
        from parallel import combine as combine_module

    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    # The multi-rank branch on one rank: each collective of one rank returns its input.
    combine_module.group_size = lambda group: 2
    stamps: list[float] = []

    def combine(*args):
        stamps.append(time.perf_counter())
        if callable(args[-1]):  # (shard_max, sums_relative_to): the merge launch is inside the combine
            out = combine_module.reduce_shard_statistics(*args, group)
        else:  # an older checkout's contract, (m, s, u, y[, q]) -> outputs, for A/B runs
            out = combine_module.combine_shard_statistics(*args[:4], group, *args[4:])
        stamps.append(time.perf_counter())
        return out

    # The labels are in range (an older checkout names the flag labels_checked).
    parameters = inspect.signature(backend.head_forward).parameters
    in_range = "labels_in_range" if "labels_in_range" in parameters else "labels_checked"

    # The default statistics (an older checkout takes with_entropy instead of a description).
    if "statistics" in parameters:
        from mcore_ppo.statistics import DEFAULT

        what = {"statistics": DEFAULT}
    else:
        what = {"with_entropy": True}

    def forward(grad_needed: bool, tp: bool):
        return backend.head_forward(
            x, w, labels, 0.7, ignore_index=-100, vocab_start=0, vocab_size=vocab_size, **{in_range: True},
            grad_needed=grad_needed, max_entropy=max_entropy(vocab_size, torch.float32),
            combine=combine if tp else None, **what,
        )  # fmt: skip

    out: dict[str, float] = {}
    for grad_needed in (False, True):
        name = "forward" if grad_needed else "nograd_forward"
        for _ in range(3):
            forward(grad_needed, True)
            forward(grad_needed, False)
        # Fewer calls than the other measurements: each issues ~40 launches and small ops, and
        # the GPU's launch queue must not fill (the host would wait on the GPU).
        calls = max(2, min(reps, 10))
        out[f"{name}_one_rank_ms_steady"] = _steady_host_ms(lambda g=grad_needed: forward(g, False), calls, cuda)
        phases = []

        def timed(g=grad_needed, phases=phases):
            start = time.perf_counter()
            forward(g, True)
            phases.append((start, *stamps[-2:], time.perf_counter()))

        out[f"{name}_tp_ms_steady"] = _steady_host_ms(timed, calls, cuda)
        for key, (a, b) in {"before_combine": (0, 1), "combine": (1, 2), "after_combine": (2, 3)}.items():
            out[f"{name}_tp_{key}_ms_steady"] = statistics.median((p[b] - p[a]) * 1e3 for p in phases)
    n = x.shape[0]
    maxima = torch.zeros(n, device=x.device)
    packed = torch.zeros(3, n, device=x.device)

    def all_reduces():
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)

    for _ in range(3):
        all_reduces()
    out["two_all_reduces_ms_steady"] = _steady_host_ms(all_reduces, max(2, min(reps, 10)), cuda)
    out["collectives"] = dist.get_backend(group)
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", default="qwen7b", choices=sorted(SHAPES), help="model (hidden size, vocab)")
    parser.add_argument("--tp", type=int, default=8, help="the vocab shard is V / tp (one rank's work)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call")
    parser.add_argument(
        "--backend",
        default="auto",
        help="the head's backend; null: no compute, the host work above the backend; triton-stub (CPU): the "
        "triton backend's host code, its kernels never run",
    )
    parser.add_argument("--reps", type=int, default=30, help="timed calls per measurement")
    parser.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the head's validate option (the API's default, on: no host sync on CUDA)",
    )
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="time the head captured by torch.cuda.make_graphed_callables (static inputs: each call "
        "replays the captured kernels; CUDA only); files get a _graphed suffix",
    )
    parser.add_argument(
        "--tp-combine",
        action="store_true",
        help="also time the forward's TP branch over a one-rank group (merge, combine, all-reduces, finish)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for host_work.json and host_profile.txt")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    run_context = contextlib.ExitStack()  # what holds for the whole run (closed at its end)
    hidden_size, vocab = SHAPES[args.shape]
    if cuda:
        device, dtype, n, h, v = "cuda", torch.bfloat16, args.tokens, hidden_size, vocab // args.tp
    else:
        device, dtype, n, h, v = "cpu", torch.float32, 64, 32, 128
        if args.backend == "triton-stub":
            dtype = torch.bfloat16  # the GPU's operands (the CPU's GEMMs of the backward stay small)
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(n, h, device=device, dtype=dtype, generator=gen) * 0.5).requires_grad_(True)
    w = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    grads = [torch.randn(n, device=device, generator=gen) for _ in range(2)]

    # The object a name resolves to (once per device type): the API gets the name, as users pass
    # it (an object costs a Protocol isinstance check per call); its launcher counts the launches.
    if args.backend == "null":
        # Built once into the options (checked then, as a user's reused HeadOptions is).
        from mcore_ppo_testing.null_backend import NullBackend  # (an older checkout has none)

        backend = NullBackend()
        options = HeadOptions(backend=backend, validate=args.validate)
    elif args.backend == "triton-stub":
        if cuda:
            parser.error("--backend triton-stub is the CPU's stand-in for the triton backend's host work")
        from mcore_ppo_testing.stub_launch import cuda_like_checks, stub_triton_backend

        backend = stub_triton_backend(check_sites=False)
        options = HeadOptions(backend=backend, validate=args.validate)
        run_context.enter_context(cuda_like_checks())
    else:
        backend = resolve_backend(args.backend, torch.device(device))
        options = HeadOptions(backend=args.backend, validate=args.validate)
    launcher = getattr(backend, "launcher", None)

    def head(x, w, labels):
        return fused_log_probs_and_entropy(x, w, labels, temperature=0.7, options=options)

    if args.graphed:
        if not cuda:
            parser.error("--graphed needs CUDA")
        graphed = torch.cuda.make_graphed_callables(head, (x, w, labels))

        def call():
            return graphed(x, w, labels)
    else:

        def call():
            return head(x, w, labels)

    def nograd():
        with torch.no_grad():
            call()

    kept = {}

    def forward():
        kept["out"] = call()

    def backward():
        log_p, ent = kept.pop("out")
        torch.autograd.backward([log_p, ent], grads)

    for _ in range(3):  # compile and warm every path
        nograd()
        forward()
        backward()
    x.grad = w.grad = None
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "n": n, "h": h, "v": v, "dtype": str(dtype)}
    result["graphed"] = args.graphed
    result["versions"] = {"torch": torch.__version__, "triton": _triton_version()}
    result["nograd_forward_host_ms"] = _host_ms(nograd, args.reps, cuda)
    result["forward_host_ms"] = _host_ms(lambda: (forward(), kept.clear()), args.reps, cuda)
    times = []
    for _ in range(args.reps):
        forward()
        if cuda:
            torch.cuda.synchronize()
        times.append(_host_ms(backward, 1, cuda))
        x.grad = w.grad = None
    result["backward_host_ms"] = statistics.median(times)
    counts = {"nograd_forward": _counts(nograd, launcher), "forward": _counts(forward, launcher)}
    counts["backward"] = _counts(backward, launcher)
    x.grad = w.grad = None
    result["per_call_counts"] = counts
    # The same calls back to back behind one spin, as a training loop issues them; as many as
    # the GPU's launch queue takes without making the host wait.
    forward_calls = _queue_calls(counts["forward"], args.reps)
    result["nograd_forward_host_ms_steady"] = _steady_host_ms(
        nograd, _queue_calls(counts["nograd_forward"], args.reps), cuda
    )
    result["forward_host_ms_steady"] = _steady_host_ms(lambda: (forward(), kept.clear()), forward_calls, cuda)
    backward_calls = _queue_calls(counts["backward"], args.reps)
    graphs = []
    for _ in range(backward_calls):  # the forwards first, untimed; then their backwards in a row
        graphs.append(call())

    def retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0

    retries_before = retries()
    result["backward_host_ms_steady"] = _steady_host_ms(
        lambda: torch.autograd.backward(list(graphs.pop()), grads), backward_calls, cuda
    )
    # A retry frees cached blocks and waits for the GPU: the time would then include its work.
    result["backward_steady_alloc_retries"] = retries() - retries_before
    x.grad = w.grad = None
    leaf = torch.zeros(n, device=device, requires_grad=True)
    nodes = [_NoOp.apply(leaf) for _ in range(backward_calls)]
    result["autograd_noop_backward_ms_steady"] = _steady_host_ms(
        lambda: torch.autograd.backward([nodes.pop()], [grads[0]]), backward_calls, cuda
    )
    result["backward_node_host_ms_steady"] = (
        result["backward_host_ms_steady"] - result["autograd_noop_backward_ms_steady"]
    )
    result["steady_calls"] = {"forward": forward_calls, "backward": backward_calls}
    result["fast_launch_levels"] = _levels(launcher)

    text = io.StringIO()
    text.write(_profile("no-grad forward", nograd, forward_calls, cuda))
    pair = {
        key: (counts["forward"].get(key) or 0) + (counts["backward"].get(key) or 0)
        for key in ("aten_ops", "launches", "gpu_items")
    }
    text.write(_profile("forward + backward", lambda: (forward(), backward()), _queue_calls(pair, args.reps), cuda))
    if args.tp_combine:  # last: its process group would send the API's calls to Megatron's groups
        if not hasattr(backend, "head_forward"):
            parser.error("--tp-combine needs a backend with a fused forward (triton)")
        result["tp_combine"] = _tp_combine(backend, x.detach(), w.detach(), labels, vocab, args.reps, cuda)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "_graphed" if args.graphed else ""
        (args.out / f"host_work{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"host_profile{suffix}.txt").write_text(text.getvalue())
    else:
        print(text.getvalue())
    run_context.close()


if __name__ == "__main__":
    main()
