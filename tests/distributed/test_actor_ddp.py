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

On CUDA (NCCL) a third test runs Megatron's distributed optimizer (Adam, state sharded over the
data-parallel ranks, gradients reduce-scattered, parameters all-gathered) with Megatron's own
gradient clipping, against the bare model stepped by ``torch.optim.AdamW`` with the actor's
clipping. On CPU that test is skipped: the distributed optimizer requires CUDA tensor types and
Megatron's clipping asserts CUDA gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ACTOR_GPT as MODEL
from conftest import DEVICE, shared_seed

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


# Adam of the distributed-optimizer test (Megatron's and torch's with the same hyperparameters).
ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
CLIP = 0.05


def _run(ddp: bool, *, seed, rollout, old_log_probs, head_fusion: bool = False, distributed_optimizer: bool = False):
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
            max_grad_norm=CLIP if distributed_optimizer else None,
            temperature=TEMPERATURE,
            micro_batch_size=3,
        )
        if ddp:
            # The head alone may write its weight gradient straight into DDP's main_grad (as
            # Megatron's layers do with gradient-accumulation fusion, which elsewhere needs Apex).
            model.output_layer.gradient_accumulation_fusion = head_fusion
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
            )
            wrapped = DistributedDataParallel(model.config, ddp_config, model)
            if distributed_optimizer:
                opt_config = OptimizerConfig(
                    optimizer="adam",
                    lr=ADAM["lr"],
                    adam_beta1=ADAM["betas"][0],
                    adam_beta2=ADAM["betas"][1],
                    adam_eps=ADAM["eps"],
                    weight_decay=0.0,
                    clip_grad=CLIP,
                    use_distributed_optimizer=True,
                )
            else:
                opt_config = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0)
            optimizer = get_megatron_optimizer(
                opt_config,
                [wrapped],
                use_gloo_process_groups=False,  # the tests' cached layouts create no extra gloo groups
            )
            actor = MegatronPPOActor(wrapped, optimizer, config, parallel=parallel)
            assert actor.uses_ddp and actor.megatron_optimizer
        else:
            plain = (
                torch.optim.AdamW(model.parameters(), weight_decay=0.0, **ADAM)
                if distributed_optimizer
                else torch.optim.SGD(model.parameters(), lr=1.0)
            )
            actor = MegatronPPOActor(model, plain, config, parallel=parallel)
        log_probs, entropy = actor.compute_log_prob(rollout, calculate_entropy=True)
        metrics = actor.update_policy(dataclasses.replace(rollout, old_log_probs=old_log_probs(log_probs)))
        after = full_parameters(model, parallel.tp)
        return log_probs, entropy, metrics, {k: after[k] - before[k] for k in after}
    finally:
        destroy_layout()


def _compare(check, plain, wrapped, mask, *, metrics: tuple[str, ...]) -> None:
    check.close("log_prob", wrapped[0][mask], plain[0][mask], tol=TOL, kind="ddp vs plain")
    check.close("entropy", wrapped[1][mask], plain[1][mask], tol=TOL, kind="ddp vs plain")
    for key in metrics:
        actual, expected = torch.tensor(wrapped[2][key]), torch.tensor(plain[2][key])
        check.close(f"metric {key}", actual, expected, tol=TOL, kind="ddp vs plain")
    if set(wrapped[3]) != set(plain[3]):
        check.fail(f"parameters differ: {sorted(set(wrapped[3]) ^ set(plain[3]))}")
    moved = 0
    for name, delta in plain[3].items():
        check.close(f"Δ{name}", wrapped[3][name], delta, tol=TOL, kind="ddp vs plain")
        moved += int(delta.abs().max() > 0)
    if moved != len(plain[3]):
        check.fail(f"only {moved} of {len(plain[3])} parameters moved in one step")


def _rollout_and_old_log_probs(seed: int):
    rollout = synthetic_rollout(
        num_seqs=9, vocab_size=MODEL["vocab_size"], prompt_len=(3, 9), response_len=(4, 14), seed=seed, device=DEVICE
    )
    # Old log-probs a little off the current ones, so that ratios and clipping are exercised.
    gen = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(rollout.tokens.shape, generator=gen, dtype=torch.float64)

    def old_log_probs(log_probs):
        return (log_probs.double() + 0.3 * noise.to(log_probs.device)).to(log_probs.dtype)

    return rollout, old_log_probs


@pytest.mark.parametrize("head_fusion", [False, True], ids=["head-grad-via-hook", "head-grad-into-main_grad"])
def test_megatron_ddp_and_optimizer_match_plain_update(check, head_fusion):
    seed = shared_seed()
    rollout, old_log_probs = _rollout_and_old_log_probs(seed)
    plain = _run(False, seed=seed, rollout=rollout, old_log_probs=old_log_probs)
    wrapped = _run(True, seed=seed, rollout=rollout, old_log_probs=old_log_probs, head_fusion=head_fusion)
    metrics = ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "num_tokens")
    _compare(check, plain, wrapped, rollout.response_mask, metrics=metrics)
    check.done()


def test_megatron_distributed_optimizer_matches_plain_adam(check):
    if DEVICE.type != "cuda":
        pytest.skip("Megatron's distributed optimizer needs CUDA tensors (and its clipping CUDA gradients)")
    seed = shared_seed()
    rollout, old_log_probs = _rollout_and_old_log_probs(seed)
    plain = _run(False, seed=seed, rollout=rollout, old_log_probs=old_log_probs, distributed_optimizer=True)
    wrapped = _run(True, seed=seed, rollout=rollout, old_log_probs=old_log_probs, distributed_optimizer=True)
    if not plain[2]["grad_norm"] > CLIP:
        check.fail(f"gradient clipping not active: grad_norm {plain[2]['grad_norm']} <= {CLIP}")
    metrics = ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm", "num_tokens")
    _compare(check, plain, wrapped, rollout.response_mask, metrics=metrics)
    check.done()
