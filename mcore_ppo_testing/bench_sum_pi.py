"""The cost of Σπ² (``return_sum_pi_squared=True``) in the head's forward, for ``scripts/bench_head.py``.

One measurement: the same inputs, the plain forward and the forward with Σπ², in alternating
order (round ``r``: plain first when ``r`` is even, Σπ² first when odd), so neither always runs
on a GPU the other has just warmed; medians over the rounds, and the ratio (the goal on an H200:
≤ 1.02, one more register sum per logit tile and one more value in the TP all-reduce). Both the
forward that a backward will follow (the autograd Function, as in a PPO step) and the no-grad
forward are timed. Σπ²'s error is measured against the fp64 full-softmax reference
(:func:`mcore_ppo_testing.reference.sum_pi_squared_reference`) on the first ``check_tokens`` tokens.

``time_call(fn) -> ms`` times one call: CUDA events on a GPU (:func:`gpu_timer`), the wall clock
elsewhere (:func:`wall_ms`, for the CPU smoke test at tiny shapes).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mcore_ppo_testing.reference import relative_error, sum_pi_squared_reference


def wall_ms(fn: Callable[[], Any]) -> float:
    """One call of ``fn`` timed by the host's clock (CPU tensors)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def gpu_timer(hide_host_latency: bool) -> Callable[[Callable[[], Any]], float]:
    """One call timed with CUDA events, the host latency hidden or exposed as the benchmark's
    :class:`~mcore_ppo_testing.bench.Timer` does."""
    from mcore_ppo_testing.bench import event_times

    return lambda fn: event_times(fn, 1, hide_host_latency=hide_host_latency)[0]


def record_sum_pi_squared(entry: dict, fn: Any, inputs: Any, rounds: int, timer: Any, bar: Any) -> None:
    """bench_head's step: :func:`sum_pi_squared_overhead` of ``ours_triton`` (``fn``, with its
    ``backend``) at one shard, into ``entry["sum_pi_squared"]`` (skipped where ``ours_triton``
    failed), a line on stderr, and the progress bar's step."""
    label = f"{entry['shape']} tp{entry['tp']}"
    if "error" not in entry["impls"].get("ours_triton", {}):
        entry["sum_pi_squared"] = res = sum_pi_squared_overhead(
            inputs.x, inputs.w, inputs.labels, entry["temperature"], fn.backend, rounds=rounds,
            time_call=gpu_timer(timer.hide_host_latency),
        )  # fmt: skip
        print(
            f"{label} Σπ² forward ratio {res['fwd_ratio']:.4f}, no-grad {res['nograd_fwd_ratio']:.4f}",
            file=sys.stderr,
        )
    bar.update(f"{label} sum_pi_squared")


def sum_pi_squared_overhead(
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    backend: Any,
    *,
    rounds: int = 10,
    time_call: Callable[[Callable[[], Any]], float] = wall_ms,
    check_tokens: int = 1024,
) -> dict:
    """Forward ms without and with Σπ² (median of ``rounds``, alternating order), their ratio,
    for the forward with a backward to come and the no-grad forward, and Σπ²'s relative error
    (normwise, valid tokens) against fp64 on the first ``check_tokens`` tokens."""
    from mcore_ppo import fused_log_probs_and_entropy

    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def call(with_sp: bool, grad: bool) -> Callable[[], Any]:
        def run():
            with torch.set_grad_enabled(grad):
                return fused_log_probs_and_entropy(
                    xg if grad else x, wg if grad else w, labels, temperature=temperature, backend=backend,
                    validate=False, return_sum_pi_squared=with_sp,
                )  # fmt: skip

        return run

    result: dict[str, Any] = {"rounds": rounds}
    for mode, grad in (("fwd", True), ("nograd_fwd", False)):
        plain, with_sp = call(False, grad), call(True, grad)
        plain(), with_sp()  # compile both variants before timing
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for flag in (False, True) if r % 2 == 0 else (True, False):
                times[flag].append(time_call(with_sp if flag else plain))
        base, extra = statistics.median(times[False]), statistics.median(times[True])
        result[f"{mode}_ms"] = base
        result[f"{mode}_sum_pi_squared_ms"] = extra
        result[f"{mode}_ratio"] = extra / base if base > 0 else None
    k = min(check_tokens, x.shape[0])
    with torch.no_grad():
        sp = call(True, False)()[2][:k]
    ref = sum_pi_squared_reference(x[:k], w, labels[:k], temperature)
    valid = labels[:k] != -100
    result["sum_pi_squared_rel_err"] = relative_error(sp[valid], ref[valid]) if bool(valid.any()) else None
    return result
