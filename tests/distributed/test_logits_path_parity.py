"""The benchmark's logits path equals the fused head through the PPO actor (4 gloo ranks, fp32).

``scripts/bench_ppo.py`` times the actor with the fused head against
:class:`mcore_ppo_testing.logits_path.LogitsPath` (Megatron's output layer, then Megatron-Core's
``vocab_parallel_cross_entropy`` and verl's vocab-parallel entropy). For the comparison to be
of the same work, both must give the same numbers: from the same global weights and rollout,
under TP 2 + SP × CP 2 at the head, ``compute_log_prob``
(log-probs and entropy), one ``update_policy`` step's metrics, and every parameter after it
(SGD with lr 1, so the parameter change is the clipped gradient; the entropy bonus is on, so
the entropy's backward is compared too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, require_ranks, shared_seed

from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
from mcore_ppo_testing.logits_path import LogitsPath
from mcore_ppo_testing.ppo_harness import (
    build_actor_model,
    destroy_layout,
    full_parameters,
    init_layout,
    layout_independent_init,
    synthetic_rollout,
)

MODEL = {
    "num_layers": 1,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 64,
    "vocab_size": 256,
    "max_sequence_length": 48,
}
TEMPERATURE = 0.7
# fp32 model: Megatron's CE and the fused head sum in different orders.
TOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """CPU shims for GPTModel (never on a CUDA machine, where Megatron runs unmodified)."""
    yield


def _run(tp, cp, sp, forward_fn, *, seed, rollout, noise):
    parallel = init_layout(tp, cp, 1, cp_at_head=True)
    try:
        model = build_actor_model(
            MODEL, sequence_parallel=sp, temperature=TEMPERATURE, backend="torch", params_dtype=torch.float32
        )
        layout_independent_init(model, seed)
        before = full_parameters(model, parallel.tp)
        config = PPOActorConfig(
            clip_ratio=0.2,
            clip_ratio_c=1.5,
            entropy_coeff=0.05,
            max_grad_norm=None,
            temperature=TEMPERATURE,
            micro_batch_size=3,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        actor = MegatronPPOActor(model, optimizer, config, parallel=parallel, forward_fn=forward_fn)
        log_probs, entropy = actor.compute_log_prob(rollout, calculate_entropy=True)
        # The sampling policy is ~0.3 nats per token away, so the clip acts.
        old = torch.where(rollout.response_mask, log_probs + 0.3 * noise, 0.0)
        metrics = actor.update_policy(dataclasses.replace(rollout, old_log_probs=old))
        after = full_parameters(model, parallel.tp)
        return log_probs, entropy, metrics, {k: after[k] - before[k] for k in after}
    finally:
        destroy_layout()


def test_logits_path_matches_fused_head(check, fresh_parallel_state):
    tp, cp, sp = 2, 2, True
    require_ranks(tp * cp, f"TP{tp} × CP{cp}")
    seed = shared_seed()
    rollout = synthetic_rollout(
        num_seqs=6, vocab_size=MODEL["vocab_size"], prompt_len=(2, 8), response_len=(4, 14), seed=seed, device=DEVICE
    )
    noise = torch.randn(rollout.tokens.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    mask = rollout.response_mask
    fused = _run(tp, cp, sp, None, seed=seed, rollout=rollout, noise=noise)
    logits = _run(tp, cp, sp, LogitsPath(), seed=seed, rollout=rollout, noise=noise)
    kind = f"logits path vs fused head [tp{tp} cp{cp} sp{int(sp)}]"
    check.case(kind)
    check.close("log_prob", logits[0][mask], fused[0][mask], tol=TOL, kind=kind)
    check.close("entropy", logits[1][mask], fused[1][mask], tol=TOL, kind=kind)
    for key in ("loss", "pg_loss", "entropy", "pg_clipfrac", "kl_k3", "grad_norm"):
        expected = torch.tensor(fused[2][key], dtype=torch.float64)
        check.close(key, torch.tensor(logits[2][key], dtype=torch.float64), expected, tol=TOL, kind=kind)
    if not 0.0 < fused[2]["pg_clipfrac"] < 1.0:
        check.fail(f"the clip is not active: {fused[2]}")
    for key, delta in fused[3].items():
        check.close(f"Δ{key}", logits[3][key], delta, tol=10 * TOL, kind=kind)
    if not fused[3]:
        check.fail("no parameters compared")
    check.done()
