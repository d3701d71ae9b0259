#!/usr/bin/env python
"""Side-by-side benchmark of the fused PPO head and its peers, in one process on one GPU.

For each model shape and per-rank vocab shard (V/tp) it times, on the same bf16 inputs
(N tokens, temperature T): the cuBLAS floor (one GEMM; the four GEMMs of a recompute design;
three GEMMs), naive torch (fp32 logits), ``torch.compile`` of it, Liger's fused linear CE
(``reduction="none"``, no temperature), Liger's fused linear scaled CE (through
``mcore_ppo.liger_log_probs_and_entropy``), verl's ``linear_cross_entropy``, and this project's
``triton`` (built from a ``TritonConfig``) and ``torch`` backends. Per
implementation: forward, no-grad forward and forward+backward medians, ratios to the floor,
peak extra memory of forward+backward (everything allocated above the inputs, the output
gradients included), memory a no-grad forward leaves behind beyond its outputs, and relative
errors (‖out − ref‖₂ / ‖ref‖₂) of log-prob, entropy, d_hidden and d_weight against a float64
reference of all N tokens. Peers that are not installed are reported as skipped. Beside
``ours_triton``, on the same inputs: its forward with Σπ² (``return_sum_pi_squared=True``)
against its plain forward, alternating order, medians and ratio (``sum_pi_squared`` in each
entry; :mod:`mcore_ppo_testing.bench_sum_pi`; ``--sum-pi-squared-rounds 0`` skips it).

Usage (GPU):  python scripts/bench_head.py [--shapes qwen7b,llama3-8b] [--tp 1,2,4,8] [--tune]
Writes ``<out>/bench_head.json`` (after every configuration) and ``<out>/bench_head.png``.
Without a GPU: ``--merge`` of earlier JSON reports. Helpers: :mod:`mcore_ppo_testing.bench`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

# `python scripts/bench_head.py` puts scripts/ first on sys.path: the harness (mcore_ppo_testing) is not
# installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.bench import (
    GIB,
    SHAPES,
    HeadInputs,
    Progress,
    Timer,
    build_impls,
    fp32_gemm_path,
    fp64_reference,
    make_inputs,
    merge_reports,
    ours,
    peer_versions,
    plot,
    print_table,
    rel_err,
)
from mcore_ppo_testing.bench_sum_pi import record_sum_pi_squared
from mcore_ppo_testing.reports import DefaultsHelpFormatter


def measure_floor(inputs: HeadInputs, timer: Timer) -> dict:
    x, w = inputs.x, inputs.w
    dz = torch.randn(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return {
        "gemm1_ms": timer(lambda: torch.mm(x, w.t()), 2 * timer.reps),
        "gemm3_ms": timer(lambda: (torch.mm(x, w.t()), torch.mm(dz, w), torch.mm(dz.t(), x))),
        "gemm4_ms": timer(lambda: (torch.mm(x, w.t()), torch.mm(x, w.t()), torch.mm(dz, w), torch.mm(dz.t(), x))),
    }  # dz is freed with this frame


def measure_impl(fn, info: dict, inputs: HeadInputs, temperature: float, reps: int, refs, timer: Timer) -> dict:
    """Memory, errors against ``refs`` and timings of one implementation ``fn``."""
    x, w, labels, g, e = inputs.x, inputs.w, inputs.labels, inputs.g, inputs.e
    res: dict[str, object] = {}
    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)

    def nograd():
        with torch.no_grad():
            return fn(x, w, labels, temperature)

    def forward_backward():
        logp, ent = fn(xg, wg, labels, temperature)
        outs, grads = ([logp], [g]) if ent is None else ([logp, ent], [g, e])
        torch.autograd.backward(outs, grads)
        return logp, ent

    def fwd_bwd():
        xg.grad = wg.grad = None
        forward_backward()

    # A warm-up step compiles (Triton, torch.compile, CuTe); the next one is measured for memory
    # and checked for correctness.
    fwd_bwd()
    torch.cuda.synchronize()
    xg.grad = wg.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent = forward_backward()
    torch.cuda.synchronize()
    res["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    ref_logp, ref_ent, ref_dh, ref_dw = refs
    valid = labels != -100
    res["logp_rel_err"] = rel_err(logp.detach().float()[valid], ref_logp[valid])
    res["entropy_rel_err"] = rel_err(ent.detach().float()[valid], ref_ent[valid]) if ent is not None else None
    res["entropy_dtype"] = str(ent.dtype).replace("torch.", "") if ent is not None else None
    if ref_dh is not None:
        res["dhidden_rel_err"] = rel_err(xg.grad, ref_dh)
        res["dweight_rel_err"] = rel_err(wg.grad, ref_dw)
    del logp, ent
    xg.grad = wg.grad = None

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    kept = nograd()
    torch.cuda.synchronize()
    out_bytes = sum(t.numel() * t.element_size() for t in kept if t is not None)
    res["nograd_retained_bytes"] = torch.cuda.memory_allocated() - base - out_bytes
    del kept

    res["fwd_ms"] = timer(lambda: fn(xg, wg, labels, temperature), reps * 2)
    res["nograd_fwd_ms"] = timer(nograd, reps * 2)
    res["fwd_bwd_ms"] = timer(fwd_bwd, reps)
    if info.get("time_host_exposed"):  # the same calls timed the other way (host latency hidden / exposed)
        other = timer.flipped()
        res["host_exposed"] = {"nograd_fwd_ms": other(nograd, reps * 2), "fwd_bwd_ms": other(fwd_bwd, reps)}
    xg.grad = wg.grad = None
    return res


def time_half_ignored(fn, inputs: HeadInputs, temperature: float, timer: Timer) -> dict:
    """Timings with every other token ignored (prompt tokens in RL batches): skipped GEMM work."""
    x, w, g, e = inputs.x, inputs.w, inputs.g, inputs.e
    half = inputs.labels.clone()
    half[::2] = -100
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def step():
        xg.grad = wg.grad = None
        logp, ent = fn(xg, wg, half, temperature)
        torch.autograd.backward([logp, ent], [g, e])

    with torch.no_grad():
        nograd = timer(lambda: fn(x, w, half, temperature), timer.reps * 2)
    return {"nograd_fwd_ms": nograd, "fwd_bwd_ms": timer(step)}


def head_step(inputs: HeadInputs, temperature: float, backend):
    """One forward+backward of the API on ``inputs`` with ``backend`` (a name or an object)."""
    fn = ours(backend)
    xg, wg = inputs.x.detach().requires_grad_(True), inputs.w.detach().requires_grad_(True)

    def step():
        xg.grad = wg.grad = None
        torch.autograd.backward(list(fn(xg, wg, inputs.labels, temperature)), [inputs.g, inputs.e])

    return step


def tune_triton(inputs: HeadInputs, temperature: float, timer: Timer) -> dict:
    """Time candidate tile configs of the forward and backward kernels; ``chosen`` holds the
    fastest (as dicts), ``config`` the :class:`TritonConfig` of them for the rest of the run."""
    from mcore_ppo.backends.triton_backend import TritonBackend
    from mcore_ppo.backends.triton_config import GPU_BACKWARD, GPU_FORWARD, TritonConfig

    # The default forward's tiles per split follow the shard: that one first (as the default
    # config, unchanged), then fixed ones and variants of it.
    shard_default = TritonBackend().forward_config_for(inputs.w.shape[0])
    fwd_candidates = [
        (shard_default, TritonConfig()),
        *((replace(GPU_FORWARD, tiles_per_split=t), None) for t in (8, 4, 2) if t != shard_default.tiles_per_split),
        (replace(shard_default, group_m=8), None),
        (replace(shard_default, use_tma=False, num_stages=3), None),
    ]
    fwd_candidates = [(c, config or TritonConfig(forward_config=c)) for c, config in fwd_candidates]
    bwd_candidates = [GPU_BACKWARD, replace(GPU_BACKWARD, num_stages=4), replace(GPU_BACKWARD, use_tma=False)]

    def forward_ms(config: TritonConfig) -> float:
        forward = ours(TritonBackend(config))
        with torch.no_grad():
            return timer(lambda: forward(inputs.x, inputs.w, inputs.labels, temperature), 2 * timer.reps)

    def step_ms(config: TritonConfig) -> float:
        return timer(head_step(inputs, temperature, TritonBackend(config)))

    out: dict[str, list] = {"forward": [], "backward": []}
    forward = _fastest(out["forward"], "ms", fwd_candidates, forward_ms)
    candidates = [(c, replace(forward, backward_config=c)) for c in bwd_candidates]
    chosen = _fastest(out["backward"], "fwd_bwd_ms", candidates, step_ms)
    backend = TritonBackend(chosen)
    out["chosen"] = {
        "forward": asdict(backend.forward_config_for(inputs.w.shape[0])),
        "forward_tiles_by_shard": backend.tiles_by_shard,
        "backward": asdict(backend.backward_config),
    }
    out["config"] = chosen
    out["breakdown"] = breakdown(inputs, temperature, timer, chosen)
    return out


def _fastest(log: list, key: str, candidates: list[tuple], measure):
    """The :class:`TritonConfig` of the fastest candidate ``(tile config, TritonConfig)``; each
    timing (or the error of a config that fails to compile) is appended to ``log``."""
    best = None
    for tiles, config in candidates:
        try:
            ms = measure(config)
        except Exception as err:  # a config that fails to compile is recorded and skipped
            log.append({"config": asdict(tiles), "error": repr(err)[:300]})
            continue
        log.append({"config": asdict(tiles), key: ms})
        if best is None or ms < best[1]:
            best = (config, ms)
    return best[0]


def breakdown(inputs: HeadInputs, temperature: float, timer: Timer, config) -> dict:
    """Where the time goes: backend calls alone vs the API, and a larger backward workspace
    (``config``: the run's :class:`TritonConfig`)."""
    from mcore_ppo.backends import fp32_gemms, triton_host
    from mcore_ppo.backends.base import GradientRequest, SavedTokens
    from mcore_ppo.backends.triton_backend import TritonBackend
    from mcore_ppo.statistics import DEFAULT

    x, w, labels = inputs.x, inputs.w, inputs.labels
    backend = TritonBackend(replace(config, buffer_budget_bytes=0))  # the recompute path
    valid = labels != -100
    local = torch.where(valid, labels, -1)
    flags = {"grad_needed": False, "statistics": DEFAULT}
    with torch.no_grad():
        stats = backend.shard_statistics(x, w, local, valid, temperature, **flags)
        lse, values = DEFAULT.finish(stats.m, stats.sums)  # one shard: no combine
        ent = values["entropy"]
    saved = SavedTokens(local, valid, lse, ent)

    def request() -> GradientRequest:
        return GradientRequest(inputs.g, inputs.e, need_hidden_grad=True, weight_grad=torch.zeros_like(w))

    reps = timer.reps
    res = {
        "compact_rows_ms": timer(lambda: triton_host.compact_rows(valid, backend.launcher.bound()), reps * 4),
        "backend_statistics_ms": timer(
            lambda: backend.shard_statistics(x, w, local, valid, temperature, **flags), reps * 2
        ),
        "backend_gradients_ms": timer(
            lambda: backend.shard_gradients(x, w, saved, request(), temperature=temperature), reps
        ),
        "dz_chunk_columns": backend.vocab_chunk(x.shape[0], w.shape[0], x.element_size()),
    }
    n, v = x.shape[0], w.shape[0]
    chunk = res["dz_chunk_columns"]
    dz = torch.randn(n, chunk, dtype=x.dtype, device=x.device)
    dh = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    chunks = -(-v // chunk)
    addmm = lambda: fp32_gemms.addmm_fp32(dh, dz, w[:chunk])
    res["cublas_dhidden_all_chunks_ms"] = chunks * timer(addmm, reps)
    res["cublas_dweight_all_chunks_ms"] = chunks * timer(lambda: torch.mm(dz.t(), x), reps)
    dz = dh = None  # free the 0.5 GiB before the next measurement
    # Informative only: a workspace above the memory target at this shape.
    wide = TritonBackend(replace(config, workspace_bytes=384 * 2**20))
    res["fwd_bwd_ms_workspace_384MiB"] = timer(head_step(inputs, temperature, wide), reps)
    return res


def with_entropy_off(impls: dict, config) -> dict:
    """``impls`` with ``ours_triton_noentropy`` right after ``ours_triton``: the same backend
    config (None: the defaults) with ``return_entropy=False`` (no ``u`` sums in the forward
    kernels, a two-value TP combine, no entropy term in the backward), timed beside the default
    in the same run; its log-prob and gradient errors are against the fp64 reference of
    ``Σ g·log_prob``."""
    from mcore_ppo.backends.triton_backend import TritonBackend

    fn = ours(TritonBackend(config), return_entropy=False)
    out = {}
    for name, impl in impls.items():
        out[name] = impl
        if name == "ours_triton":
            out["ours_triton_noentropy"] = (fn, None, {"entropy": False, "time_host_exposed": True})
    return out


def skip_reason(name: str, tp: int, args) -> str | None:
    """Why an implementation is not run at this TP size (device-time budget), or None."""
    for impl, flag, why in (
        ("torch_compile", args.compile_tp, "recompiles per shape; --compile-tp"),
        ("liger_scaled_ce", args.liger_scaled_tp, "device-time budget; --liger-scaled-tp"),
        ("ours_torch", args.torch_backend_tp, "fp32 reference backend; --torch-backend-tp"),
    ):
        if name == impl and tp not in {int(t) for t in flag.split(",") if t}:
            return f"not run at tp{tp} ({why})"
    return None


def measure_config(entry: dict, impls: dict, inputs: HeadInputs, args, timer: Timer, bar: Progress) -> None:
    """The floor, the fp64 reference and every implementation at one shard (into ``entry``)."""
    label, temperature = f"{entry['shape']} tp{entry['tp']}", entry["temperature"]
    entry["floor"] = measure_floor(inputs, timer)
    bar.update(f"{label} floor")
    refs = fp64_reference(inputs, temperature)
    refs_t1 = refs_logp_only = None
    bar.update(f"{label} fp64 reference")
    for name, (fn, skip, info) in impls.items():
        skip = skip or skip_reason(name, entry["tp"], args)
        if skip is not None:
            entry["impls"][name] = {"skipped": skip}
            bar.update(f"{label} {name}")
            continue
        try:
            r = refs
            if info.get("temperature") == 1.0:
                if refs_t1 is None:
                    refs_t1 = fp64_reference(inputs, 1.0, need_grads=False)
                r = refs_t1
            elif info.get("entropy") is False:  # gradients of Σ g·log_prob alone (no entropy term)
                if refs_logp_only is None:
                    refs_logp_only = fp64_reference(replace(inputs, e=None), temperature)
                r = refs_logp_only
            reps = 1 if name == "ours_torch" else args.reps
            res = measure_impl(fn, info, inputs, temperature, reps, r, timer)
            res.update({k: v for k, v in info.items() if k != "temperature"})
            if info.get("buffer"):
                res["buffer_gib"] = entry["tokens"] * entry["vocab_local"] * 2 / GIB
                res["fwd_bwd_ratio_vs_gemm3"] = res["fwd_bwd_ms"] / entry["floor"]["gemm3_ms"]
            if name == "ours_triton":
                res["addmm_path"] = fp32_gemm_path(inputs.x.device.type)
                res["half_ignored"] = time_half_ignored(fn, inputs, temperature, timer)
            res["fwd_ratio"] = res["fwd_ms"] / entry["floor"]["gemm1_ms"]
            res["fwd_bwd_ratio"] = res["fwd_bwd_ms"] / entry["floor"]["gemm4_ms"]
            res["peak_minus_grads_gib"] = res["peak_extra_gib"] - entry["output_grads_gib"]
            entry["impls"][name] = res
        except Exception as err:
            entry["impls"][name] = {"error": repr(err)[:500]}
            traceback.print_exc()
        torch.cuda.empty_cache()
        bar.update(f"{label} {name}")
    if "ours_triton" in impls and args.sum_pi_squared_rounds > 0:
        record_sum_pi_squared(entry, impls["ours_triton"][0], inputs, args.sum_pi_squared_rounds, timer, bar)
    entry["floor_after"] = measure_floor(inputs, timer)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--shapes", default="qwen7b,llama3-8b", help=f"comma list of model shapes: {', '.join(SHAPES)}")
    parser.add_argument("--tp", default="1,2,4,8", help="comma list of TP sizes (vocab shards)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--impls", default="all", help="comma list of implementation names, or all")
    parser.add_argument("--compile-tp", default="1", help="TP sizes where torch.compile runs (it recompiles per shape)")
    parser.add_argument("--torch-backend-tp", default="1,8", help="TP sizes where the slow fp32 torch backend runs")
    parser.add_argument(
        "--liger-scaled-tp", default="1,2,4,8", help="TP sizes where Liger's scaled CE runs (CuTe JIT per shape)"
    )
    parser.add_argument("--ignored-fraction", type=float, default=0.0, help="fraction of tokens with an ignored label")
    parser.add_argument(
        "--host-latency",
        choices=["hidden", "exposed"],
        default="hidden",
        help="hidden: GPU time, the host's work queued behind a spin as inside a model step; exposed: from an idle GPU",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed calls per implementation and shape")
    parser.add_argument("--sum-pi-squared-rounds", type=int, default=10, help="ours_triton without / with Σπ²; 0: no")
    parser.add_argument("--tune", action="store_true", help="pick the Triton tile configs by timing first")
    parser.add_argument("--out", default="docs/benchmarks", help="folder for the JSON / PNG files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--name", default="bench_head", help="stem of the JSON / PNG files")
    parser.add_argument("--merge", nargs="+", help="merge these JSON reports into <out>/<name>.json + plot, no GPU")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r} in --shapes (known: {', '.join(SHAPES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge_reports(args.merge, Path(args.out), args.name)
    if not torch.cuda.is_available():
        print("bench_head.py needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = Timer(reps=args.reps, hide_host_latency=args.host_latency == "hidden")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    tps = [int(t) for t in args.tp.split(",")]
    report = {
        "device": torch.cuda.get_device_name(),
        "host": platform.node(),
        "versions": peer_versions(),
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reference": "float64 on the GPU, all tokens (log-prob, entropy, d_hidden, d_weight)",
        "results": [],
    }
    json_path = out_dir / f"{args.name}.json"
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    impls = bar = None
    for shape in shapes:
        h, vocab = SHAPES[shape]
        for tp in tps:
            v, n = vocab // tp, args.tokens
            inputs = make_inputs(n, h, v, gen, ignored_fraction=args.ignored_fraction)
            entry = {"shape": shape, "tp": tp, "hidden": h, "vocab_local": v, "tokens": n}
            entry.update(temperature=args.temperature, output_grads_gib=(n * h + v * h) * 2 / GIB, impls={})
            if impls is None:  # after tuning on the first shard, which decides our tile configs
                config = None  # the TritonConfig of every ours_triton* (None: the defaults)
                if args.tune:
                    report["tuning"] = tune_triton(inputs, args.temperature, timer)
                    config = report["tuning"].pop("config")
                    print(json.dumps(report["tuning"]["chosen"]), file=sys.stderr)
                impls = with_entropy_off(build_impls(config), config)
                if args.impls != "all":
                    impls = {k: impl for k, impl in impls.items() if k in args.impls.split(",")}
                steps = len(impls) + 2 + ("ours_triton" in impls and args.sum_pi_squared_rounds > 0)
                bar = Progress(len(shapes) * len(tps) * steps, "bench")
            measure_config(entry, impls, inputs, args, timer, bar)
            report["results"].append(entry)
            json_path.write_text(json.dumps(report, indent=1))
            del inputs
            torch.cuda.empty_cache()
    bar.close()
    plot(report["results"], out_dir / f"{args.name}.png")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
