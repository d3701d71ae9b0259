"""The actor under Megatron's DDP and optimizer gives the plain-PyTorch update (4 gloo ranks).

TP 2 with SP × 2 data-parallel replicas. One run wraps the model in Megatron-Core's
``DistributedDataParallel`` (contiguous fp32 grad buffers, ``main_grad``, the DP all-reduce) and
steps a Megatron optimizer (``get_megatron_optimizer``); the other runs the same actor on the
bare model with ``torch.optim.SGD``. Same global weights, same rollout: the log-probs, every
metric, the gradient norm and every parameter after one update must agree. SGD with lr 1 makes
``Δparameter = -gradient``, so the parameter check is a gradient check of the whole path:
the head's weight gradient into ``main_grad``, the DDP reduction over the replicas (which hold
the same data), and the optimizer's use of the reduced gradient.

Both ways the head's weight gradient reaches DDP are checked: through ``.grad`` and DDP's hook,
and written by the head into ``main_grad`` (``gradient_accumulation_fusion`` on the head, with
Megatron's ``grad_added_to_main_grad`` convention).

Not covered on CPU: Megatron's distributed optimizer (it requires CUDA tensor types and Adam)
and its gradient clipping (it asserts CUDA gradients): the optimizer here is Megatron's
non-distributed one with ``clip_grad = 0``, and the plain run does not clip either.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ACTOR_GPT as MODEL
from conftest import shared_seed

from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
from mcore_ppo_testing.ppo_harness import (
    build_actor_model,
    destroy_layout,
    full_parameters,
    init_layout,
    layout_independent_init,
    synthetic_rollout,
)

TEMPERATURE = 0.8
# fp32 model: DDP reduces in fp32 buffers (averaging two equal replicas is exact), the plain
# run reduces nothing; what differs is the order of a few fp32 additions.
TOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """CPU shims for GPTModel and Megatron's optimizer (never on a CUDA machine)."""
    yield


def _run(ddp: bool, *, seed, rollout, old_log_probs, head_fusion: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel = init_layout(2, 1, 1, cp_at_head=True)
    try:
        model = build_actor_model(
            MODEL, sequence_parallel=True, temperature=TEMPERATURE, backend="torch", params_dtype=torch.float32
        )
        layout_independent_init(model, seed)
        before = full_parameters(model, parallel.tp)
        config = PPOActorConfig(
            clip_ratio_c=3.0,
            entropy_coeff=0.01,
            max_grad_norm=None,
            temperature=TEMPERATURE,
            micro_batch_size=3,
        )
        if ddp:
            # The head alone may write its weight gradient straight into DDP's main_grad (as
            # Megatron's layers do with gradient-accumulation fusion, which elsewhere needs Apex).
            model.output_layer.gradient_accumulation_fusion = head_fusion
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
            wrapped = DistributedDataParallel(model.config, ddp_config, model)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0),
                [wrapped],
                use_gloo_process_groups=False,  # the tests' cached layouts create no extra gloo groups
            )
            actor = MegatronPPOActor(wrapped, optimizer, config, parallel=parallel)
            assert actor.uses_ddp and actor.megatron_optimizer
        else:
            actor = MegatronPPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), config, parallel=parallel)
        log_probs, entropy = actor.compute_log_prob(rollout, calculate_entropy=True)
        metrics = actor.update_policy(rollout.with_fields(old_log_probs=old_log_probs(log_probs)))
        after = full_parameters(model, parallel.tp)
        return log_probs, entropy, metrics, {k: after[k] - before[k] for k in after}
    finally:
        destroy_layout()


@pytest.mark.parametrize("head_fusion", [False, True], ids=["head-grad-via-hook", "head-grad-into-main_grad"])
def test_megatron_ddp_and_optimizer_match_plain_update(check, head_fusion):
    seed = shared_seed()
    rollout = synthetic_rollout(
        num_seqs=9, vocab_size=MODEL["vocab_size"], prompt_len=(3, 9), response_len=(4, 14), seed=seed
    )
    # Old log-probs a little off the current ones, so that ratios and clipping are exercised.
    gen = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(rollout.tokens.shape, generator=gen, dtype=torch.float64)

    def old_log_probs(log_probs):
        return (log_probs.double() + 0.3 * noise.to(log_probs.device)).to(log_probs.dtype)

    plain = _run(False, seed=seed, rollout=rollout, old_log_probs=old_log_probs)
    wrapped = _run(True, seed=seed, rollout=rollout, old_log_probs=old_log_probs, head_fusion=head_fusion)

    mask = rollout.response_mask
    check.close("log_prob", wrapped[0][mask], plain[0][mask], tol=TOL, kind="ddp vs plain")
    check.close("entropy", wrapped[1][mask], plain[1][mask], tol=TOL, kind="ddp vs plain")
    for key in ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "num_tokens"):
        actual, expected = torch.tensor(wrapped[2][key]), torch.tensor(plain[2][key])
        check.close(f"metric {key}", actual, expected, tol=TOL, kind="ddp vs plain")
    assert set(wrapped[3]) == set(plain[3])
    moved = 0
    for name, delta in plain[3].items():
        check.close(f"Δ{name}", wrapped[3][name], delta, tol=TOL, kind="ddp vs plain")
        moved += int(delta.abs().max() > 0)
    assert moved == len(plain[3]), "every parameter should move in one SGD step"
    check.done()
