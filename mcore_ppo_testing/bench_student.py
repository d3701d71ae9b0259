"""The student side of ``scripts/bench_distill.py --student``: forward + backward of the student's
log-probs at a teacher's ``k`` ids per token, side by side on one GPU.

Per (global V, TP, k), one rank's work at that TP in one process: its vocab shard ``V/tp`` (the
first), ``n`` tokens of bf16 hidden size ``h``, and per token the teacher's top-``k`` ids over the
*global* vocab, of which the shard gets its share: the ids inside it, every other slot set to the
ignore index (-100), as the rank's own slots are all it works on (at tp 8 about an eighth of the
slots; a token with none of its ids in the shard is then skipped, which the teacher's top-64 of a
152k vocab makes rare). Upstream gradients ``g [n, k]``; every implementation warmed and timed in
the order A B C ... C B A (medians of ``reps`` calls per visit, both visits pooled):

- ``gemm4``: the four-GEMM floor of a recompute design (logits GEMM in the forward, again in the
  backward, then ``dz @ W`` and ``dzᵀ @ x``), bf16 inputs, fp32 logits;
- ``fused``: ``mcore_ppo.fused_log_probs_at`` (``backend="auto"``: the triton backend) + backward;
- ``fused_torch``: the same with ``backend="torch"`` (chunked cuBLAS) for the dense part;
- ``fused_sparse_torch``: ``fused`` with the sparse part (the ``k`` gathered logits and their
  gradients) on a torch path (:class:`SparseOnTorch`, a backend object around the same backend:
  gathered rows and bmm for the logits, bmm and ``index_add_`` for their gradients after the
  dense ones) instead of the gather kernel and the one-hot gradients folded into the triton
  backend's ``dz``;
- ``chunked``: plain PyTorch, token chunks of ``chunk`` rows under ``torch.utils.checkpoint``:
  fp32 logits, ``log_softmax``, ``gather`` at the ids, 0 in an ignored slot (a peer that holds
  one chunk of logits);
- ``liger_kl``: Liger's ``LigerFusedLinearKLDivLoss`` against the dense ``[n, V/tp]`` target
  made of the shard's top-k probabilities (what it needs: the target is materialised; not the same loss:
  its KL is over the whole vocab with zeros off the top-k);
- ``liger_jsd``: Liger's ``LigerFusedLinearJSD`` (``jsd_beta=0``), which also runs the teacher's
  projection (twice the GEMM work of the others), for reference.

Reported: median ms, ratio to ``gemm4``, peak memory above the inputs, and for ``fused`` /
``fused_torch`` / ``fused_sparse_torch`` / ``chunked`` the relative error of ``log q`` and
``d_hidden`` on ``check_rows`` tokens against float64 (``d_hidden`` of those rows only, from the fp64 full-vocab graph).
With ``--profile``, one ``fused`` call per configuration under ``torch.profiler``: its GPU kernels
by total time in ``profile_student_V{V}_tp{tp}_k{k}.txt`` and the top ones in the JSON.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from mcore_ppo import fused_log_probs_at
from mcore_ppo.backends import Backend, TorchBackend, resolve_backend
from mcore_ppo.backends.base import GradientRequest, SavedTokens
from mcore_ppo.numerics import accumulation_dtype, chunks
from mcore_ppo_testing.bench import GIB, event_times

__all__ = ["SparseOnTorch", "run_student_bench"]

IGNORE = -100  # the ignore index of the slots outside the shard
DEVICE = "cuda"  # a CPU smoke run of the code sets "cpu" (and stubs the CUDA timers)


def _peak(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return torch.mm(a, b).float()


class SparseOnTorch:
    """``dense`` (a backend object) with the ``k`` ids' part on a torch path: the logits at the
    ids by :meth:`TorchBackend.gather_logits` (gathered rows, a batched GEMM), and their one-hot
    gradients not folded into ``dense``'s ``dz`` but added after its dense gradients, in token
    chunks of gathered rows: a batched GEMM into ``d_hidden`` (fp32) and ``index_add_`` into
    ``d_weight``. Everything else is ``dense``'s."""

    name = "sparse-on-torch"

    def __init__(self, dense: Backend, gather_elements: int = 1 << 25):
        self.dense = dense
        # Its one-hot gradients are added to d_W after the dense backend's rows: an fp32 buffer,
        # zeroed (a weight-dtype one would round each row twice).
        self.capabilities = replace(dense.capabilities, weight_grad_in_weight_dtype=False, writes_weight_grad=False)
        self.gather_elements = gather_elements
        self._torch = TorchBackend()

    def unsupported(self, hidden: torch.Tensor) -> str | None:
        return self.dense.unsupported(hidden)

    def fused_forward_for(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.dense.fused_forward_for(hidden, weight)

    def residual_spec(self, hidden: torch.Tensor, weight: torch.Tensor, **kwargs):
        return self.dense.residual_spec(hidden, weight, **kwargs)

    def shard_statistics(self, *args, **kwargs):
        return self.dense.shard_statistics(*args, **kwargs)

    def head_forward(self, *args, **kwargs):
        return self.dense.head_forward(*args, **kwargs)

    def gather_logits(self, hidden, weight, local_ids, temperature):
        return self._torch.gather_logits(hidden, weight, local_ids, temperature)

    def shard_gradients(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        saved: SavedTokens,
        request: GradientRequest,
        *,
        temperature: float | torch.Tensor,
    ):
        sparse = request.sparse
        d_hidden, d_weight = self.dense.shard_gradients(
            hidden, weight, saved, replace(request, sparse=None), temperature=temperature
        )
        if sparse is None or (d_hidden is None and d_weight is None):
            return d_hidden, d_weight
        n, h = hidden.shape
        k = sparse.ids.shape[1]
        acc = accumulation_dtype(hidden.dtype)
        in_shard = sparse.ids >= 0
        local = sparse.ids.clamp(min=0)
        scale = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
        g = torch.where(in_shard, sparse.g, 0.0) / scale
        # Ignored tokens' hidden states may be anything (inf padding): never let them into a product.
        x_all = torch.where(saved.valid[:, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        d_hidden = None if d_hidden is None else d_hidden.to(acc)
        for t0, t1 in chunks(n, max(1, self.gather_elements // max(1, k * h))):
            g_c = g[t0:t1].to(acc)
            if d_hidden is not None:
                rows = weight[local[t0:t1]].to(acc)  # [c, k, h]
                d_hidden[t0:t1] += torch.bmm(g_c[:, None, :], rows).squeeze(1)
            if d_weight is not None:
                x_c = x_all[t0:t1].to(acc)
                d_weight.index_add_(
                    0, local[t0:t1].reshape(-1), (g_c[:, :, None] * x_c[:, None, :]).reshape(-1, h).to(d_weight.dtype)
                )
        return d_hidden, d_weight


def _chunked_log_q(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, temperature: float, chunk: int):
    def part(x_c, w_, ids_c):
        # Differentiable (mm with out_dtype has no derivative): the bf16 product, then fp32.
        log_p = torch.log_softmax(torch.mm(x_c, w_.t()).float() / temperature, dim=-1)
        return torch.where(ids_c >= 0, log_p.gather(-1, ids_c.clamp(min=0)), 0.0)

    return torch.cat(
        [
            checkpoint(part, x[t0 : t0 + chunk], w, ids[t0 : t0 + chunk], use_reentrant=False)
            for t0 in range(0, x.shape[0], chunk)
        ]
    )


def _implementations(x, w, ids, g, teacher, temperature: float, chunk: int):
    """``({name: call}, the hidden leaf whose .grad the calls with a backward leave)``."""
    n = ids.shape[0]
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def zero():
        xg.grad = wg.grad = None

    def gemm4():
        _mm32(x, w.t())
        dz = _mm32(x, w.t()).to(x.dtype)
        torch.mm(dz, w)
        torch.mm(dz.t(), x)

    def fused(backend):
        def run():
            zero()
            log_q, _ = fused_log_probs_at(
                xg, wg, ids, temperature=temperature, backend=backend, return_entropy=False, validate=False
            )
            log_q.backward(g)
            return log_q

        return run

    def chunked():
        zero()
        log_q = _chunked_log_q(xg, wg, ids, temperature, chunk)
        log_q.backward(g)
        return log_q

    impls = {
        "gemm4": gemm4,
        "fused": fused("auto"),
        "fused_torch": fused("torch"),
        "fused_sparse_torch": fused(SparseOnTorch(resolve_backend("auto", x.device))),
        "chunked": chunked,
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD, LigerFusedLinearKLDivLoss
    except ImportError:
        return impls, xg
    t_ids, t_probs, t_hidden, t_weight = teacher
    kl_loss = LigerFusedLinearKLDivLoss(reduction="sum", temperature=temperature)
    jsd = LigerFusedLinearJSD(jsd_beta=0.0, temperature=temperature)
    in_shard = t_ids >= 0
    target = torch.zeros(n, w.shape[0], dtype=x.dtype, device=x.device).scatter_add_(
        1, torch.where(in_shard, t_ids, 0), torch.where(in_shard, t_probs, 0.0).to(x.dtype)
    )

    def liger_kl():
        zero()
        kl_loss(xg, wg, target).backward()

    def liger_jsd():
        zero()
        jsd(xg, wg, t_hidden, t_weight, None).backward()

    impls.update(liger_kl=liger_kl, liger_jsd=liger_jsd)
    return impls, xg


def _profile(call: Callable[[], object], path: Path) -> list[dict]:
    """One call of ``call`` under ``torch.profiler`` (after a synchronise): its GPU kernels by
    total time, as a table in ``path`` and the top 12 as ``[{"name", "ms", "calls"}]``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="device_time_total", row_limit=25))
    kernels = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:12]
    return [{"name": e.key[:80], "ms": e.device_time_total / 1e3, "calls": e.count} for e in kernels]


def _errors(x, w, ids, g, temperature: float, rows: torch.Tensor, out: torch.Tensor, d_hidden: torch.Tensor) -> dict:
    x64 = x[rows].double().requires_grad_(True)
    log_p = torch.log_softmax(x64 @ w.double().t() / temperature, dim=-1)
    ids_r = ids[rows]
    ref = torch.where(ids_r >= 0, log_p.gather(-1, ids_r.clamp(min=0)), 0.0)
    (d_ref,) = torch.autograd.grad((ref * g[rows].double()).sum(), x64)

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-300))

    return {"log_q_rel_err": rel(out[rows], ref.detach()), "d_hidden_rel_err": rel(d_hidden[rows], d_ref)}


def run_config(args, vocab: int, tp: int, k: int, x: torch.Tensor, w_full: torch.Tensor) -> dict:
    shard = vocab // tp
    w = w_full[:shard]
    gen = torch.Generator(device=DEVICE).manual_seed(vocab * 131 + tp * 17 + k)
    # The teacher's top-k of a nearby distribution: a perturbed student stands in for it.
    t_hidden = (x.float() + 0.1 * torch.randn(x.shape, device=DEVICE, generator=gen)).to(x.dtype)
    t_weight = w
    with torch.no_grad():
        # The teacher's top-k over the global vocab; the shard (rows [0, V/tp)) keeps its share.
        top = torch.topk(_mm32(t_hidden[:2048], w_full[:vocab].t()), k, dim=-1).indices
        top = torch.where(top < shard, top, IGNORE)
    ids = top.repeat((x.shape[0] + 2047) // 2048, 1)[: x.shape[0]].contiguous()
    t_probs = torch.full(ids.shape, 1.0 / (k + 1), device=DEVICE)
    g = -torch.rand(ids.shape, device=DEVICE, generator=gen)
    impls, leaf = _implementations(x, w, ids, g, (ids, t_probs, t_hidden, t_weight), args.temperature, args.naive_chunk)
    in_shard = float((ids >= 0).float().mean())
    result: dict = {"vocab": vocab, "tp": tp, "k": k, "shard": shard, "slots_in_shard": in_shard, "impls": {}}
    names = list(impls)
    for name in names:
        try:
            for _ in range(args.warmup):
                impls[name]()
            torch.cuda.synchronize()
        except Exception:
            result["impls"][name] = {"error": traceback.format_exc(limit=3)}
            print(f"  {name}: failed\n{result['impls'][name]['error']}", file=sys.stderr, flush=True)
    working = [name for name in names if name not in result["impls"]]
    samples: dict[str, list[float]] = {name: [] for name in working}
    for name in working + working[::-1]:
        samples[name] += event_times(impls[name], args.reps, hide_host_latency=False)
    floor = statistics.median(samples["gemm4"]) if "gemm4" in samples else math.nan
    rows = torch.randperm(x.shape[0], device=DEVICE, generator=gen)[: args.check_rows]
    for name in working:
        median = statistics.median(samples[name])
        entry = {"median_ms": median, "ratio_to_gemm4": median / floor, "peak_extra_gib": _peak(impls[name]) / GIB}
        if name in ("fused", "fused_torch", "fused_sparse_torch", "chunked"):
            out = impls[name]()
            entry.update(_errors(x, w, ids, g, args.temperature, rows, out.detach(), leaf.grad))
        result["impls"][name] = entry
        torch.cuda.empty_cache()
    if getattr(args, "profile", False) and "fused" in working:
        path = args.out / f"profile_student_V{vocab}_tp{tp}_k{k}.txt"
        try:
            result["profile_fused"] = _profile(impls["fused"], path)
        except Exception:  # the timings above stay; the profile's failure is reported beside them
            result["profile_error"] = traceback.format_exc(limit=3)
            print(result["profile_error"], file=sys.stderr, flush=True)
    return result


def markdown(results: list[dict]) -> str:
    lines = [
        "| V | tp | k | impl | ms | × four-GEMM floor | peak extra GiB | log q rel err | d_hidden rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, e in r["impls"].items():
            if "error" in e:
                lines.append(f"| {r['vocab']} | {r['tp']} | {r['k']} | {name} | failed | | | | |")
                continue
            errs = [f"{e[key]:.1e}" if key in e else "" for key in ("log_q_rel_err", "d_hidden_rel_err")]
            lines.append(
                f"| {r['vocab']} | {r['tp']} | {r['k']} | {name} | {e['median_ms']:.2f} | {e['ratio_to_gemm4']:.2f} "
                f"| {e['peak_extra_gib']:.2f} | {errs[0]} | {errs[1]} |"
            )
    return "\n".join(lines) + "\n"


def run_student_bench(args) -> int:
    """``scripts/bench_distill.py --student``: every (V, tp, k) of the arguments; writes
    ``bench_distill_student.json`` (after every configuration) and ``.md`` under ``args.out``."""
    out: Path = args.out
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    report = {"device": device, "torch": torch.__version__, "results": []}
    vocabs = [int(v) for v in args.vocab.split(",")]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(args.n, args.h, device=DEVICE, generator=gen).to(torch.bfloat16)
    w_full = (torch.randn(max(vocabs), args.h, device=DEVICE, generator=gen) * (2 / math.sqrt(args.h))).to(
        torch.bfloat16
    )
    started = time.time()
    for vocab in vocabs:
        for tp in (int(t) for t in args.tp.split(",")):
            for k in args.k_list:
                try:
                    result = run_config(args, vocab, tp, k, x, w_full)
                except Exception:
                    result = {"vocab": vocab, "tp": tp, "k": k, "error": traceback.format_exc(), "impls": {}}
                    print(result["error"], file=sys.stderr, flush=True)
                report["results"].append(result)
                summary = ", ".join(
                    f"{name} {e['median_ms']:.2f} ms ({e['ratio_to_gemm4']:.2f}x)"
                    for name, e in result["impls"].items()
                    if "median_ms" in e
                )
                share = result.get("slots_in_shard", math.nan)
                print(
                    f"[{time.time() - started:6.1f}s] student V {vocab} tp {tp} k {k} (slots in shard {share:.3f}): "
                    f"{summary}",
                    flush=True,
                )
                (out / "bench_distill_student.json").write_text(json.dumps(report, indent=1))
                torch.cuda.empty_cache()
    table = markdown([r for r in report["results"] if r["impls"]])
    (out / "bench_distill_student.md").write_text(table)
    print(table, flush=True)
    return 0
