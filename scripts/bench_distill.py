#!/usr/bin/env python
"""Side-by-side benchmark of the teacher's top-k (``mcore_ppo.fused_topk``) on one GPU.

Per (global V, TP, k) on the same bf16 inputs (``n`` tokens, hidden ``h``, this rank's vocab
shard ``V/tp``), in one process, every implementation equally warmed and timed in the order
A B C D D C B A (medians of ``--reps`` calls per visit, both visits pooled):

- ``gemm``: one cuBLAS GEMM ``hidden @ W_shard.T`` with bf16 inputs and an fp32 output (the floor);
- ``triton``: ``fused_topk(..., impl="triton")`` (the fused kernel + the candidates' selection);
- ``triton_statistics``: ``topk_and_statistics(..., statistics=<entropy, Σπ²>, impl="triton")``,
  the same pass with the head's ``lse``, entropy and Σπ² of every token also reduced and
  finished (what verl's route hands the head with those outputs on);
- ``triton_rank`` (TP > 1): ``fused_topk(..., tp_group=)`` as rank 0 of a TP group of torch's
  fake process group (``torch.testing._internal.distributed.fake_pg``, a world of the largest
  ``--tp``; its collectives return at once): the shard's pass and the merge of the ranks'
  candidates, all of a rank's GPU work but the all-gather's own time. The fake all-gather gives
  no other rank's candidates, so its ids are not compared with fp64;
- ``torch``: ``fused_topk(..., impl="torch")`` (chunked cuBLAS GEMMs + ``torch.topk``);
- ``naive``: full fp32 logits per token chunk of ``--naive-chunk`` tokens, ``log_softmax``,
  ``torch.topk``, tail ``log(1 - Σ p_topk)`` (what a plain PyTorch teacher does).

Reported: median ms and the ratio to ``gemm`` twice, each call from an idle GPU (the host's work
before the first kernel counted) and queued behind a GPU spin (the GPU's time, as inside a model
step: the difference is host work); peak memory above the inputs (the outputs included), and
against float64 on ``--check-rows`` random tokens: the fraction of tokens whose ``k`` ids equal
the fp64 top-k's (a near-tie within fp32 rounding may legitimately differ), the largest
``|Δ log p|`` and the largest relative error of the tail mass ``Σ_{j∉S} p_j``. The fused kernel's
full tiles (the (row, tile) pairs recomputed whole) and a profile of one call are recorded too.

Usage (GPU): ``python scripts/bench_distill.py --out DIR [--vocab 151936,262144] [--tp 1,8]
[--k 8,64,128] [--reps 5]``. Writes ``DIR/bench_distill.json`` (after every configuration) and
``DIR/bench_distill.md``. ``--triton-variants 'candidates=3;block_n=256,candidates=4'`` also times
the kernel with other settings, one variant per comma, its settings joined by ``;``: each a field
of :class:`~mcore_ppo.distill.topk_config.TopKConfig` (``candidates=4``, ``splits=2``,
``sort_keys=0``, ``candidate_range=3-6``) or of its GPU tiles (``block_n=128``, ``use_tma=0``);
each variant is one ``TopKConfig`` passed as ``config=``.

One call on the lent H200 (device tool, ``carry=[".whl", ".carry"]``), the GPU test and then
the benchmark, logs under ``$OUT`` (about 5 minutes)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl .carry/*.whl; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1;
    timeout 170 python3 -m pytest tests/gpu/test_gpu_topk.py -q -p no:cacheprovider -rA 2>&1 \
      | tee $OUT/topk_gpu_test.log;
    timeout 300 python3 scripts/bench_distill.py --out $OUT --profile \
      --triton-variants 'candidates=3,candidates=4' 2>&1 | tee $OUT/bench_distill.log
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo.backends.fp32_gemms import mm_fp32
from mcore_ppo.backends.triton_host import GemmConfig
from mcore_ppo.distill import topk_triton
from mcore_ppo.distill.topk import fused_topk, topk_and_statistics
from mcore_ppo.distill.topk_config import TopKConfig
from mcore_ppo.statistics import Statistics
from mcore_ppo_testing.bench import GIB, event_times, fp32_gemm_path
from mcore_ppo_testing.fake_ranks import init_fake_world
from mcore_ppo_testing.topk_reference import full_pairs


def gemm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One cuBLAS GEMM, bf16 inputs, fp32 output (``mm(..., out_dtype=)`` where torch has it)."""
    return mm_fp32(x, w.t())


def naive_topk(x: torch.Tensor, w: torch.Tensor, k: int, temperature: float, chunk: int):
    """Plain PyTorch: fp32 logits per token chunk, log_softmax, topk, tail as 1 - Σ p."""
    n = x.shape[0]
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    logp = torch.empty(n, k, dtype=torch.float32, device=x.device)
    tail = torch.empty(n, dtype=torch.float32, device=x.device)
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        z = gemm_fp32(x[t0:t1], w).float().div_(temperature)
        lp = torch.log_softmax(z, dim=-1)
        del z
        vals, idx = torch.topk(lp, k, dim=-1)
        ids[t0:t1], logp[t0:t1] = idx, vals
        tail[t0:t1] = torch.log(torch.clamp(1.0 - vals.exp().sum(-1), min=0.0))
    return ids, logp, tail


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def fp64_reference(x, w, k, temperature, rows):
    z = (x[rows].double() @ w.double().t()) / temperature
    lp = torch.log_softmax(z, dim=-1)
    vals, ids = lp.sort(dim=-1, descending=True, stable=True)
    return ids[:, :k], vals[:, :k], torch.logsumexp(vals[:, k:], dim=-1), lp


def errors(out, ref, rows) -> dict:
    ids, logp, tail = (t[rows] for t in out)
    ref_ids, ref_logp, ref_tail, full = ref
    same = (ids == ref_ids).all(dim=-1).double().mean().item()
    # log p at the returned ids, from fp64: a near-tie swapped by rounding is not an error there.
    at_ids = full.gather(1, ids)
    d_logp = max((logp.double() - at_ids).abs().max().item(), (logp.double() - ref_logp).abs().max().item())
    finite = torch.isfinite(ref_tail)
    rel_tail = ((tail.double().exp() - ref_tail.exp()).abs() / ref_tail.exp()).where(finite, 0.0).max().item()
    return {"ids_equal_fraction": same, "max_abs_logp_err": d_logp, "max_rel_tail_err": rel_tail}


def candidate_stats(x, w, k, temperature) -> dict:
    """How many (row, tile) pairs the fused path recomputed whole (its full tiles), per call."""
    seen = {"full_pairs": 0}
    original = topk_triton._recompute_full_tiles

    def spy(tokens, weight, full, *rest):
        seen["full_pairs"] += len(full_pairs(full))
        return original(tokens, weight, full, *rest)

    topk_triton._recompute_full_tiles = spy
    try:
        fused_topk(x, w, k, temperature=temperature, impl="triton")
    finally:
        topk_triton._recompute_full_tiles = original
    seen["full_per_row"] = seen["full_pairs"] / x.shape[0]
    return seen


def profile_once(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)


def parse_variants(text: str) -> list[tuple[str, TopKConfig]]:
    """``name=value`` items, ``;``-joined within a variant, each variant one :class:`TopKConfig`:
    a field of its GPU tiles (``block_n=128``, ``num_stages=4``, ``use_tma=0``) or of the config
    itself (``candidates=4``, ``splits=2``, ``sort_keys=0``, ``full_tile_cost=250``,
    ``candidate_range=3-6``)."""
    tile_fields = {f.name for f in dataclasses.fields(GemmConfig)}
    config_fields = {f.name for f in dataclasses.fields(TopKConfig)} - {"tiles", "interpreter_tiles"}
    defaults = TopKConfig()
    variants = []
    for item in filter(None, text.split(",")):
        tiles: dict = {}
        fields: dict = {}
        for part in item.split(";"):
            name, _, value = part.partition("=")
            if name in tile_fields:
                tiles[name] = bool(int(value)) if name == "use_tma" else int(value)
            elif name in config_fields:
                fields[name] = _setting(name, value)
            else:
                raise SystemExit(f"--triton-variants: unknown setting {name!r} (a TopKConfig or GemmConfig field)")
        variants.append((f"triton[{item}]", TopKConfig(**fields, tiles=dataclasses.replace(defaults.tiles, **tiles))))
    return variants


def _setting(name: str, text: str):
    """One TopKConfig field's value from its text."""
    if name == "full_tile_cost":
        return float(text)
    if name == "sort_keys":
        return bool(int(text))
    if name == "candidate_range":
        low, _, high = text.partition("-")
        return int(low), int(high)
    return int(text)


# The head's optional outputs that verl's route can ask of the student's top-k pass.
HEAD_STATISTICS = Statistics.named(["entropy", "sum_pi_squared"])


def run_config(args, vocab: int, tp: int, k: int, x, w, report: dict) -> dict:
    """Every implementation at one (V, tp, k): times, peak memory, errors against fp64."""
    v = vocab // tp
    shard = w[:v]
    temperature = args.temperature
    impls = {
        "gemm": lambda: gemm_fp32(x, shard),
        "triton": lambda: fused_topk(x, shard, k, temperature=temperature, impl="triton"),
        "triton_statistics": lambda: topk_and_statistics(
            x, shard, k, statistics=HEAD_STATISTICS, temperature=temperature, impl="triton"
        )[0],
        "torch": lambda: fused_topk(x, shard, k, temperature=temperature, impl="torch"),
        "naive": lambda: naive_topk(x, shard, k, temperature, args.naive_chunk),
    }
    if tp > 1:
        group = fake_tp_group(tp, max(int(t) for t in args.tp.split(",")))
        impls["triton_rank"] = lambda: fused_topk(x, shard, k, temperature=temperature, impl="triton", tp_group=group)
    variants = parse_variants(args.triton_variants)
    settings = {}
    for name, config in variants:
        settings[name] = config
        impls[name] = lambda config=config: fused_topk(
            x, shard, k, temperature=temperature, impl="triton", config=config
        )
    failed = {}
    for name in list(impls):  # warm-up: compile, cuBLAS heuristics, allocator
        try:
            for _ in range(args.warmup):
                impls[name]()
            torch.cuda.synchronize()
        except Exception:  # one failing implementation must not lose the others' numbers
            failed[name] = traceback.format_exc()
            print(f"{name} failed:\n{failed[name]}", file=sys.stderr)
            del impls[name]
    names = list(impls)
    times = {name: [] for name in names}
    gpu_times = {name: [] for name in names}
    for name in names + names[::-1]:
        times[name] += event_times(impls[name], args.reps, hide_host_latency=False)
        gpu_times[name] += event_times(impls[name], args.reps, hide_host_latency=True)
    result = {"vocab": vocab, "tp": tp, "v_shard": v, "k": k, "n": x.shape[0], "h": x.shape[1], "impls": {}}
    if failed:
        result["failed"] = failed
    gemm_ms = statistics.median(times["gemm"])
    gemm_gpu_ms = statistics.median(gpu_times["gemm"])
    g = torch.Generator(device="cpu").manual_seed(1234)
    rows = torch.randperm(x.shape[0], generator=g)[: args.check_rows].to(x.device)
    ref = fp64_reference(x, shard, k, temperature, rows)
    for name in names:
        ms = statistics.median(times[name])
        gpu_ms = statistics.median(gpu_times[name])
        entry = {
            "median_ms": ms,
            "ratio_to_gemm": ms / gemm_ms,
            "times_ms": times[name],
            "gpu_median_ms": gpu_ms,
            "gpu_ratio_to_gemm": gpu_ms / gemm_gpu_ms,
            "gpu_times_ms": gpu_times[name],
        }
        if name in settings:
            # The variant's config as its fields: the JSON holds plain values.
            entry["settings"] = dataclasses.asdict(settings[name])
        entry["peak_extra_gib"] = peak_extra_bytes(impls[name]) / GIB
        if name not in ("gemm", "triton_rank"):
            out = impls[name]()
            entry.update(errors(tuple(out), ref, rows))
            del out
        result["impls"][name] = entry
    del ref
    if "triton" not in impls:
        return result
    result["triton_candidates"] = candidate_stats(x, shard, k, temperature)
    if args.profile and k == max(args.k_list):
        result["triton_profile"] = profile_once(impls["triton"])
        if "triton_rank" in impls:
            result["triton_rank_profile"] = profile_once(impls["triton_rank"])
    return result


@functools.cache
def fake_tp_group(tp: int, world: int) -> torch.distributed.ProcessGroup:
    """Ranks ``[0, tp)`` of a fake world of ``world`` ranks (made on the first call) whose
    rank 0 this process is (:mod:`mcore_ppo_testing.fake_ranks`); one group per ``tp``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init_fake_world(world)
    return dist.new_group(list(range(tp)))


def markdown(results: list[dict]) -> str:
    lines = [
        "| V | tp | V/tp | k | impl | idle ms | × GEMM | GPU ms | × GEMM | peak extra GiB | ids = fp64 "
        "| max abs Δlog p | max rel Δtail |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, e in r["impls"].items():
            err = (
                f"{e['ids_equal_fraction']:.4f} | {e['max_abs_logp_err']:.2e} | {e['max_rel_tail_err']:.2e}"
                if "ids_equal_fraction" in e
                else "- | - | -"
            )
            lines.append(
                f"| {r['vocab']} | {r['tp']} | {r['v_shard']} | {r['k']} | {name} | {e['median_ms']:.3f} | "
                f"{e['ratio_to_gemm']:.3f} | {e['gpu_median_ms']:.3f} | {e['gpu_ratio_to_gemm']:.3f} | "
                f"{e['peak_extra_gib']:.3f} | {err} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown results")
    parser.add_argument("--vocab", default="151936,262144", help="global vocab sizes, comma-separated")
    parser.add_argument("--tp", default="1,8", help="TP sizes: each row is one rank's shard V/tp")
    parser.add_argument("--k", default="8,64,128", help="top-k sizes, comma-separated")
    parser.add_argument("--n", type=int, default=16384, help="tokens per call")
    parser.add_argument("--h", type=int, default=3584, help="hidden size")
    parser.add_argument("--temperature", type=float, default=1.0, help="the logits are divided by it")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per visit (each variant is visited twice)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant before timing")
    parser.add_argument("--check-rows", type=int, default=256, help="tokens checked against float64")
    parser.add_argument("--naive-chunk", type=int, default=2048, help="token chunk of the plain-PyTorch peer")
    parser.add_argument(
        "--triton-variants",
        default="",
        help="extra teacher-kernel configurations to time: one variant per comma, its settings joined by ';', "
        "e.g. 'candidates=3;block_n=256,candidates=4'",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one fused call at the largest k (and one TP rank's at TP > 1)"
    )
    parser.add_argument(
        "--student",
        action="store_true",
        help="the student's fwd+bwd at k ids instead (mcore_ppo_testing/bench_student.py: vs the four-GEMM "
        "floor, a chunked PyTorch peer and Liger's fused-linear KL/JSD); writes bench_distill_student.*",
    )
    args = parser.parse_args()
    args.k_list = [int(v) for v in args.k.split(",")]
    if not torch.cuda.is_available():
        print("bench_distill: needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.student:
        from mcore_ppo_testing.bench_student import run_student_bench

        return run_student_bench(args)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gemm": fp32_gemm_path("cuda")["mm"],
        "args": {key: str(value) for key, value in vars(args).items()},
        "results": [],
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    vocabs = [int(v) for v in args.vocab.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.n, args.h, device="cuda", generator=g).to(torch.bfloat16)
    w_full = (torch.randn(max(vocabs), args.h, device="cuda", generator=g) * (2 / math.sqrt(args.h))).to(torch.bfloat16)
    started = time.time()
    for vocab in vocabs:
        for tp in (int(t) for t in args.tp.split(",")):
            for k in args.k_list:
                try:
                    result = run_config(args, vocab, tp, k, x, w_full, report)
                except Exception:
                    result = {"vocab": vocab, "tp": tp, "k": k, "error": traceback.format_exc(), "impls": {}}
                    print(result["error"], file=sys.stderr)
                report["results"].append(result)
                summary = ", ".join(
                    f"{name} {e['median_ms']:.2f} ms ({e['ratio_to_gemm']:.2f}x; GPU {e['gpu_ratio_to_gemm']:.2f}x)"
                    for name, e in result["impls"].items()
                )
                print(f"[{time.time() - started:6.1f}s] V {vocab} tp {tp} k {k}: {summary}", flush=True)
                if "triton_candidates" in result:
                    print(f"    candidates {result['triton_candidates']}", flush=True)
                for profiled in ("triton_profile", "triton_rank_profile"):
                    if profiled in result:
                        print(result[profiled], flush=True)
                (args.out / "bench_distill.json").write_text(json.dumps(report, indent=1))
                torch.cuda.empty_cache()
    table = markdown([r for r in report["results"] if r["impls"]])
    (args.out / "bench_distill.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
