#!/usr/bin/env python
"""The log-prob mismatch of a bf16 model's LM head, four ways, against fp64 (one GPU).

A bf16 model at Qwen2.5-1.5B's head shape (h 1536, V 151,936), ``--tokens`` tokens, T 1, with
text-like logits: each weight row gets a Zipf frequency prior (``-1.1 log rank`` on a constant
hidden feature) beside random content, so a token's entropy is about 3 nats and its top
probability about 0.4 on average, as a language model's are. Hidden states and weight are bf16
(the model's values); the labels are sampled from the fp64 distribution, as rollout tokens are.

- ``head``: ``mcore_ppo.fused_log_probs_and_entropy`` with its default options (bf16 operands,
  exact products, fp32 accumulation);
- ``head_fp32_faithful``: the same values as fp32 through ``precision="fp32_faithful"``;
- ``fp32_lm_head``: fp32 logits ``[n, V]`` from an fp32 GEMM of the same values, then an fp32
  log-softmax (Megatron's ``logit_dtype=fp32``, NeMo-RL's ``fp32_lm_head``);
- ``bf16_logits``: bf16 logits from a bf16 GEMM, upcast, then an fp32 log-softmax (verl's
  logits path for a bf16 model).

Per variant: mean and max ``|Δ log p(label)|`` and ``|Δ entropy|``, the per-token KL(fp64 ‖ variant)
mean and max (the head's over ``--kl-tokens`` tokens through ``fused_log_probs_at`` at every id),
the forward's GPU time and its peak memory above the inputs. Every variant runs once (errors,
memory) before any is timed; then they are timed in the order A B C D D C B A (medians of 5
calls per visit, the two visits pooled), so the order favours none.

Usage (GPU):  python scripts/bench_mismatch.py [--tokens 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mcore_ppo
from mcore_ppo_testing.bench import event_times

HIDDEN, VOCAB = 1536, 151936


def text_like(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, HIDDEN, device="cuda", generator=gen)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (5.0 / math.sqrt(HIDDEN))
    x[:, 0] = 1.0
    w[:, 0] = -1.1 * torch.log(torch.arange(1, VOCAB + 1, device="cuda", dtype=torch.float32))
    return x.bfloat16(), w.bfloat16()


def materialised(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 log-softmax of the logits of one materialised variant."""
    if kind == "fp32_lm_head":
        return torch.log_softmax(torch.mm(x.float(), w.float().t()), dim=-1)
    return torch.log_softmax(torch.mm(x, w.t()).float(), dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kl-tokens", type=int, default=32, help="tokens of the head's KL (every id each)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mismatch: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    x, w = text_like(args.tokens, gen)
    labels = torch.empty(args.tokens, dtype=torch.int64, device="cuda")
    ref_lp, ref_ent = [], []
    w64 = w.double()
    for t0 in range(0, args.tokens, 256):
        logp = torch.log_softmax(x[t0 : t0 + 256].double() @ w64.t(), dim=-1)
        labels[t0 : t0 + 256] = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        ref_lp.append(logp.gather(1, labels[t0 : t0 + 256, None])[:, 0])
        ref_ent.append(-(logp.exp() * logp).sum(-1))
    ref_lp, ref_ent = torch.cat(ref_lp), torch.cat(ref_ent)

    def head(precision: str | None):
        xs, ws = (x, w) if precision is None else (x.float(), w.float())
        return lambda: mcore_ppo.fused_log_probs_and_entropy(xs, ws, labels, precision=precision)

    variants = {
        "head": head(None),
        "head_fp32_faithful": head("fp32_faithful"),
        "fp32_lm_head": lambda: _from_logits(materialised(x, w, "fp32_lm_head"), labels),
        "bf16_logits": lambda: _from_logits(materialised(x, w, "bf16_logits"), labels),
    }
    report = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "shape": {"model": "Qwen2.5-1.5B head", "n": args.tokens, "h": HIDDEN, "v": VOCAB, "seed": args.seed},
        "reference": {"mean_entropy": ref_ent.mean().item(), "mean_label_log_prob": ref_lp.mean().item()},
        "variants": {},
    }
    for name, fn in variants.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp, ent = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        d_lp = (lp.double() - ref_lp).abs()
        d_ent = (ent.double() - ref_ent).abs()
        report["variants"][name] = {
            "mean_abs_dlogp": d_lp.mean().item(), "max_abs_dlogp": d_lp.max().item(),
            "mean_abs_dentropy": d_ent.mean().item(), "max_abs_dentropy": d_ent.max().item(),
            "kl": _kl(name, x, w, args.kl_tokens), "peak_gib": peak / 2**30,
        }  # fmt: skip
        del lp, ent
    visits: dict[str, list[float]] = {name: [] for name in variants}
    for name in [*variants, *reversed(variants)]:
        visits[name].append(statistics.median(event_times(variants[name], 5)))
    for name, times in visits.items():
        report["variants"][name]["forward_ms"] = statistics.median(times)
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_mismatch.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _from_logits(logp: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _kl(name: str, x: torch.Tensor, w: torch.Tensor, tokens: int) -> dict:
    """Per-token KL(fp64 ‖ variant) over the first ``tokens`` tokens: mean and max."""
    xs = x[:tokens]
    logp64 = torch.log_softmax(xs.double() @ w.double().t(), dim=-1)
    if name.startswith("head"):
        ids = torch.arange(VOCAB, device="cuda").expand(tokens, VOCAB)
        precision = None if name == "head" else "fp32_faithful"
        xv, wv = (xs, w) if precision is None else (xs.float(), w.float())
        logp = mcore_ppo.fused_log_probs_at(xv, wv, ids, precision=precision, return_entropy=False)[0].double()
    else:
        logp = materialised(xs, w, name).double()
    kl = (logp64.exp() * (logp64 - logp)).sum(-1)
    return {"mean": kl.mean().item(), "max": kl.max().item(), "tokens": tokens}


if __name__ == "__main__":
    raise SystemExit(main())
