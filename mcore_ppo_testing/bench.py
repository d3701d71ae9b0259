"""Shared helpers of the GPU benchmarks (``scripts/bench_head.py``, ``profile_head.py``,
``bench_tp.py``): model shapes, timing, seeded inputs, the peers, our backends as objects,
and one implementation's measurement against the fp64 reference.

Nothing here changes module state: the benchmarks configure the head by passing backend
objects (``TritonBackend(TritonConfig(forward_config=...))``) and timing options as arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import statistics
import sys
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mcore_ppo_testing.reference import normwise_relative_error, reference

#: hidden size and vocab of the benchmarked models
SHAPES = {"qwen7b": (3584, 152064), "llama3-8b": (4096, 128256), "v262k": (4096, 262144)}
GIB = 2**30

# Inside a model the head's host work (Python, launches) overlaps the GPU work queued before
# it; a benchmark that starts its clock on an idle GPU charges that latency to the head. Hiding
# it, the GPU first spins for a while (torch.cuda._sleep), so the host has queued the whole
# call before the start event runs: the time is then the GPU's, as in a model step.
_SPIN_CYCLES = 40_000_000  # ~20 ms at 1.98 GHz: longer than any call's host work here

#: an implementation: fn(x, w, labels, T) -> (log_probs, entropy or None)
HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor | None]]


class Progress:
    """tqdm when installed, else a one-line counter on stderr."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._bar = None
        self.total, self.done, self.desc = total, 0, desc

    def update(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            self._bar.update(1)
        else:
            print(f"\r{self.desc}: {self.done}/{self.total} {label:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def event_times(fn: Callable[[], Any], reps: int, *, hide_host_latency: bool = True) -> list[float]:
    """CUDA-event times in ms of ``reps`` calls of ``fn()``, each alone: with
    ``hide_host_latency`` the host's work is queued behind a GPU spin (the GPU's time, as inside
    a model step), else the clock starts on an idle GPU (the host's work before the first
    kernel counted)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_host_latency:
            torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 1, *, hide_host_latency: bool = True) -> float:
    """Median of :func:`event_times` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_times(fn, reps, hide_host_latency=hide_host_latency))


@dataclass(frozen=True)
class Timer:
    """How a benchmark run times its calls: medians of ``reps`` calls (unless a call says
    otherwise), with the host latency hidden (GPU time, as in a model step) or exposed."""

    reps: int = 5
    hide_host_latency: bool = True

    def __call__(self, fn: Callable[[], Any], reps: int | None = None, warmup: int = 1) -> float:
        return time_ms(fn, self.reps if reps is None else reps, warmup, hide_host_latency=self.hide_host_latency)

    def flipped(self) -> Timer:
        """The same timer with the host latency the other way."""
        return replace(self, hide_host_latency=not self.hide_host_latency)


def fp32_gemm_path(device_type: str = "cuda") -> dict[str, str]:
    """How the triton backend's ``mm_fp32`` and ``addmm_fp32`` form their fp32 results of
    16-bit operands on ``device_type`` (for a benchmark's record): the same answer for every call."""
    from mcore_ppo.backends.fp32_gemms import fp32_output_gemms

    mm, addmm = fp32_output_gemms(device_type)
    if device_type != "cuda":
        return {"mm": "fp32 upcast + mm", "addmm": "fp32 upcast + mm + add"}
    return {
        "mm": "mm out_dtype=fp32" if mm else "zeros + " + ("addmm out_dtype=fp32" if addmm else "bf16 mm + add"),
        "addmm": "addmm out_dtype=fp32, beta=1" if addmm else ("mm out_dtype=fp32 + add" if mm else "bf16 mm + add"),
    }


# ----------------------------------------------------------------------------- inputs and errors
@dataclass(frozen=True)
class HeadInputs:
    """One shard's bf16 ``x [n, h]``, ``w [v, h]``, labels ``[n]`` and fp32 upstream ``g``, ``e``."""

    x: torch.Tensor
    w: torch.Tensor
    labels: torch.Tensor
    g: torch.Tensor
    e: torch.Tensor


def make_inputs(
    n: int,
    h: int,
    v: int,
    generator: torch.Generator,
    *,
    weight_scale: float | None = None,
    ignored_fraction: float = 0.0,
) -> HeadInputs:
    """Seeded inputs on the GPU, drawn in a fixed order from ``generator`` (weights scaled by
    ``weight_scale``, default ``2/sqrt(h)``; ``ignored_fraction`` of the labels set to -100)."""
    scale = 2.0 / math.sqrt(h) if weight_scale is None else weight_scale
    x = torch.randn(n, h, device="cuda", generator=generator).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=generator) * scale).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda", generator=generator)
    if ignored_fraction > 0:
        labels[torch.rand(n, device="cuda", generator=generator) < ignored_fraction] = -100
    g = torch.randn(n, device="cuda", generator=generator)
    e = torch.randn(n, device="cuda", generator=generator)
    return HeadInputs(x, w, labels, g, e)


def fp64_reference(inputs: HeadInputs, temperature: float, *, need_grads: bool = True, rows_per_chunk: int = 1024):
    """float64 ``(log_prob, entropy, d_hidden, d_weight)`` of all tokens (grads None without ``need_grads``)."""
    upstream = (inputs.g, inputs.e) if need_grads else (None, None)
    ref = reference(
        inputs.x, inputs.w, inputs.labels, temperature, *upstream, rows_per_chunk=rows_per_chunk, with_terms=False
    )
    return ref["log_prob"], ref["entropy"], ref.get("d_hidden"), ref.get("d_weight")


def rel_err(out: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """Normwise relative error, None when either side is missing."""
    return None if out is None or ref is None else normwise_relative_error(out, ref)


# ----------------------------------------------------------------------------- peers and ours
def naive(x, w, labels, temperature):
    """The unfused head: fp32 logits, log_softmax, gather, entropy."""
    logits = (x @ w.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = labels != -100
    logp = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, ent, zero)


def load_verl():
    """verl's ``linear_cross_entropy``: through ``import verl`` where that works (Ray may be the
    stand-in of :mod:`mcore_ppo_testing.real_verl`), else its two kernel modules loaded from
    their files under stub parent packages (verl installed with ``--no-deps`` and nothing else:
    its ``__init__`` pulls tensordict, transformers, ...). The stubs stay in ``sys.modules`` for
    the kernel's lazy imports, so they are used only where the real package cannot load.
    """
    from importlib.metadata import PackageNotFoundError, version

    from mcore_ppo_testing.real_verl import loaded_modules, use_ray_standin

    def verl_version() -> str:  # "?" for a source tree on the path, without package metadata
        try:
            return version("verl")
        except PackageNotFoundError:
            return "?"

    # (find_spec cannot be asked while the stubs of an earlier call are in sys.modules.)
    if "verl" not in sys.modules and importlib.util.find_spec("verl") is None:
        return None, "verl not installed"
    use_ray_standin()
    try:  # the real package, or the stubs of an earlier call, already in sys.modules
        from verl.utils.kernel import kernels  # noqa: F401  (what its first call imports)
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy, verl_version()
    except ImportError:
        for name in loaded_modules("verl"):
            del sys.modules[name]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None, "verl not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, path in (("verl", root), ("verl.utils", root / "utils"), ("verl.utils.kernel", root / "utils/kernel")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_capability = lambda: torch.cuda.get_device_capability()
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    sys.modules["verl.utils.device"] = device
    module = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    return module.linear_cross_entropy, verl_version()


def peer_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "triton", "liger-kernel", "verl", "nvidia-cutlass-dsl", "megatron-core"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def ours(backend: Any, **options: Any) -> HeadFn:
    """This project's head through its API with ``backend`` (a name or a backend object, kept as
    the function's ``backend`` attribute).

    Timed with ``validate=False`` unless told otherwise: the checks' one host sync per call would
    put the host's launch latency after it into the GPU time (docs/design.md, validation)."""
    from mcore_ppo import fused_log_probs_and_entropy

    options.setdefault("validate", False)

    def head(x, w, labels, t):
        return fused_log_probs_and_entropy(x, w, labels, temperature=t, backend=backend, **options)

    head.backend = backend
    return head


def liger_entry(**options: Any) -> HeadFn:
    """Liger-Kernel's fused linear scaled CE through this project's Liger entry point
    (:func:`mcore_ppo.liger.liger_log_probs_and_entropy`: the head's checks and token order
    around Liger's own autograd), with ``validate=False`` unless told otherwise (as :func:`ours`)."""
    from mcore_ppo import liger

    options.setdefault("validate", False)

    def head(x, w, labels, t):
        return liger.liger_log_probs_and_entropy(x, w, labels, temperature=t, **options)

    return head


def build_impls(triton_config: Any = None) -> dict[str, tuple[HeadFn | None, str | None, dict]]:
    """name -> (fn, skip reason, info). ``triton_config``: the
    :class:`~mcore_ppo.backends.triton_config.TritonConfig` (tile configs) of every
    ``ours_triton*`` implementation (None: the defaults); the recompute and buffer variants
    change its budget only."""
    from mcore_ppo import liger
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig

    config = triton_config if triton_config is not None else TritonConfig()
    impls: dict[str, tuple[HeadFn | None, str | None, dict]] = {}
    impls["naive_torch"] = (naive, None, {})
    impls["torch_compile"] = (torch.compile(naive), None, {"note": "compiled per shape"})

    liger_ce = None
    why = None
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as liger_ce
    except ImportError as err:
        why = f"liger-kernel not installed ({err})"

    def liger_flce(x, w, labels, temperature):
        # No temperature in Liger's FLCE: timed on the same inputs; errors vs an fp64 reference at T=1.
        loss = liger_ce.apply(x, w, labels, None, None, -100, 0.0, 0.0, "none")[0]
        return -loss, None

    impls["liger_flce_none"] = (liger_flce, why, {"temperature": 1.0, "entropy": False})
    scaled_why = None if liger.is_available() else "liger-kernel with its fused linear scaled CE not installed"
    # Liger's CuTe path computes the entropy in the input dtype; the entry point hands it back as fp32.
    liger_info = {"entry": "mcore_ppo.liger_log_probs_and_entropy", "entropy_computed_in": "input dtype"}
    impls["liger_scaled_ce"] = (liger_entry(), scaled_why, liger_info)

    try:
        verl_fn, verl_info = load_verl()
    except Exception as err:  # a broken verl install is reported, not fatal to the benchmark
        verl_fn, verl_info = None, f"verl failed to load: {err!r}"
    if verl_fn is None:
        impls["verl_linear_ce"] = (None, verl_info, {})
    else:
        impls["verl_linear_ce"] = (lambda x, w, labels, t: verl_fn(x, w, labels, t, "none", None), None, {})

    triton = TritonBackend(config)
    configs = {"forward_config": asdict(triton.forward_config), "backward_config": asdict(triton.backward_config)}
    impls["ours_triton"] = (ours(triton), None, {"time_host_exposed": True, **configs})
    # The recompute path whatever the default budget (the four-GEMM kernels alone), and the
    # probability buffer with a budget that always fits here.
    recompute = TritonBackend(replace(config, buffer_budget_bytes=0))
    buffer = TritonBackend(replace(config, buffer_budget_bytes=1 << 40))
    impls["ours_triton_recompute"] = (ours(recompute), None, {"buffer": False})
    impls["ours_triton_buffer"] = (ours(buffer), None, {"buffer": True})
    impls["ours_torch"] = (ours("torch"), None, {"time_host_exposed": False})
    # Ours first, right after the floor is measured: clocks drift as the card heats up, and the
    # floor is measured again after the last implementation (floor_after) to show by how much.
    order = ["ours_triton", "ours_triton_recompute", "ours_triton_buffer", "ours_torch"]
    return {k: impls[k] for k in order + [k for k in impls if k not in order]}


# ----------------------------------------------------------------------------- reports
def plot(results: list[dict], path: Path, device: str | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    configs = [r for r in results if "impls" in r]
    if not configs:
        return
    names = [n for n in configs[0]["impls"] if n != "floor"]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 1.6 * len(configs)), 9))
    width = 0.8 / max(1, len(names))
    for ax, key, floor_key, title in (
        (axes[0], "fwd_ms", "gemm1_ms", "forward / one cuBLAS GEMM (target ≤ 1.10)"),
        (axes[1], "fwd_bwd_ms", "gemm4_ms", "forward+backward / four cuBLAS GEMMs (≤ 1.05; buffer mode ≤ 0.90)"),
    ):
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, cfg in enumerate(configs):
                r = cfg["impls"].get(name, {})
                if r.get(key) is not None:
                    xs.append(j + i * width)
                    ys.append(r[key] / cfg["floor"][floor_key])
            ax.bar(xs, ys, width, label=name)
        ax.axhline(1.10 if key == "fwd_ms" else 1.05, color="k", lw=0.8, ls="--")
        if key == "fwd_bwd_ms":  # the buffer mode's target
            ax.axhline(0.90, color="tab:green", lw=0.8, ls=":")
        ax.axhline(1.0, color="gray", lw=0.6)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"{c['shape']}\ntp{c['tp']} V={c['vocab_local']}" for c in configs], fontsize=8)
        ax.set_ylabel("× floor")
        ax.set_ylim(0, 2.0)  # the fp32 torch oracle (~19x) and naive torch at tp 1 run off the top
        ax.set_title(title)
    axes[0].legend(fontsize=7, ncol=4)
    device = device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    fig.suptitle(f"{configs[0]['tokens']} tokens, bf16, T={configs[0]['temperature']} ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge_reports(paths: list[str], out_dir: Path, name: str) -> int:
    """Concatenate the results of several runs (e.g. one per model shape) into one report."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(reports[0])
    merged["results"] = [r for rep in reports for r in rep["results"]]
    merged["runs"] = [{k: rep.get(k) for k in ("date", "args", "tuning")} for rep in reports]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(merged, indent=1))
    plot(merged["results"], out_dir / f"{name}.png", merged.get("device", ""))
    (out_dir / f"{name}_table.md").write_text(markdown_table(merged))
    print_table(merged)
    return 0


def markdown_table(report: dict) -> str:
    """One row per (shape, tp, implementation): the numbers docs/benchmarks/README.md shows."""
    head = (
        "| shape | tp | V/tp | 1 GEMM ms | 4 GEMMs ms | impl | fwd ms | no-grad fwd ms | fwd+bwd ms | fwd / 1 GEMM "
        "| fwd+bwd / 4 GEMMs | peak extra GiB (grads) | logp err | entropy err | d_hidden err | d_W err |"
    )
    lines = [head, "|" + "---|" * 16]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for entry in report["results"]:
        f = entry["floor"]
        for name, r in entry["impls"].items():
            if "skipped" in r or "error" in r:
                continue
            lines.append(
                f"| {entry['shape']} | {entry['tp']} | {entry['vocab_local']} | {f['gemm1_ms']:.2f} | "
                f"{f['gemm4_ms']:.2f} | {name} | {r['fwd_ms']:.2f} | {r['nograd_fwd_ms']:.2f} | "
                f"{fmt(r.get('fwd_bwd_ms'), '.2f')} | {r['fwd_ratio']:.3f} | {fmt(r.get('fwd_bwd_ratio'), '.3f')} | "
                f"{r['peak_extra_gib']:.2f} ({entry['output_grads_gib']:.2f}) | {fmt(r.get('logp_rel_err'), '.1e')} | "
                f"{fmt(r.get('entropy_rel_err'), '.1e')} | {fmt(r.get('dhidden_rel_err'), '.1e')} | "
                f"{fmt(r.get('dweight_rel_err'), '.1e')} |"
            )
    return "\n".join(lines) + "\n"


def print_table(report: dict) -> None:
    cols = ("fwd_ms", "nograd_fwd_ms", "fwd_bwd_ms", "fwd_ratio", "fwd_bwd_ratio", "peak_extra_gib")
    errs = ("logp_rel_err", "entropy_rel_err", "dhidden_rel_err", "dweight_rel_err")
    for entry in report["results"]:
        f = entry["floor"]
        print(
            f"\n{entry['shape']} tp{entry['tp']} (h {entry['hidden']}, V/tp {entry['vocab_local']}): "
            f"gemm1 {f['gemm1_ms']:.2f} ms, gemm3 {f['gemm3_ms']:.2f}, gemm4 {f['gemm4_ms']:.2f} "
            f"(after: {entry.get('floor_after', f)['gemm1_ms']:.2f}, {entry.get('floor_after', f)['gemm4_ms']:.2f}); "
            f"output grads {entry['output_grads_gib']:.2f} GiB"
        )
        print(f"{'impl':<17}" + "".join(f"{c:>15}" for c in cols + errs))
        for name, r in entry["impls"].items():
            if "skipped" in r or "error" in r:
                print(f"{name:<17} {r.get('skipped') or r.get('error')}"[:160])
                continue
            cells = []
            for c in cols:
                cells.append(f"{r[c]:>15.3f}" if r.get(c) is not None else f"{'-':>15}")
            for c in errs:
                cells.append(f"{r[c]:>15.2e}" if r.get(c) is not None else f"{'-':>15}")
            print(f"{name:<17}" + "".join(cells))
            if "half_ignored" in r:
                half = r["half_ignored"]
                print(f"{'  50% ignored':<17}{'-':>15}{half['nograd_fwd_ms']:>15.3f}{half['fwd_bwd_ms']:>15.3f}")
