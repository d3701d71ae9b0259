"""The PPO actor under TP × CP × PP gives the single-rank numbers (fp64 model, 4 gloo ranks in
CI: TP 1 × CP 2 × PP 2; 8 add TP 2 + SP × CP 2 × PP 2).

Megatron's pipeline schedule sizes the activations that stages exchange from ``seq_length``
divided by its CP group's size (and by TP under SP), so CP and PP meet in the actor only there
and in the reductions that every stage takes part in. Each layout, from the same global weights
and the same rollout, against TP 1 × CP 1 × PP 1:

- ``compute_log_prob``: log-probs and entropy, and both against the unfused logits path (full
  logits gathered over TP, fp64 ``log_softmax``, run through the same schedule);
- one ``update_policy`` step: every metric, the gradient norm, and every parameter's change
  (SGD with lr 1: the clipped gradient);
- ``compute_teacher_topk``: the same ids, log-probs and tail masses.

CP runs inside the model (the harness's ``SdpaAttention``) and at the head; the micro-batching
differs between layouts (sequence count vs token budget, several micro-batches of different
lengths padded to one pipeline shape). The rollout's responses cross the CP chunk boundaries:
labels at a chunk's last position predict the first token of the next chunk, which another CP
rank holds; the test checks that its micro-batches have such labels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import ACTOR_GPT as MODEL
from conftest import DEVICE, fitting, shared_seed
from megatron.core import parallel_state
from test_actor_parity import TEMPERATURE, _layout_model

from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
from mcore_ppo.actor.batching import PackedRollout
from mcore_ppo_testing.ppo_harness import (
    full_parameters,
    logits_path_outputs,
)

TOL = 1e-10  # fp64 model and head: rounding of fp64 arithmetic only
TOPK = 8

# (tp, cp, pp, sp, micro-batching); the first is the reference.
LAYOUTS = [
    (1, 1, 1, False, {"micro_batch_size": 2}),
    (1, 2, 2, False, {"micro_batch_size": 2, "cp_in_model": True}),
    (1, 2, 2, False, {"max_tokens_per_micro_batch": 40, "cp_in_model": True}),
    (1, 2, 2, False, {"micro_batch_size": 3}),  # CP at the head
    (2, 2, 2, True, {"micro_batch_size": 2, "cp_in_model": True}),
    (2, 2, 2, True, {"max_tokens_per_micro_batch": 48}),  # CP at the head
]

# (prompt, response) lengths: every response is long enough to span several CP chunks.
SEQUENCES = [(3, 13), (2, 7), (5, 19), (4, 9), (6, 3), (2, 14), (7, 11)]


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """CPU shims for GPTModel (never on a CUDA machine, where Megatron runs unmodified)."""
    yield


def _rollout(seed: int) -> PackedRollout:
    """Random tokens of :data:`SEQUENCES`, one standardised advantage per sequence on its response."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [p + r for p, r in SEQUENCES]
    total = sum(lengths)
    mask = torch.zeros(total, dtype=torch.bool)
    scores = torch.randn(len(SEQUENCES), generator=gen, dtype=torch.float64)
    scores = (scores - scores.mean()) / scores.std()
    advantages = torch.zeros(total, dtype=torch.float64)
    start = 0
    for (p, r), score in zip(SEQUENCES, scores.tolist(), strict=True):
        mask[start + p : start + p + r] = True
        advantages[start + p : start + p + r] = score
        start += p + r
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return PackedRollout(
        tokens=torch.randint(0, MODEL["vocab_size"], (total,), generator=gen).to(DEVICE),
        cu_seqlens=cu.to(DEVICE),
        response_mask=mask.to(DEVICE),
        advantages=advantages.to(DEVICE),
    )


def _labels_across_chunks(actor: MegatronPPOActor, rollout: PackedRollout) -> int:
    """Response tokens whose label sits at the end of a CP chunk (the token itself starts the next
    chunk, on another CP rank), over this layout's micro-batches."""
    cp = actor.parallel.cp_size
    bounds, mask = rollout.bounds, rollout.response_mask.cpu()
    count = 0
    for mb in actor.micro_batches(rollout):
        for k, s in enumerate(mb.seq_ids):
            chunk = (mb.cu_seqlens_padded[k + 1] - mb.cu_seqlens_padded[k]) // (2 * cp)
            length = bounds[s + 1] - bounds[s]
            count += sum(bool(mask[bounds[s] + j * chunk]) for j in range(1, 2 * cp) if j * chunk < length)
    return count


def test_actor_tp_cp_pp_matches_single_rank(check, fresh_parallel_state):
    seed = shared_seed()
    rollout = _rollout(seed)
    mask = rollout.response_mask
    noise = torch.randn(rollout.tokens.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    noise = noise.to(DEVICE)
    # One response token with a negative advantage gets ratio e^0.8 > clip_ratio_c: the dual clip fires.
    negative = torch.nonzero(mask & (rollout.advantages < 0)).flatten()
    assert negative.numel() > 0, "standardised advantages have negative entries"
    noise[negative[0]] = -2.0

    layouts = fitting(
        LAYOUTS,
        lambda layout: layout[0] * layout[1] * layout[2],
        lambda layout: f"tp{layout[0]} cp{layout[1]} pp{layout[2]}",
    )
    ref = None
    for tp, cp, pp, sp, batching in layouts:
        name = f"tp{tp} cp{cp} pp{pp} sp{int(sp)} {batching}"
        check.case(name)
        with _layout_model(tp, cp, pp, sp, batching, seed=seed) as (parallel, model, batching):
            before = full_parameters(model, parallel.tp)
            config = PPOActorConfig(
                clip_ratio_low=0.2,
                clip_ratio_high=0.28,
                clip_ratio_c=1.5,
                entropy_coeff=0.01,
                loss_agg_mode="seq-mean-token-mean",
                max_grad_norm=0.05,
                temperature=TEMPERATURE,
                distill_topk=TOPK,
                **batching,
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            if cp > 1:
                wrong = dataclasses.replace(parallel, schedule_cp_size=3)
                check.raises(
                    ValueError, "schedule_cp_size = 3", MegatronPPOActor, model, optimizer, config, parallel=wrong
                )
            actor = MegatronPPOActor(model, optimizer, config, parallel=parallel)
            if cp > 1 and _labels_across_chunks(actor, rollout) == 0:
                check.fail("no response label crosses a CP chunk boundary: the case does not test it")
            if pp > 1 and len(actor.micro_batches(rollout)) < pp:
                check.fail("fewer micro-batches than pipeline stages: the 1F1B steady state is not reached")
            log_probs, entropy = actor.compute_log_prob(rollout, calculate_entropy=True)
            unfused = logits_path_outputs(model, rollout, parallel, temperature=TEMPERATURE, align=actor.align)
            topk = actor.compute_teacher_topk(model, rollout)
            old = torch.where(mask, log_probs.double() + 0.4 * noise, 0.0)
            metrics = actor.update_policy(dataclasses.replace(rollout, old_log_probs=old))
            after = full_parameters(model, parallel.tp)
        deltas = {k: after[k] - before[k] for k in after}
        if unfused is not None:  # the last pipeline stage
            check.close("log_prob", log_probs[mask], unfused[0][mask], tol=TOL, kind=f"actor vs logits path [{name}]")
            check.close("entropy", entropy[mask], unfused[1][mask], tol=TOL, kind=f"actor vs logits path [{name}]")
        # Data-parallel replicas hold the same rollout: the global batch is `dp` copies of it.
        dp = dist.get_world_size() // (tp * cp * pp)
        expected = (float(mask.sum()) * dp, float(rollout.num_seqs) * dp)
        if (metrics["num_tokens"], metrics["num_seqs"]) != expected:
            check.fail(f"global counts {metrics['num_tokens']}, {metrics['num_seqs']} != {expected}")
        if ref is None:
            ref = (log_probs, entropy, metrics, deltas, topk)
            if not (0.0 < metrics["pg_clipfrac"] < 1.0 and metrics["pg_clipfrac_lower"] > 0.0):
                check.fail(f"clip/dual-clip not both active: {metrics}")
            if not metrics["grad_norm"] > 0.05:
                check.fail(f"gradient clipping not active: grad_norm {metrics['grad_norm']}")
            continue
        kind = f"TP×CP×PP vs single rank [{name}]"
        check.close("log_prob", log_probs, ref[0], tol=TOL, kind=kind)
        check.close("entropy", entropy, ref[1], tol=TOL, kind=kind)
        for key in ("loss", "pg_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_k3", "grad_norm"):
            check.close(key, torch.tensor(metrics[key]), torch.tensor(ref[2][key]), tol=TOL, kind=kind)
        if not deltas:
            check.fail("no parameters compared")
        for key, delta in deltas.items():
            check.close(f"Δ{key}", delta, ref[3][key], tol=TOL, kind=kind)
        if not torch.equal(topk.ids, ref[4].ids):
            check.fail("teacher top-k ids differ from the single-rank ones")
        check.close("topk log_probs", topk.log_probs, ref[4].log_probs, tol=TOL, kind=kind)
        check.close("topk tail_log_mass", topk.tail_log_mass, ref[4].tail_log_mass, tol=TOL, kind=kind)
    assert not parallel_state.model_parallel_is_initialized()
    dist.barrier()
    check.done()
