"""Where a PPO step's GPU time goes, for ``scripts/bench_ppo.py --profile``: kernel time by category."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo_testing.ppo_bench import Bench


def _kernel_category(name: str, head_kernels: frozenset[str]) -> str:
    lowered = name.lower()
    if any(k in name for k in head_kernels):
        return "fused head (Triton)"
    if "nccl" in lowered:
        return "collectives (NCCL)"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if any(k in lowered for k in ("gemm", "xmma", "nvjet", "cutlass", "sm90_", "cublas")):
        return "GEMMs (cuBLAS)"
    return "elementwise and other"


def profile_step(
    bench: Bench, rollout: PackedRollout, variants: Sequence[str], say: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """GPU kernel time of one PPO step (log-prob pass + one update) per variant, by category
    (after a warm step on the same rollout), from ``torch.profiler``; rank 0's view."""
    from mcore_ppo import kernels

    head_kernels = frozenset(kernels.__all__)
    out: dict[str, dict[str, float]] = {}
    for variant in variants:
        bench.start_pass()
        actor = bench.actor(variant)
        bench.step(actor, rollout, epochs=1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if bench.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            s = bench.step(actor, rollout, epochs=1)
        del actor
        by_category: dict[str, float] = {}
        # Kernel events only: CPU ops (aten::mm, record_param_comms) carry their kernels' time too.
        # "nccl:..." are c10d's annotations of the NCCL kernels listed beside them: not counted twice.
        events = [
            e
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("nccl:")
        ]
        kernels_ms = sorted(((getattr(e, "self_device_time_total", 0.0) or 0.0) / 1e3, e.key) for e in events)[::-1]
        say(
            f"top kernels of one {variant} step (ms): "
            + "; ".join(f"{ms:,.1f} {name[:60]}" for ms, name in kernels_ms[:14])
        )
        for event in events:
            device_us = getattr(event, "self_device_time_total", 0.0) or 0.0
            if device_us > 0:
                category = _kernel_category(event.key, head_kernels)
                by_category[category] = by_category.get(category, 0.0) + device_us / 1e3
        by_category["step wall (s)"] = s["step_s"]
        out[variant] = by_category
    categories = sorted({c for v in out.values() for c in v if c != "step wall (s)"})
    say("GPU kernel time of one step (log-prob pass + 1 update), ms, rank 0:")
    say("| category | " + " | ".join(out) + " |")
    say("|---|" + "---|" * len(out))
    for c in categories:
        say(f"| {c} | " + " | ".join(f"{out[v].get(c, 0.0):,.1f}" for v in out) + " |")
    say(
        "| **all kernels** | "
        + " | ".join(f"{sum(x for k, x in out[v].items() if k != 'step wall (s)'):,.1f}" for v in out)
        + " |"
    )
    return out
