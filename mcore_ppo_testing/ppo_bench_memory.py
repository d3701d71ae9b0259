"""Memory as throughput, for ``scripts/bench_ppo.py``: long sequences, and the largest micro-batch.

:func:`long_context` runs one sequence per micro-batch at growing lengths (CP splits each
sequence over the CP ranks inside the model) and records step time and peak memory per variant;
:func:`max_micro_batch` finds, on one GPU, the largest micro-batch each variant runs before CUDA
runs out of memory, and its throughput. Both use :class:`mcore_ppo_testing.ppo_bench.Bench`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo_testing.ppo_bench import Bench, gib
from mcore_ppo_testing.ppo_harness import synthetic_rollout


def fixed_length_rollout(
    *, num_seqs: int, length: int, vocab: int, seed: int, device: torch.device, prompt: int | None = None
) -> PackedRollout:
    """``num_seqs`` sequences of exactly ``length`` tokens (a quarter prompt, unless given)."""
    prompt = max(1, length // 4) if prompt is None else prompt
    return synthetic_rollout(
        num_seqs=num_seqs,
        vocab_size=vocab,
        prompt_len=(prompt, prompt),
        response_len=(length - prompt, length - prompt),
        seed=seed,
        device=device,
    )


def _measured_step(bench: Bench, variant: str, rollout: PackedRollout, max_tokens: int) -> dict[str, Any] | None:
    """A warm step, then a timed one with peak memory reset before it (log-prob pass + 1 update),
    from the initial parameters; None when CUDA runs out of memory (the actor is dropped and the
    next :meth:`Bench.start_pass` frees and restores what the failed step left)."""
    bench.start_pass()
    actor = bench.actor(variant, max_tokens_per_micro_batch=max_tokens, micro_batch_size=None)
    try:
        bench.step(actor, rollout, epochs=1)
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats()
        return bench.step(actor, rollout, epochs=1)
    except torch.OutOfMemoryError:
        return None
    finally:
        del actor


def long_context(
    bench: Bench, lengths: Sequence[int], variants: Sequence[str], seed: int, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Per sequence length: one sequence per micro-batch, two sequences per rollout; a warm step,
    then a timed step with peak memory, per variant (variants alternate in order per length)."""
    rows = []
    for j, length in enumerate(lengths):
        rollout = fixed_length_rollout(num_seqs=2, length=length, vocab=bench.vocab, seed=seed + j, device=bench.device)
        row: dict[str, Any] = {"seq_len": length}
        for variant in variants if j % 2 == 0 else list(reversed(variants)):
            s = _measured_step(bench, variant, rollout, length + 64)
            if s is None:
                # Every rank holds the same shapes, so all run out at the same allocation and
                # none is left waiting in a collective (a lopsided failure would hit the timeout).
                row[variant] = {"oom": True}
                say(f"  long context {length} tokens {variant:>6}: out of memory")
                continue
            row[variant] = {"step_s": s["step_s"], "peak_gib": gib(bench.peak_over_ranks(bench.memory()[1]))}
            peak = row[variant]["peak_gib"]
            say(
                f"  long context {length} tokens {variant:>6}: step (log-prob + 1 update) {s['step_s']:.3f} s"
                + (f", peak {peak:.2f} GiB" if peak is not None else "")
            )
        rows.append(row)
    return rows


def max_micro_batch(
    bench: Bench, sizes: Sequence[int], variants: Sequence[str], seq_len: int, seed: int, say: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """The largest micro-batch (tokens) each variant runs (log-prob pass + one update) before CUDA
    runs out of memory, with the step time and throughput at each size that fits.

    Needs a world of one rank (an out-of-memory error on one of several ranks would leave the
    others waiting in a collective); sequences of ``seq_len`` tokens fill each micro-batch.
    """
    if dist.get_world_size() != 1:
        raise ValueError("max_micro_batch runs on one rank (torchrun --nproc_per_node 1)")
    out: dict[str, dict[str, Any]] = {}
    for variant in variants:
        rows = []
        for size in sorted(sizes):
            num_seqs = max(1, size // seq_len)
            rollout = fixed_length_rollout(
                num_seqs=num_seqs, length=seq_len, vocab=bench.vocab, seed=seed + size, device=bench.device
            )
            s = _measured_step(bench, variant, rollout, size)
            if s is None:
                rows.append({"micro_batch_tokens": num_seqs * seq_len, "oom": True})
                say(f"  max micro-batch {variant:>6}: {num_seqs * seq_len} tokens: out of memory")
                break
            peak = gib(bench.memory()[1])
            rows.append(
                {
                    "micro_batch_tokens": num_seqs * seq_len,
                    "oom": False,
                    "step_s": s["step_s"],
                    "tokens_per_s": s["tokens"] / s["step_s"],
                    "peak_gib": peak,
                }
            )
            say(
                f"  max micro-batch {variant:>6}: {num_seqs * seq_len} tokens: step {s['step_s']:.3f} s, "
                f"{s['tokens'] / s['step_s']:,.0f} tokens/s" + (f", peak {peak:.2f} GiB" if peak is not None else "")
            )
        fits = [r for r in rows if not r["oom"]]
        out[variant] = {"sizes": rows, "largest": fits[-1] if fits else None}
    return out
