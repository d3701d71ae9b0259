"""verl's own trainer, ``python -m verl.trainer.main_ppo`` (verl 0.9.1, unmodified), with the plugin on and off.

Each run is a subprocess of ``mcore_ppo_testing.verl_cpu.run``: 2 GRPO steps of a tiny random
Qwen2 (bf16 Megatron actor, vocab 2048) with verl's hybrid engine, async agent loop, reward loop
and naive weight sync, a CPU Hugging Face rollout, its own Ray session; plugin on
(``MCORE_PPO_VERL=1`` + ``use_fused_kernels=True``) and off, at TP 1 and TP 2 + SP (2 gloo ranks),
and switched on but inert (``use_fused_kernels=False``). Two mini-batches per step and an entropy
bonus, so the updates reach the head's gradients (one mini-batch of equal-length responses gives
GRPO a pg_loss of exactly 0).

Asserted: the head ran on every rank, for the log-prob pass and for every update micro-batch
(forward and backward; the harness counts the head's own passes per process), and never with
the plugin off or inert; the first step's samples are equal on and off (same seeds, same
weights); on and off agree within bounds set with margin above what was measured (see below);
on is no further than off from the rollout's fp32 log-probs of the same tokens; inert equals off
bit for bit (which also shows the runs repeat bit for bit) and logs the plugin's WARNING.

``MCORE_PPO_VERL_E2E=full`` adds (about 6 more runs): on repeated bit for bit at TP 1 and TP 2 +
SP, and the two verl features that need logits without the plugin, on against off: Σπ²
(``calculate_sum_pi_squared``, verl's optimal-token-baseline estimator) and top-k distillation
(``forward_kl_topk``, an ``hf_cpu`` teacher). The seed is ``MCORE_PPO_TEST_SEED`` (printed).
"""

from __future__ import annotations

import os
import sys

import pytest

from mcore_ppo_testing.real_verl import require_verl
from mcore_ppo_testing.seeds import next_seed
from mcore_ppo_testing.verl_cpu.assets import make_assets
from mcore_ppo_testing.verl_cpu.compare import equal_runs, log_prob_gap, relative_gap
from mcore_ppo_testing.verl_cpu.run import RunConfig, RunResult, run_main_ppo

require_verl()
pytest.importorskip("ray", reason="verl's trainer needs Ray: bash scripts/install.sh installs it")

FULL = os.environ.get("MCORE_PPO_VERL_E2E", "").strip() == "full"
needs_full = pytest.mark.skipif(not FULL, reason="MCORE_PPO_VERL_E2E=full runs it (README, 'verl, end to end')")

# Bounds, each with margin over what the record measured (docs/benchmarks/verl_main_ppo_cpu/).
# Step 1: both runs hold the same weights, so on and off differ only by the head's numerics
# (fp32 logits against verl's bf16 logits).
# Measured at TP 1 / TP 2 + SP: grad_norm 1.5e-3 / 4.3e-4 relative, entropy 5.8e-6 / 3.5e-6,
# old log-probs max |Δ| 7.6e-3 / 7.7e-3, mean 1.7e-3 / 1.7e-3; mean |Δ| from the fp32 rollout
# 1.4 % / 1.7 % below off's (a near tie: the bf16 trunk's error, ~1e-2 a token, dominates).
STEP1 = {"grad_norm_rel": 5e-3, "entropy_rel": 2e-5, "log_prob_max": 2e-2, "log_prob_mean": 4e-3, "fp32": 1.05}
# Step 2: after one Adam update from gradients that differ by rounding (Adam's first step moves
# every weight by about lr, whatever the gradient's size, so small components whose sign differs
# move apart by 2 lr), the two actors differ by more than rounding.
# Measured: grad_norm 1.1e-4 / 3.7e-4, entropy 3.6e-5 / 2.2e-6, log-probs max 3.0e-2 / 4.1e-2,
# mean 8.4e-3 / 9.5e-3; from fp32 1.1 % / 2.8 % above off's (each run against its own weights).
STEP2 = {"grad_norm_rel": 2e-2, "entropy_rel": 2e-4, "log_prob_max": 1e-1, "log_prob_mean": 2.5e-2, "fp32": 1.10}
# Σπ² (about 1.4e-3 here: a 2048-way softmax near uniform), head against verl's bf16 logits:
# measured max |Δ| 2.4e-5 (step 1) and 3.9e-5 (step 2).
SUM_PI_MAX_ABS = 2e-4
# verl's distillation metrics (loss, student and teacher top-k mass), relative, steps 1 and 2:
# measured at most 3.5e-4 and 8.9e-4 (student_mass), teacher_mass equal.
DISTILL_REL = (2e-3, 1e-2)

CI_CONFIGS = (
    RunConfig(tp=1, plugin="on"),
    RunConfig(tp=1, plugin="off"),
    RunConfig(tp=1, plugin="inert"),
    RunConfig(tp=2, plugin="on"),
    RunConfig(tp=2, plugin="off"),
)
FULL_CONFIGS = (
    RunConfig(tp=1, plugin="on", tag="-repeat"),
    RunConfig(tp=2, plugin="on", tag="-repeat"),
    RunConfig(tp=1, variant="sum_pi", plugin="on"),
    RunConfig(tp=1, variant="sum_pi", plugin="off"),
    RunConfig(tp=1, variant="distill", plugin="on"),
    RunConfig(tp=1, variant="distill", plugin="off"),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """Every configuration run once (one after another), by label."""
    seed = next_seed()
    workdir = tmp_path_factory.mktemp("verl_main_ppo")
    assets = make_assets(workdir / "assets", seed=seed)
    results = {}
    for config in CI_CONFIGS + (FULL_CONFIGS if FULL else ()):
        config = RunConfig(**{**config.__dict__, "seed": seed})
        result = run_main_ppo(config, workdir, assets)
        print(f"{config.label}: exit {result.returncode} in {result.wall_s:.0f} s")
        results[config.label] = result
    return results


def _ok(result: RunResult) -> RunResult:
    assert result.returncode == 0, f"{result.config.label} exited {result.returncode}:\n{result.tail()}"
    assert sorted(result.metrics) == [1, 2], f"{result.config.label}: steps {sorted(result.metrics)}\n{result.tail()}"
    return result


@pytest.mark.parametrize("tp", [1, 2])
def test_the_head_ran_on_every_rank_for_log_probs_and_updates(runs, tp):
    on = _ok(runs[f"tp{tp}{'+sp' if tp > 1 else ''}-on"])
    calls = on.head_calls
    assert sorted(c["rank"] for c in calls) == list(range(tp)), calls
    # 2 steps x 16 responses: 4 log-prob micro-batches a step, 2 mini-batches of 8 = 2 micro-batches.
    for c in calls:
        assert c["forward_no_grad"] == 8, c
        assert c["forward_grad"] == c["backward"] == 8, c
    assert "mcore_ppo verl plugin: on:" in on.log
    for label in ("off",) if tp > 1 else ("off", "inert"):
        other = _ok(runs[on.config.label.replace("-on", f"-{label}")])
        assert other.head_calls == [], f"the head ran with the plugin {label}: {other.head_calls}"


@pytest.mark.parametrize("tp", [1, 2])
def test_on_and_off_agree(runs, tp):
    prefix = f"tp{tp}{'+sp' if tp > 1 else ''}"
    on, off = _ok(runs[f"{prefix}-on"]), _ok(runs[f"{prefix}-off"])
    assert log_prob_gap(on.log_probs[1], off.log_probs[1]).rows_equal == 1.0, "step 1 samples differ"
    for step, bound in ((1, STEP1), (2, STEP2)):
        m_on, m_off = on.metrics[step], off.metrics[step]
        grad = relative_gap(m_on["actor/grad_norm"], m_off["actor/grad_norm"])
        entropy = relative_gap(m_on["actor/entropy"], m_off["actor/entropy"])
        gap = log_prob_gap(on.log_probs[step], off.log_probs[step])
        print(f"{prefix} step {step}: grad_norm rel {grad:.2e}, entropy rel {entropy:.2e}, {gap}")
        assert grad <= bound["grad_norm_rel"]
        assert entropy <= bound["entropy_rel"]
        assert gap.rows_equal >= 0.75
        assert gap.max_abs <= bound["log_prob_max"]
        assert gap.mean_abs <= bound["log_prob_mean"]
        # The head (fp32 logits) is no further than verl's bf16-logits path from fp32 (with margin).
        assert gap.a_vs_fp32_mean <= bound["fp32"] * gap.b_vs_fp32_mean


def test_inert_equals_off_bit_for_bit_and_warns(runs):
    inert, off = _ok(runs["tp1-inert"]), _ok(runs["tp1-off"])
    assert equal_runs(inert, off) == []
    assert "mcore_ppo verl plugin is switched on but does nothing" in inert.log
    assert "actor_rollout_ref.model.use_fused_kernels=True" in inert.log
    assert "switched on but does nothing" not in off.log


@needs_full
@pytest.mark.parametrize("label", ["tp1-on", "tp2+sp-on"])
def test_on_repeats_bit_for_bit(runs, label):
    assert equal_runs(_ok(runs[label]), _ok(runs[f"{label}-repeat"])) == []


@needs_full
def test_sum_pi_squared_on_and_off(runs):
    on, off = _ok(runs["tp1-sum_pi-on"]), _ok(runs["tp1-sum_pi-off"])
    assert "sum_pi_squared is computed by the head" in on.log
    assert all(c["forward_no_grad"] == 8 for c in on.head_calls) and on.head_calls
    for step in (1, 2):
        gap = log_prob_gap(on.log_probs[step], off.log_probs[step], key="sum_pi_squared")
        assert gap.rows_equal >= 0.75 and gap.max_abs <= SUM_PI_MAX_ABS, gap
        bound = STEP1 if step == 1 else STEP2
        grad = relative_gap(on.metrics[step]["actor/grad_norm"], off.metrics[step]["actor/grad_norm"])
        assert grad <= bound["grad_norm_rel"]


@needs_full
def test_topk_distillation_on_and_off(runs):
    on, off = _ok(runs["tp1-distill-on"]), _ok(runs["tp1-distill-off"])
    assert "top-k distillation (distillation_use_topk) on verl's fused path" in on.log
    assert on.head_calls and all(c["forward_grad"] == c["backward"] == 8 for c in on.head_calls), on.head_calls
    for step, bound in ((1, STEP1), (2, STEP2)):
        m_on, m_off = on.metrics[step], off.metrics[step]
        for key in ("actor/distillation/loss", "actor/distillation/student_mass", "actor/distillation/teacher_mass"):
            print(f"step {step} {key}: on {m_on[key]}, off {m_off[key]}")
            assert relative_gap(m_on[key], m_off[key]) <= DISTILL_REL[step - 1], key
        assert relative_gap(m_on["actor/grad_norm"], m_off["actor/grad_norm"]) <= bound["grad_norm_rel"]


def test_importing_the_runner_changes_nothing_here():
    """Only verl's processes load ``verl_cpu.external`` (its effects are process-wide); this module
    imports the runner, the assets and the comparisons, which must leave torch as it is."""
    import torch.distributed as dist

    assert dist.init_process_group.__module__ == "torch.distributed.distributed_c10d"
    assert "mcore_ppo_testing.verl_cpu.external" not in sys.modules


def test_runs_leave_no_process(runs):
    assert {label: r.leftover for label, r in runs.items() if r.leftover} == {}
