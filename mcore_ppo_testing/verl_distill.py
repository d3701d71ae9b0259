"""verl's Megatron engine with top-k distillation and Σπ², as verl's trainer runs it (tests, comparisons).

verl's trainer sets three micro-batch flags that only its logits path served before the plugin:
``calculate_sum_pi_squared`` (the actor's log-prob pass, for the optimal-token baseline),
``distillation_use_topk`` and ``distillation_only`` (the actor's update with
``loss_mode="forward_kl_topk"``, whose per-token KL verl's loss function computes from the
student's logits inside ``forward_step``, given the teacher's ``teacher_ids`` /
``teacher_logprobs``, nested ``[b, j, k]``). This module builds such a micro-batch
(:func:`make_distill_batch`, with the fields verl's final distillation loss reads: prompts,
responses, response mask, global token counts), verl's own configs and loss function
(:func:`distill_configs`, ``distillation_ppo_loss`` bound as verl's worker binds it), and runs
verl's ``forward_step`` on it (:func:`distill_step`), then verl's distillation loss
(``verl.trainer.distillation.losses.distillation_loss``: the registered ``forward_kl_topk``,
its clamps, masks, metrics and ``agg_loss``) and a backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from mcore_ppo_testing import verl_engine

__all__ = ["DistillRun", "distill_configs", "distill_step", "make_distill_batch", "random_teacher"]

#: The outputs that carry gradients on verl's logits path (each gets its own random weights).
DIFFERENTIABLE = ("distillation_losses", "log_probs", "entropy")


def distill_configs(
    k: int,
    log_prob_min_clamp: float | None,
    *,
    distillation_only: bool,
    strategy: str = "megatron",
    use_chunked_topk: bool = False,
) -> tuple[Any, Any]:
    """verl's ``McoreActorConfig`` and ``DistillationConfig`` for ``forward_kl_topk`` (supervised:
    ``use_policy_gradient=False``; ``distillation_only`` also without task rewards).
    ``strategy="fsdp"`` makes verl's loss function take its FSDP top-k KL on the (full-vocab, TP 1)
    logits, with ``use_chunked_topk`` its chunked variant (benchmarks)."""
    from verl.workers.config import DistillationConfig, DistillationLossConfig, McoreActorConfig

    loss = DistillationLossConfig(
        loss_mode="forward_kl_topk",
        topk=k,
        use_policy_gradient=False,
        use_task_rewards=not distillation_only,
        log_prob_min_clamp=log_prob_min_clamp,
        use_chunked_topk=use_chunked_topk,
    )
    actor = McoreActorConfig(strategy=strategy, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    return actor, DistillationConfig(enabled=False, distillation_loss=loss)


def random_teacher(
    lengths: Sequence[int], vocab: int, k: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A teacher's top-k per token: ``k`` distinct ids and their log-probs (descending) from a
    random softmax over the vocab, ``[len, k]`` per sequence."""
    gen = torch.Generator().manual_seed(seed)
    ids, logps = [], []
    for n in lengths:
        log_p = torch.log_softmax(2.0 * torch.randn(n, vocab, generator=gen, dtype=torch.float64), dim=-1)
        top = log_p.topk(k, dim=-1)
        ids.append(top.indices)
        logps.append(top.values.float())
    return ids, logps


def make_distill_batch(
    sequences: Sequence[Sequence[int]],
    temperature: float | Sequence[float],
    teacher: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
    *,
    prompt_lengths: Sequence[int],
    response_masks: Sequence[Sequence[int]] | None = None,
    calculate_entropy: bool = True,
    calculate_sum_pi_squared: bool = False,
    distillation_only: bool = False,
    device: torch.device | str = "cpu",
) -> Any:
    """verl's micro-batch (:func:`mcore_ppo_testing.verl_engine.make_batch`) with the teacher's
    ``teacher_ids`` / ``teacher_logprobs`` (nested ``[b, j, k]``; None: no distillation), the
    flags verl's trainer sets, and what verl's final loss reads: ``prompts`` / ``responses``
    (nested, split at ``prompt_lengths``), ``response_mask`` (1 by default), the global counts
    (one data-parallel rank: this micro-batch is the global batch)."""
    from tensordict import NonTensorData

    batch = verl_engine.make_batch(sequences, temperature, calculate_entropy=calculate_entropy)
    rows = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    prompts = [row[:p] for row, p in zip(rows, prompt_lengths, strict=True)]
    responses = [row[p:] for row, p in zip(rows, prompt_lengths, strict=True)]
    if response_masks is None:
        response_masks = [[1] * len(r) for r in responses]
    masks = [torch.as_tensor(m, dtype=torch.long) for m in response_masks]
    assert [m.numel() for m in masks] == [r.numel() for r in responses]
    jagged = functools.partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    batch["prompts"] = jagged(prompts)
    batch["responses"] = jagged(responses)
    batch["response_mask"] = jagged(masks)
    if teacher is not None:
        batch["teacher_ids"] = jagged(teacher[0])
        batch["teacher_logprobs"] = jagged(teacher[1])
    flags = {
        "calculate_sum_pi_squared": calculate_sum_pi_squared,
        "distillation_use_topk": teacher is not None,
        "distillation_only": distillation_only,
        "dp_size": 1,
        "batch_num_tokens": int(sum(int(m.sum()) for m in masks)),
        "global_batch_size": len(rows),
    }
    for key, value in flags.items():
        batch[key] = NonTensorData(value)
    return batch.to(device)


@dataclasses.dataclass
class DistillRun:
    """One ``forward_step`` (and backward) of verl's engine: every output by key (nested
    ``[b, j]``, detached), verl's distillation loss and metrics, every parameter's gradient."""

    outputs: dict[str, torch.Tensor]
    loss: float | None
    metrics: dict[str, Any]
    grads: dict[str, torch.Tensor]


def distill_step(
    model: torch.nn.Module,
    batch: Any,
    configs: tuple[Any, Any] | None,
    *,
    use_fused_kernels: bool,
    grad_seed: int = 0,
    backward: bool = True,
) -> DistillRun:
    """verl's ``forward_step`` on ``batch`` with its loss function (``distillation_ppo_loss``
    bound to ``configs``, as verl's worker binds it; None: verl's ``ppo_loss`` is never reached),
    then verl's ``distillation_loss`` on the outputs, plus fixed random per-token weights on
    every differentiable output (:data:`DIFFERENTIABLE`), backward (``backward``)."""
    from verl.trainer.distillation.losses import distillation_loss, distillation_ppo_loss

    from mcore_ppo_testing.gpt_reference import pop_parameter_grads

    engine = verl_engine.make_engine(model, use_fused_kernels=use_fused_kernels)
    loss_fn = None
    if configs is not None:
        loss_fn = functools.partial(distillation_ppo_loss, config=configs[0], distillation_config=configs[1])
    for param in model.parameters():
        param.grad = None
    with torch.set_grad_enabled(backward):
        output, _ = type(engine).forward_step(engine, iter([batch]), model, loss_fn, verl_engine._no_postprocess)
    loss_value, metrics = None, {}
    total = torch.zeros((), dtype=torch.float64)
    if configs is not None and "distillation_losses" in output:
        loss, metrics = distillation_loss(configs[0], configs[1], output, batch)
        loss_value = float(loss.detach())
        total = total + loss.double()
    gen = torch.Generator().manual_seed(grad_seed)
    for key in DIFFERENTIABLE:
        if key in output:
            values = output[key].values()
            weights = torch.randn(values.numel(), generator=gen, dtype=torch.float64).to(values.device)
            total = total + (values.double() * weights).sum()
    grads = {}
    if backward:
        total.backward()
        grads = pop_parameter_grads(model)
    outputs = {key: value.detach() for key, value in output.items()}
    return DistillRun(outputs, loss_value, metrics, grads)


@dataclasses.dataclass(frozen=True)
class Difference:
    """One compared quantity: its name, max abs and max relative error, and whether it passed."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


def compare_runs(mine: DistillRun, theirs: DistillRun, *, out_tol: float, grad_tol: float) -> list[Difference]:
    """Every output (same keys, nested layout, dtype; values ``|a - b| <= out_tol (1 + |b|)``),
    verl's loss and numeric metrics, and every gradient (normwise ``<= grad_tol``)."""
    from mcore_ppo_testing.reference import normwise_relative_error

    found: list[Difference] = []
    if sorted(mine.outputs) != sorted(theirs.outputs):
        found.append(Difference("keys", 0.0, 0.0, False, f"{sorted(mine.outputs)} vs verl's {sorted(theirs.outputs)}"))
    for key in sorted(set(mine.outputs) & set(theirs.outputs)):
        a, b = mine.outputs[key], theirs.outputs[key]
        same_layout = a.is_nested == b.is_nested and (not a.is_nested or torch.equal(a.offsets(), b.offsets()))
        # verl's fused path returns fp32 entropy (its kernel's contract), its logits path the logits' dtype.
        same_dtype = a.dtype == b.dtype or (key == "entropy" and a.dtype == torch.float32)
        note = "" if same_layout and same_dtype else f"layout/dtype {a.dtype} vs verl's {b.dtype}"
        a, b = (x.values() if x.is_nested else x for x in (a, b))
        if a.shape != b.shape:
            found.append(Difference(key, 0.0, 0.0, False, f"shape {list(a.shape)} vs {list(b.shape)}"))
            continue
        found.append(_values(key, a, b, out_tol, note))
    pairs = [("verl loss", (mine.loss, theirs.loss))]
    pairs += [(f"metric {name}", (mine.metrics.get(name), theirs.metrics.get(name))) for name in theirs.metrics]
    for key, value in pairs:
        a, b = (_number(v) for v in value)
        if a is None and b is None:
            continue
        if a is None or b is None:
            found.append(Difference(key, 0.0, 0.0, False, f"{a} vs verl's {b}"))
            continue
        found.append(_values(key, torch.tensor(a), torch.tensor(b), out_tol, ""))
    if mine.grads.keys() != theirs.grads.keys():
        found.append(Difference("grads", 0.0, 0.0, False, "different parameters"))
    worst = max(
        ((normwise_relative_error(g, theirs.grads[n]), n) for n, g in mine.grads.items() if n in theirs.grads),
        default=(0.0, ""),
    )
    if mine.grads:
        found.append(Difference(f"grad (worst: {worst[1]})", worst[0], worst[0], worst[0] <= grad_tol, "normwise"))
    return found


def _values(name: str, a: torch.Tensor, b: torch.Tensor, tol: float, note: str) -> Difference:
    a, b = a.double().cpu(), b.double().cpu()
    diff = (a - b).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / b.abs().clamp_min(1e-30)).max()) if diff.numel() else 0.0
    ok = not note and bool(torch.all(diff <= tol * (1 + b.abs())))
    return Difference(name, max_abs, max_rel, ok, note)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "aggregate"):  # verl's Metric
        value = value.aggregate()
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
