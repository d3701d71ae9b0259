#!/usr/bin/env python
"""verl's top-k distillation (``forward_kl_topk``) for the student: the plugin's fused route against
verl's logits path and verl's ``use_chunked_topk``, side by side on one GPU.

Two modes (``--mode step,longest``, both by default):

- ``step``: the student's whole ``forward_kl_topk`` step, forward and backward of the per-token
  KL's sum to ``hidden`` and the output weight, at ``--k`` (128), global V ``--vocab``
  (151,936), per ``--tp`` (1, 8) one rank's work on one GPU, ``--tokens`` tokens of bf16 hidden
  size ``--hidden``. At TP > 1 the process is rank 0 of a TP group of torch's fake process group
  (``torch.testing._internal.distributed.fake_pg``: every collective returns at once) and
  Megatron's ``parallel_state`` over it: the rank holds its vocab shard ``V/tp``, the labels and
  the teacher's ids are global ids in ``[0, V)`` (about ``1/tp`` of them in the shard, as a real
  rank sees them), and every route runs its TP code, the merges of the other ranks' parts
  included; what is left out is the collectives' own time. Its outputs are then not the KL (the
  other ranks' parts are missing), so the KL is compared at TP 1 only. Implementations:

  - ``fused``: the plugin's route (``mcore_ppo.integrations.verl.distill_topk.forward_kl_topk``:
    one head pass for verl's label and the teacher's ``k`` ids, ``fused_topk`` for the student's
    top-k, verl's KL arithmetic on ``[tokens, k]``), no logits;
  - ``verl_logits``: verl's Megatron logits path: the output layer's bf16 logits ``x @ W.T``,
    divided by the temperature, then verl's ``_VocabParallelKLDivergence`` (its fp32
    log-softmax, its saved probabilities and its backward);
  - ``verl_chunked``: verl's ``use_chunked_topk`` (``verl.trainer.distillation.fsdp.losses.
    compute_forward_kl_topk`` with ``DistillationLossConfig(use_chunked_topk=True)``, chunks of
    ``--chunk`` tokens) on the same logits; TP 1 only (verl's FSDP loss: it takes the whole
    vocab's logits, not a TP shard).

  Timed in the order A B C C B A (medians of ``--reps`` calls per visit, both visits pooled),
  the host's work queued behind a GPU spin (the GPU's time, as inside a model step); peak memory
  above the inputs; the largest difference of each implementation's per-token KL and
  ``d_hidden`` from ``verl_logits``'s.
- ``longest``: the longest single sequence each route fits in one distillation update of a
  ~1.8B GPT (bench_ppo's GPU shape: 28 layers, hidden 2048, 16 heads, FFN 6144, V 151,936,
  bf16, full activation recompute unless ``--no-recompute``), one GPU, TP 1: verl's own
  ``forward_step`` (``mcore_ppo_testing.verl_distill``) with verl's loss function and configs,
  then verl's distillation loss and the backward; ``fused`` with the plugin on verl's fused
  path, ``verl_logits`` on verl's logits path, ``verl_chunked`` on verl's logits path with verl's
  loss taking its chunked top-k (``strategy="fsdp"``: at TP 1 the same logits). Lengths double
  from ``--start-len`` while they fit, up to ``--max-len``, then bisect to ``--granularity``
  tokens; a length fits when its step raises no CUDA out-of-memory error.

``--smoke`` runs both modes on the CPU at a tiny shape (gloo, CPU shims, wall-clock times, no
memory figures) to check the script's logic; on a machine with GPUs it restarts itself with them
hidden (``CUDA_VISIBLE_DEVICES=""``), since the CPU shims refuse a machine where CUDA is
available. Writes ``DIR/bench_verl_distill.json`` (after every configuration) and ``.md``. No
timing is asserted; the exit status is 1 only if an implementation's KL differs from
``verl_logits``'s by more than bf16 rounding allows (2e-2).

Usage (GPU): ``python scripts/bench_verl_distill.py --out DIR [--tp 1,8] [--k 128] [--tokens 8192]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ppo_testing.reports import DefaultsHelpFormatter

_GPT = {"num_layers": 28, "hidden_size": 2048, "num_attention_heads": 16, "ffn_hidden_size": 6144}
_SMOKE_GPT = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
IMPLS = ("fused", "verl_logits", "verl_chunked")
KL_TOL = 2e-2  # bf16 logits against the head's fp32 accumulation, relative to 1 + |KL|


def teacher_topk(n: int, vocab: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's top-k per token without a teacher: ``k`` random ids in ``[0, vocab)`` and
    descending log-probs whose probabilities sum below 1."""
    ids = torch.randint(0, vocab, (n, k), generator=gen)
    logps = torch.sort(-8 * torch.rand(n, k, generator=gen), dim=-1, descending=True).values - 1.0
    return ids, logps


def _clock(device: str) -> Callable[[Callable[[], object], int], list[float]]:
    if device == "cuda":
        from mcore_ppo_testing.bench import event_times

        return lambda fn, reps: event_times(fn, reps)

    def wall(fn: Callable[[], object], reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return times

    return wall


def _peak(fn: Callable[[], object], device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# ------------------------------------------------------------------------------------------- step


def step_impls(x, w, labels, t_ids, t_logps, temperature, clamp, chunk, backend, head_outputs=(), tp_group=None):
    """name -> fn() running one forward + backward, returning ``(per-token KL, d_hidden)``;
    ``head_outputs``: what the fused route's head also outputs (``entropy``, ``sum_pi_squared``:
    verl's ``calculate_entropy`` and ``calculate_sum_pi_squared`` on that micro-batch);
    ``tp_group``: the TP group of the fused route (verl's own reads Megatron's); without one, all
    three routes, with one ``verl_chunked`` is left out (module doc)."""
    from verl.trainer.distillation.fsdp import losses as fsdp_losses
    from verl.trainer.distillation.megatron import losses as megatron_losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    from mcore_ppo.integrations.verl import distill_topk
    from mcore_ppo.options import HiddenGrad, Layout, TokenOrder, call_options

    kl_class = megatron_losses._VocabParallelKLDivergence  # verl's own, also with the plugin on
    kl_class = getattr(kl_class, "__mcore_ppo_original__", kl_class)
    config = DistillationConfig(
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=t_ids.shape[-1], log_prob_min_clamp=clamp,
            use_chunked_topk=True, chunked_topk_chunk_size=chunk, use_policy_gradient=False,
        )
    )  # fmt: skip
    nested = [torch.nested.as_nested_tensor([t], layout=torch.jagged) for t in (t_logps, t_ids)]
    options = call_options(
        None, ignore_index=None, backend=backend, return_entropy="entropy" in head_outputs,
        return_sum_pi_squared="sum_pi_squared" in head_outputs, validate=False,
    )  # fmt: skip
    layout = Layout(TokenOrder.MEGATRON, HiddenGrad.PARTIAL)

    def run(forward):
        x.grad = w.grad = None
        kl = forward(x.detach().requires_grad_())
        return kl

    def fused(h):
        student = distill_topk.Student(
            h, w, labels, temperature, tp_group, layout, options, "torch" if backend == "torch" else "auto", None
        )
        kl = distill_topk.forward_kl_topk(student, t_logps[None], t_ids[None], clamp)[0]
        kl.sum().backward()
        return kl.detach().reshape(-1), h.grad

    def logits(h):
        return (h @ w.t()).div_(temperature)[None]  # Megatron's output layer, then verl's division

    def verl_logits(h):
        kl = kl_class.apply(logits(h), t_logps[None], t_ids[None], clamp)[0]
        kl.sum().backward()
        return kl.detach().reshape(-1), h.grad

    def verl_chunked(h):
        out = fsdp_losses.compute_forward_kl_topk(logits(h), nested[0], nested[1], config, "thd")
        kl = out["distillation_losses"]
        kl.sum().backward()
        return kl.detach().reshape(-1), h.grad

    routes = (fused, verl_logits, verl_chunked) if tp_group is None else (fused, verl_logits)
    return {name: (lambda f=f: run(f)) for name, f in zip(IMPLS, routes, strict=False)}


def floor_impls(x, w, k: int, temperature: float, backend: str, tp_group=None) -> dict[str, Callable[[], object]]:
    """The yardsticks timed beside the routes: ``gemm4``, the four-GEMM floor of a recompute
    design (the logits GEMM in the forward and again in the backward, then ``dz @ W`` and
    ``dzᵀ @ x``; bf16 inputs, fp32 logits), and ``student_topk``, the fused route's own pass for
    the student's top-k ids alone (:func:`mcore_ppo.fused_topk`, no gradient)."""
    from mcore_ppo import fused_topk
    from mcore_ppo_testing.bench_student import _mm32

    def gemm4():
        _mm32(x, w.t())
        dz = _mm32(x, w.t()).to(x.dtype)
        torch.mm(dz, w)
        torch.mm(dz.t(), x)

    def student_topk():
        impl = "torch" if backend == "torch" else "auto"
        return fused_topk(x, w.detach(), k, temperature=temperature, tp_group=tp_group, impl=impl, validate=False).ids

    return {"gemm4": gemm4, "student_topk": student_topk}


def run_step(args, device: str, tp: int, report: dict) -> bool:
    """One ``--tp`` row of step mode, run inside :func:`rank_of` ``(device, tp)``; False when a
    route's KL is off verl's logits path's by more than ``KL_TOL`` (compared at TP 1)."""
    from megatron.core import parallel_state

    if args.vocab % tp:
        raise ValueError(f"--vocab {args.vocab} does not split over TP {tp}")
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    gen = torch.Generator().manual_seed(args.seed + tp)
    shard = args.vocab // tp  # rank 0's: the vocab's rows [0, V/tp)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = (torch.randn(args.tokens, args.hidden, generator=gen) / args.hidden**0.25).to(device, dtype)
    w = (torch.randn(shard, args.hidden, generator=gen) / args.hidden**0.25).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    t_ids, t_logps = (t.to(device) for t in teacher_topk(args.tokens, args.vocab, args.k, gen))
    outputs = tuple(name for name in args.head_outputs.split(",") if name)
    impls = step_impls(
        x, w, labels, t_ids, t_logps, args.temperature, args.clamp, args.chunk, args.backend, outputs, tp_group
    )
    names = tuple(impls)
    clock = _clock(device)
    row: dict = {
        "tp": tp, "vocab_shard": shard, "k": args.k, "tokens": args.tokens, "hidden": args.hidden,
        "fused_head_outputs": list(outputs), "teacher_ids_in_shard": float((t_ids < shard).float().mean()),
        "labels_in_shard": float((labels < shard).float().mean()),
    }  # fmt: skip
    results = {name: impls[name]() for name in names}  # warm-up, and the outputs compared
    ref_kl, ref_dh = results["verl_logits"]
    ok = True
    parts = floor_impls(x, w, args.k, args.temperature, args.backend, tp_group)
    for fn in parts.values():
        fn()  # warm-up
    order = (*parts, *names, *reversed(names), *reversed(parts))
    times: dict[str, list[float]] = {name: [] for name in (*names, *parts)}
    for name in order:
        times[name] += clock(parts[name] if name in parts else impls[name], args.reps)
    floor = statistics.median(times["gemm4"])
    row["gemm4_ms"] = floor
    row["student_topk_ms"] = statistics.median(times["student_topk"])
    for name in names:
        kl, dh = results[name]
        kl_err = dh_err = None  # one rank of a fake group: not the KL (module doc)
        if tp_group is None:
            kl_err = float(((kl.float() - ref_kl.float()).abs() / (1 + ref_kl.float().abs())).max())
            dh_err = float((dh.float() - ref_dh.float()).norm() / ref_dh.float().norm())
            ok &= kl_err <= KL_TOL
        gc.collect()
        row[name] = {
            "ms": statistics.median(times[name]),
            "ratio_to_gemm4": statistics.median(times[name]) / floor,
            "peak_gib": _peak(impls[name], device),
            "kl_max_rel_vs_verl_logits": kl_err,
            "d_hidden_normwise_vs_verl_logits": dh_err,
        }
    report["step"].append(row)
    return ok


# ---------------------------------------------------------------------------------------- longest


def fits(model, length: int, impl: str, args, device: str) -> bool:
    """One distillation update of one sequence of ``length`` tokens through verl's engine."""
    from mcore_ppo_testing import verl_distill, verl_engine

    gen = torch.Generator().manual_seed(length)
    sequence = torch.randint(0, args.vocab, (length,), generator=gen)
    teacher = tuple([t] for t in teacher_topk(length, args.vocab, args.k, gen))
    prompt = max(1, length // 8)
    chunked = impl == "verl_chunked"
    configs = verl_distill.distill_configs(
        args.k, args.clamp, distillation_only=True, strategy="fsdp" if chunked else "megatron",
        use_chunked_topk=chunked,
    )  # fmt: skip
    batch = verl_distill.make_distill_batch(
        [sequence], args.temperature, teacher, prompt_lengths=[prompt], calculate_entropy=False,
        distillation_only=True, device=device,
    )  # fmt: skip
    switch = verl_engine.plugin_on(args.backend) if impl == "fused" else contextlib.nullcontext()
    try:
        with switch:
            verl_distill.distill_step(model, batch, configs, use_fused_kernels=impl == "fused")
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as err:  # an allocation failing inside a library (cuBLAS, NCCL)
        if "out of memory" in str(err).lower() or "ALLOC_FAILED" in str(err):
            return False
        raise
    finally:
        del batch
        for param in model.parameters():
            param.grad = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def longest(model, impl: str, args, device: str) -> dict:
    good, bad, length = 0, None, args.start_len
    while length <= args.max_len:
        if not fits(model, length, impl, args, device):
            bad = length
            break
        good, length = length, 2 * length
    while bad is not None and bad - good > args.granularity:
        middle = (good + bad) // 2 // args.granularity * args.granularity or args.granularity
        if middle <= good:
            break
        good, bad = (middle, bad) if fits(model, middle, impl, args, device) else (good, middle)
    return {"impl": impl, "longest_fitting": good, "first_not_fitting": bad, "capped_at": args.max_len}


def run_longest(args, device: str, report: dict) -> None:
    from mcore_ppo_testing.gpt_builder import build_gpt_model
    from mcore_ppo_testing.layer_specs import local_gpt_spec

    shape = _SMOKE_GPT if args.smoke else _GPT
    recompute = {} if args.smoke or not args.recompute else dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )  # fmt: skip
    model = build_gpt_model(
        **shape, vocab_size=args.vocab, max_sequence_length=args.max_len, tie_embeddings=False,
        params_dtype=torch.float32 if device == "cpu" else torch.bfloat16, seed=args.seed,
        transformer_layer_spec=local_gpt_spec(attention="sdpa"), position_embedding_type="rope", **recompute,
    )  # fmt: skip
    report["longest_model"] = {**shape, "vocab": args.vocab, "recompute": bool(recompute)}
    for impl in IMPLS:
        report["longest"].append(longest(model, impl, args, device))
        print(json.dumps(report["longest"][-1]), flush=True)


# ------------------------------------------------------------------------------------------- main


def markdown(report: dict) -> str:
    lines = ["# verl top-k distillation: fused route vs verl's logits path vs use_chunked_topk", ""]
    if report["step"]:
        lines += [
            "| TP | V shard | k | tokens | impl | ms | × four-GEMM floor | peak GiB | KL rel vs verl_logits |",
            "|---" * 9 + "|",
        ]
        for row in report["step"]:
            if "error" in row:
                lines.append(f"| {row['tp']} | failed: see the JSON |" + " |" * 7)
                continue
            for name in (name for name in IMPLS if name in row):
                r = row[name]
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
                kl = r["kl_max_rel_vs_verl_logits"]
                lines.append(
                    f"| {row['tp']} | {row['vocab_shard']} | {row['k']} | {row['tokens']} | {name} | {r['ms']:.2f} | "
                    f"{r['ratio_to_gemm4']:.2f} | {peak} | {'-' if kl is None else f'{kl:.1e}'} |"
                )
            lines.append(
                f"| {row['tp']} | {row['vocab_shard']} | {row['k']} | {row['tokens']} | four-GEMM floor "
                f"(student top-k alone: {row['student_topk_ms']:.2f} ms) | {row['gemm4_ms']:.2f} | 1.00 | - | - |"
            )
    if report["longest"]:
        lines += ["", "| impl | longest single sequence | first not fitting |", "|---|---|---|"]
        lines += [f"| {r['impl']} | {r['longest_fitting']} | {r['first_not_fitting']} |" for r in report["longest"]]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def rank_of(device: str, tp: int = 1):
    """Rank 0 of a world of ``tp`` ranks and Megatron's parallel_state at TP ``tp`` (verl's KL
    reads its TP group); the CPU shims on the CPU. One rank is a real process group (nccl, gloo);
    more are torch's fake process group, whose collectives return at once (module doc)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_ppo_testing.real_verl import use_ray_standin

    use_ray_standin()
    if tp == 1:
        rendezvous = Path(tempfile.mkdtemp()) / "rendezvous"
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=0,
                                world_size=1)  # fmt: skip
    else:
        from mcore_ppo_testing.fake_ranks import init_fake_world

        init_fake_world(tp)
    if device == "cpu":
        from mcore_ppo_testing.cpu_shims import cpu_shims

        shims = cpu_shims()
    else:
        shims = contextlib.nullcontext()
    with shims:
        parallel_state.initialize_model_parallel(tp, create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_verl_distill_out"))
    parser.add_argument("--mode", default="step,longest", help="step, longest or both (comma-separated)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script's logic")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tp", default="1,8", help="vocab shards V/tp timed (step mode)")
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--clamp", type=float, default=-10.0, help="verl's log_prob_min_clamp (its default)")
    parser.add_argument("--chunk", type=int, default=4096, help="verl's chunked_topk_chunk_size (its default)")
    parser.add_argument("--backend", default="auto", help="the plugin's head backend")
    parser.add_argument(
        "--head-outputs", default="", help="the fused route's head also outputs: entropy,sum_pi_squared"
    )
    parser.add_argument("--start-len", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=262_144)
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.smoke and torch.cuda.is_available():
        # The smoke run is the CPU's (the shims refuse CUDA); CUDA, once queried, keeps its devices.
        arguments = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, __file__, *arguments], {**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if args.smoke:
        args.vocab, args.k, args.tokens, args.hidden, args.reps = 512, 8, 64, 32, 1
        args.start_len, args.max_len, args.granularity, args.backend = 16, 64, 16, "torch"
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    modes = {m.strip() for m in args.mode.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "args": {
        k: str(v) for k, v in vars(args).items()}, "step": [], "longest": []}  # fmt: skip
    ok = True

    def save() -> None:
        (args.out / "bench_verl_distill.json").write_text(json.dumps(report, indent=2))
        (args.out / "bench_verl_distill.md").write_text(markdown(report))

    if "step" in modes:
        for tp in (int(t) for t in args.tp.split(",")):
            try:
                with rank_of(device, tp):
                    ok &= run_step(args, device, tp, report)
            except Exception:
                traceback.print_exc()
                report["step"].append({"tp": tp, "error": traceback.format_exc(limit=3)})
                ok = False
            save()
    if "longest" in modes:
        with rank_of(device):
            run_longest(args, device, report)
        save()
    print(markdown(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
