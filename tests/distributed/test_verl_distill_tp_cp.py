"""verl's top-k distillation and Σπ² on its fused path with the plugin under TP (SP off/on) and TP × CP.

verl's engine (``MegatronEngineWithLMHead.forward_step``, run as verl runs it by
``mcore_ppo_testing.verl_engine`` / ``verl_distill``) with verl's own configs and loss function
(``distillation_ppo_loss``, ``loss_mode="forward_kl_topk"``), on the fused path with the plugin
against its logits path on the same model (fp64) and micro-batch: every returned tensor (keys,
nested layout, dtype, values on every rank), verl's distillation loss and metrics, and every
parameter's gradient shard, with per-sample temperatures, a response mask with zeros and
``log_prob_min_clamp``. On the logits path the KL's TP sums are verl's all-reduces over the
vocab shards and ``d_hidden`` is reduced by Megatron's output layer; on the fused path the head
combines the shards' statistics and reduces ``d_hidden`` once (SP: verl's gather does it).
Under CP each rank holds its zigzag part of the tokens and verl gathers the outputs.

Layouts on the 4-rank world: TP 2 with SP off and on (the other two ranks a second
data-parallel replica) and TP 2 × CP 2 (SP off, on). A bad teacher id on one TP rank raises
on every rank (the head's shared verdict), none left waiting in a collective.
"""

from __future__ import annotations

import torch
from conftest import DEVICE, fitting, model_parallel, shared_seed

from mcore_ppo.integrations import verl as plugin
from mcore_ppo_testing import verl_distill, verl_engine
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.real_verl import require_verl

require_verl()

import pytest  # noqa: E402

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN, K = 64, 32, 4, 2, 32, 8
LENGTHS = (9, 14, 5)
PROMPTS = (3, 6, 2)
TEMPERATURES = [0.7, 1.3, 0.9]
OUT_TOL = 2e-6  # |a - b| <= OUT_TOL (1 + |b|): the head's fp32 against verl's fp64 logits (fp32 outputs)
GRAD_TOL = 1e-5  # normwise per parameter; a TP factor gives O(1)
OUTPUT_SCALE, CLAMP = 25.0, -5.0
LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True)]


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    verl_engine.import_verl_engine()
    yield
    plugin.uninstall()


def _describe(layout) -> str:
    tp, cp, sp = layout
    return f"TP{tp} CP{cp} SP={'on' if sp else 'off'}"


def _model(seed: int, sp: bool) -> torch.nn.Module:
    model = build_gpt_model(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
        max_sequence_length=MAX_LEN, sequence_parallel=sp, params_dtype=torch.float64, seed=seed % 100_000,
        transformer_layer_spec=local_gpt_spec(attention="sdpa"), device=DEVICE, position_embedding_type="rope",
    )  # fmt: skip
    with torch.no_grad():
        model.output_layer.weight.mul_(OUTPUT_SCALE)
    return model


def _batch(seed: int, *, distill: bool, **flags):
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[int(j % 3 != 1) for j in range(n - p)] for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    teacher = verl_distill.random_teacher(LENGTHS, VOCAB, K, seed + 1) if distill else None
    return verl_distill.make_distill_batch(
        sequences, TEMPERATURES, teacher, prompt_lengths=PROMPTS, response_masks=masks, device=DEVICE, **flags
    )


def _compare(check, mine, theirs, what):
    for d in verl_distill.compare_runs(mine, theirs, out_tol=OUT_TOL, grad_tol=GRAD_TOL):
        print(f"{what}: {d.name}: max abs {d.max_abs:.2e}, max rel {d.max_rel:.2e} {d.note}")
        if not d.ok:
            check.fail(f"{d.name}: max abs {d.max_abs:.2e}, max rel {d.max_rel:.2e} {d.note}")


@pytest.mark.parametrize("distillation_only", [False, True], ids=["with-log-probs", "distillation-only"])
def test_verl_topk_distillation_tp_sp_cp_equals_verls_logits_path(check, distillation_only):
    seed = shared_seed()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=distillation_only)
    for tp, cp, sp in fitting(LAYOUTS, lambda layout: layout[0] * layout[1], _describe):
        what = f"{_describe((tp, cp, sp))} distillation_only={distillation_only}"
        check.case(what)
        with model_parallel(tp, cp):
            model = _model(seed, sp)
            batch = _batch(seed, distill=True, distillation_only=distillation_only, calculate_entropy=True)
            theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
            with verl_engine.plugin_on("torch"):
                mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
        if "distillation_losses" not in theirs.outputs or ("log_probs" in theirs.outputs) == distillation_only:
            check.fail(f"verl's logits path returned {sorted(theirs.outputs)}")
        _compare(check, mine, theirs, what)
    check.done()


def test_a_bad_teacher_id_on_one_tp_rank_raises_on_every_rank(check):
    from megatron.core import parallel_state

    seed = shared_seed()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=True)
    check.case("TP2 SP=off, rank 0 of each TP group with a teacher id = V")
    with model_parallel(2, 1):
        model = _model(seed, False)
        batch = _batch(seed, distill=True, distillation_only=True)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            ids = batch["teacher_ids"].values()
            ids[3, 1] = VOCAB
        match = "teacher_ids must be in" if parallel_state.get_tensor_model_parallel_rank() == 0 else "another rank"
        with verl_engine.plugin_on("torch"):
            check.raises(ValueError, match, verl_distill.distill_step, model, batch, configs, use_fused_kernels=True)
    check.done()


@pytest.mark.parametrize("distill", [False, True], ids=["log-prob-pass", "with-topk-distillation"])
def test_verl_sum_pi_squared_tp_sp_cp_equals_verls_logits_path(check, distill):
    """``calculate_sum_pi_squared=True`` (verl's fused path refuses it) on the head: values on every
    rank, layout and dtype as verl's ``vocab_parallel_sum_pi_squared`` gives them, alone and with
    top-k distillation in the same pass; log-probs, entropy and every gradient unchanged."""
    seed = shared_seed()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=False) if distill else None
    for tp, cp, sp in fitting(LAYOUTS, lambda layout: layout[0] * layout[1], _describe):
        what = f"{_describe((tp, cp, sp))} sum_pi_squared distill={distill}"
        check.case(what)
        with model_parallel(tp, cp):
            model = _model(seed, sp)
            batch = _batch(seed, distill=distill, calculate_sum_pi_squared=True)
            theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
            with verl_engine.plugin_on("torch"):
                mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
        if "sum_pi_squared" not in theirs.outputs:
            check.fail(f"verl's logits path returned {sorted(theirs.outputs)}")
        _compare(check, mine, theirs, what)
    check.done()
