"""The PPO step benchmark behind ``scripts/bench_ppo.py``: the fused head against the logits path.

Both variants run the same PPO actor (:class:`mcore_ppo.actor.MegatronPPOActor`, Megatron's
forward-backward schedule, packed THD micro-batches) on the same model, from the same initial
parameters, on the same rollouts; they differ only in how log-probs and entropy leave the model
(``fused``: the fused head; ``logits``: the model's vocab-parallel logits, Megatron's
cross-entropy and verl's vocab-parallel entropy, :class:`mcore_ppo_testing.logits_path.LogitsPath`).

How the timing is kept fair (whichever variant meets a sequence length first pays for it):

- **Equally warmed shapes.** Before anything is timed, every variant runs every rollout once.
  Then the timed passes run in the order ``A B B A`` (each variant once early and once late),
  each pass over all rollouts from the initial parameters with a fresh optimizer.
- **New shapes measured on their own.** Each variant then runs rollouts of lengths no step has
  seen (its own, so neither inherits the other's warm-up): the new-shape step time over the
  seen-shape median says what a real RL run, which meets new lengths every step, pays.

Memory measurements (long sequences, the largest micro-batch) are in
:mod:`mcore_ppo_testing.ppo_bench_memory`, the kernel-time profile in :mod:`mcore_ppo_testing.ppo_profile`.

One PPO step = a no-grad log-prob pass with entropy (the old policy) + ``ppo_epochs`` policy
updates on the same rollout; times are the slowest rank's. Peak memory is
``torch.cuda.max_memory_allocated``, reset before each pass.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo_testing.logits_path import LogitsPath
from mcore_ppo_testing.ppo_harness import synthetic_rollout

VARIANTS = ("fused", "logits")
# Unit roundoff of the logits' dtype (the logits path rounds them to it; the fused head does not).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
# Parity floor on top of the rounding bound: different GEMM kernels sum in different orders.
PARITY_FLOOR = 5e-5


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30


@dataclass
class Bench:
    """A model, its initial parameters and how to build each variant's actor over it."""

    model: torch.nn.Module
    actor_config: PPOActorConfig
    parallel: Any
    lr: float
    device: torch.device
    vocab: int
    ppo_epochs: int = 2

    def __post_init__(self) -> None:
        # Every pass starts from these parameters (kept on the host: no GPU memory).
        self.initial = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}
        self.cuda = self.device.type == "cuda"

    def reset(self) -> None:
        """Initial parameters, no gradients, the allocator's cache emptied."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.initial[name])
                p.grad = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def actor(self, variant: str, **config_overrides: Any) -> MegatronPPOActor:
        """A fresh actor (and AdamW state) for ``variant``; fused AdamW on CUDA (no foreach temporaries)."""
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0, fused=self.cuda)
        config = dataclasses.replace(self.actor_config, **config_overrides)
        forward_fn = LogitsPath() if variant == "logits" else None
        return MegatronPPOActor(self.model, optimizer, config, parallel=self.parallel, forward_fn=forward_fn)

    def step(self, actor: MegatronPPOActor, rollout: PackedRollout, *, epochs: int | None = None) -> dict[str, Any]:
        """One PPO step; times are the slowest rank's."""
        _sync()
        t0 = time.perf_counter()
        old_lp, _ = actor.compute_log_prob(rollout, calculate_entropy=True)
        _sync()
        t1 = time.perf_counter()
        rollout = dataclasses.replace(rollout, old_log_probs=old_lp)
        metrics = [actor.update_policy(rollout) for _ in range(self.ppo_epochs if epochs is None else epochs)]
        _sync()
        t2 = time.perf_counter()
        logprob_s, update_s = _max_over_ranks([t1 - t0, t2 - t1], self.device)
        return {
            "logprob_s": logprob_s,
            "update_s": update_s,
            "step_s": logprob_s + update_s,
            "tokens": int(rollout.tokens.numel()),
            "metrics": metrics,
        }

    def memory(self) -> tuple[int | None, int | None]:
        """(allocated now, peak since the last reset), bytes, this rank."""
        if not self.cuda:
            return None, None
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()

    def peak_over_ranks(self, peak: int | None) -> float | None:
        if peak is None:
            return None
        return _max_over_ranks([float(peak)], self.device)[0]

    def start_pass(self) -> int | None:
        self.reset()
        dist.barrier()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self.memory()[0]


# ---------------------------------------------------------------------------------------------
# Parity and the warmed timing


def parity(bench: Bench, rollout: PackedRollout, dtype: torch.dtype) -> dict[str, Any]:
    """Both variants' log-probs and entropy on the same parameters and rollout, with the bound
    rounding the logits to ``dtype`` allows (first order: |Δlog p| ≤ 2u·max|z|, |ΔH| ≤ u·max|z|²,
    doubled, plus a floor)."""
    bench.reset()
    path = LogitsPath()
    path.track_max_logit = True
    outputs = {}
    for variant in VARIANTS:
        actor = bench.actor(variant)
        if variant == "logits":
            actor.forward_fn = path
        outputs[variant] = actor.compute_log_prob(rollout, calculate_entropy=True)
        del actor
    mask = rollout.response_mask

    def masked_max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs()[mask].max()) if bool(mask.any()) else 0.0

    d_lp, d_ent, max_z = _max_over_ranks(
        [
            masked_max_abs(outputs["fused"][0], outputs["logits"][0]),
            masked_max_abs(outputs["fused"][1], outputs["logits"][1]),
            path.max_abs_logit,
        ],
        bench.device,
    )
    u = UNIT_ROUNDOFF[dtype]
    bound_lp = 2 * (2 * u * max_z) + PARITY_FLOOR
    bound_ent = 2 * (u * max_z**2) + PARITY_FLOOR
    return {
        "max_abs_d_log_prob": d_lp,
        "max_abs_d_entropy": d_ent,
        "bound_log_prob": bound_lp,
        "bound_entropy": bound_ent,
        "max_abs_logit_over_T": max_z,
        "response_tokens": int(mask.sum()),
        "ok": d_lp <= bound_lp and d_ent <= bound_ent,
    }


def warmed_timing(
    bench: Bench, rollouts: Sequence[PackedRollout], variants: Sequence[str], say: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """Every variant warmed on every rollout, then timed passes in the order A B B A (see the module doc)."""
    for variant in variants:
        bench.start_pass()
        actor = bench.actor(variant)
        for i, rollout in enumerate(rollouts):
            s = bench.step(actor, rollout)
            say(f"  warm-up {variant:>6} rollout {i + 1}/{len(rollouts)}: {s['step_s']:.3f} s")
        del actor
    order = list(variants) + list(reversed(variants))
    results: dict[str, dict[str, Any]] = {v: {"steps": [], "peak_bytes": 0, "resident_bytes": None} for v in variants}
    for pass_no, variant in enumerate(order, 1):
        resident = bench.start_pass()
        actor = bench.actor(variant)
        for i, rollout in enumerate(rollouts):
            s = bench.step(actor, rollout)
            s.update(rollout=i + 1, timed_pass=pass_no)
            results[variant]["steps"].append(s)
            m = s["metrics"][0]
            say(
                f"  pass {pass_no} {variant:>6} rollout {i + 1}: log-prob {s['logprob_s']:.3f} s, "
                f"{bench.ppo_epochs} updates {s['update_s']:.3f} s | loss {m['loss']:+.6f}, "
                f"entropy {m['entropy']:.5f}, grad_norm {m['grad_norm']:.5f}"
            )
        del actor
        peak = bench.peak_over_ranks(bench.memory()[1])
        entry = results[variant]
        if peak is not None:
            entry["peak_bytes"] = max(entry["peak_bytes"], peak)
            entry["resident_bytes"] = resident
    for entry in results.values():
        steps = entry["steps"]
        for key in ("logprob_s", "update_s", "step_s"):
            entry[f"median_{key}"] = statistics.median(s[key] for s in steps)
        entry["tokens_per_s"] = statistics.mean(s["tokens"] for s in steps) / entry["median_step_s"]
        entry["peak_gib"] = gib(entry["peak_bytes"]) if bench.cuda else None
    return results


def new_shape_timing(
    bench: Bench, fresh: dict[str, Sequence[PackedRollout]], seen: dict[str, dict[str, Any]], say: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """Each variant on rollouts of lengths never run before (its own), against its seen-shape median."""
    out = {}
    for variant, rollouts in fresh.items():
        bench.start_pass()
        actor = bench.actor(variant)
        steps = [bench.step(actor, r) for r in rollouts]
        del actor
        median_seen = seen[variant]["median_step_s"]
        ratios = [s["step_s"] / median_seen for s in steps]
        out[variant] = {"steps": steps, "step_s": [s["step_s"] for s in steps], "ratio_to_seen_median": ratios}
        say(
            f"  new shapes {variant:>6}: steps {', '.join(f'{s:.3f}' for s in out[variant]['step_s'])} s "
            f"= {', '.join(f'{r:.2f}' for r in ratios)} × the seen-shape median {median_seen:.3f} s"
        )
    return out


def rollouts_for(
    *, count: int, seed: int, num_seqs: int, vocab: int, prompt_len: Sequence[int], response_len: Sequence[int], device
) -> list[PackedRollout]:
    """``count`` synthetic rollouts (random lengths in the ranges), seeds ``seed .. seed + count - 1``."""
    return [
        synthetic_rollout(
            num_seqs=num_seqs,
            vocab_size=vocab,
            prompt_len=prompt_len,
            response_len=response_len,
            seed=seed + i,
            device=device,
        )
        for i in range(count)
    ]


def ratio_lines(results: dict[str, dict[str, Any]], cuda: bool) -> list[str]:
    """The fused/logits ratios of a warmed timing."""
    if not {"fused", "logits"} <= results.keys():
        return []
    f, lg = results["fused"], results["logits"]
    line = (
        f"fused/logits: step time {f['median_step_s'] / lg['median_step_s']:.3f}×, "
        f"log-prob pass {f['median_logprob_s'] / lg['median_logprob_s']:.3f}×, "
        f"updates {f['median_update_s'] / lg['median_update_s']:.3f}×"
    )
    if cuda:
        line += f"; peak memory {f['peak_gib'] - lg['peak_gib']:+.2f} GiB"
    return [line]


def table(results: dict[str, dict[str, Any]], ppo_epochs: int) -> list[str]:
    """The warmed timing as a markdown table."""

    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = [
        f"| variant | log-prob pass (s) | {ppo_epochs} updates (s) | step (s) | tokens/s (step) | peak memory (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {r['median_logprob_s']:.3f} | {r['median_update_s']:.3f} | {r['median_step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {fmt(r['peak_gib'], '.2f')} |"
        )
    return lines


class Report:
    """The run's JSON, rewritten after every phase (rank 0)."""

    def __init__(self, path: str | None, header: dict[str, Any]) -> None:
        self.path, self.data = path, dict(header)

    def add(self, key: str, value: Any) -> None:
        self.data[key] = value
        if self.path and dist.get_rank() == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)
