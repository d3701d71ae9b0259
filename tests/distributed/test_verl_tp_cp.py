"""verl's live Megatron path under TP (SP on and off) and CP, with the plugin: ``d_hidden`` complete.

verl's engine (``MegatronEngineWithLMHead.forward_step``, run here as verl runs it by
``mcore_ppo_testing.verl_engine``) with ``use_fused_kernels`` packs the batch (THD), rolls and
CP-splits the labels itself, and calls ``linear_cross_entropy(hidden, weight_shard, labels, T,
"none", tp_group)``; with SP it first gathers the hidden states with Megatron's
``gather_from_sequence_parallel_region`` (whose backward reduce-scatters, i.e. sums ``d_hidden``
over TP), without SP nothing in verl sums the vocab shards' partial ``d_hidden``. The plugin reads
``config.sequence_parallel`` at verl's call site and reduces only in the second case. A doubled
reduction (SP on) or a dropped one (SP off) changes every gradient below the head by a factor,
so each layout's fused run is compared with verl's non-fused path (full vocab-parallel logits,
Megatron's own output layer and its reductions) on the same model and batch: log-probs,
entropy and every parameter's gradient, with per-sample temperatures (spread over the tokens
and CP-split by the plugin as verl's non-fused path does).

Layouts on the 4-rank world: TP 2 (SP off, on; the other two ranks a second data-parallel
replica) and TP 2 x CP 2 (SP off, on).

With ``MCORE_PPO_VERL_MTP=1`` and an MTP model (depth 2, ``mtp.enable_train``, a loss mask with
zeros), TP 2 with SP off and on and TP 2 x CP 2 (the per-depth rolls cross CP ranks): the fused
path kept on with MTP against verl's logits path with MTP (outputs, the MTP losses verl logs,
every gradient).

Σπ² and top-k distillation (verl's ``calculate_sum_pi_squared``, ``distillation_use_topk``,
``distillation_only``; ``loss_mode="forward_kl_topk"`` with verl's own configs and loss function,
``mcore_ppo_testing.verl_distill``), in every layout above: the fused path with the plugin
against verl's logits path, every returned tensor (keys, nested layout, dtype, values on every
rank), verl's distillation loss and metrics and every gradient shard, with a response mask with
zeros and ``log_prob_min_clamp``; a bad teacher id on one TP rank raising on every rank.

Last, verl's kernel contract under TP (``mcore_ppo.integrations.verl.kernel``): with a TP group
``linear_cross_entropy`` returns the full-vocab values on every rank and a *partial* ``d_hidden``
(this rank's vocab shard's contribution) that the caller reduces over TP, as verl's Megatron path
does with the SP gather's reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, fitting, model_parallel, shared_seed, tp_cp_groups
from head_cases import BACKEND

from mcore_ppo.integrations import verl as plugin
from mcore_ppo.integrations.verl.engine import call_site
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from mcore_ppo_testing import verl_distill, verl_engine
from mcore_ppo_testing.attention import gather_sequence_parallel
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.real_verl import require_verl
from mcore_ppo_testing.reference import normwise_relative_error, outputs_from_logits

require_verl()

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN = 64, 32, 4, 2, 32
LENGTHS = (9, 14, 5)
TEMPERATURES = (0.7, 1.3, 0.9)
# fp64 model; the head's fp32 outputs (its contract) against verl's fp64 logits path.
OUT_TOL = 2e-6
GRAD_TOL = 1e-5  # normwise per parameter; a TP factor gives O(1)
LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True)]


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """CPU shims for GPTModel (nothing on CUDA); verl's engine imported; the plugin off after."""
    verl_engine.import_verl_engine()
    yield
    plugin.uninstall()


def _describe(layout) -> str:
    tp, cp, sp = layout
    return f"TP{tp} CP{cp} SP={'on' if sp else 'off'}"


def test_verl_live_fused_path_tp_sp_cp_equals_verls_non_fused_path(check):
    seed = shared_seed()
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    kind = "verl fused path with the plugin vs verl's non-fused path"
    for tp, cp, sp in fitting(LAYOUTS, lambda layout: layout[0] * layout[1], _describe):
        check.case(_describe((tp, cp, sp)))
        with model_parallel(tp, cp):
            model = build_gpt_model(
                num_layers=LAYERS,
                hidden_size=HIDDEN,
                num_attention_heads=HEADS,
                vocab_size=VOCAB,
                max_sequence_length=MAX_LEN,
                sequence_parallel=sp,
                params_dtype=torch.float64,
                seed=seed % 100_000,
                transformer_layer_spec=local_gpt_spec(attention="sdpa"),
                device=DEVICE,
                position_embedding_type="rope",
            )
            theirs = verl_engine.forward_backward(
                model, sequences, list(TEMPERATURES), use_fused_kernels=False, grad_seed=seed
            )
            with verl_engine.plugin_on("torch"):
                mine = verl_engine.forward_backward(model, sequences, list(TEMPERATURES), grad_seed=seed)
        check.close("log_prob", mine.log_probs, theirs.log_probs, tol=OUT_TOL, kind=kind)
        check.close("entropy", mine.entropy, theirs.entropy, tol=OUT_TOL, kind=kind)
        worst, where = 0.0, ""
        for name, grad in mine.grads.items():
            error = normwise_relative_error(grad, theirs.grads[name])
            if error > worst:
                worst, where = error, name
        print(f"{_describe((tp, cp, sp))}: worst normwise grad error {worst:.2e} ({where})")
        if worst > GRAD_TOL:
            check.fail(f"grad {where}: normwise relative error {worst:.2e} > {GRAD_TOL}")
    check.done()


MTP_LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, False)]


def test_verl_live_fused_path_with_mtp_tp_sp_equals_verls_logits_path_with_mtp(check, monkeypatch):
    """``MCORE_PPO_VERL_MTP=1``: verl's fused path kept on with MTP (depth 2, ``enable_train``); the
    main head and each MTP depth's loss on the head (SP gather / TP reduction of ``d_hidden`` by the
    model's SP setting) against verl's logits path with MTP: outputs, MTP losses, every gradient."""
    from mcore_ppo.integrations.verl.mtp import ENV_MTP

    monkeypatch.setenv(ENV_MTP, "1")
    seed = shared_seed()
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in LENGTHS]
    kind = "verl fused path with MTP and the plugin vs verl's logits path with MTP"
    for tp, cp, sp in fitting(MTP_LAYOUTS, lambda layout: layout[0] * layout[1], _describe):
        check.case(_describe((tp, cp, sp)) + " MTP depth 2")
        with model_parallel(tp, cp):
            model = build_gpt_model(
                num_layers=LAYERS,
                hidden_size=HIDDEN,
                num_attention_heads=HEADS,
                vocab_size=VOCAB,
                max_sequence_length=MAX_LEN,
                sequence_parallel=sp,
                params_dtype=torch.float64,
                seed=seed % 100_000,
                transformer_layer_spec=local_gpt_spec(attention="sdpa"),
                device=DEVICE,
                position_embedding_type="rope",
                mtp_block_spec=verl_engine.mtp_block_spec,
                mtp_num_layers=2,
                mtp_loss_scaling_factor=0.3,
            )
            run = dict(grad_seed=seed, mtp=True, mtp_train=True, loss_mask=masks)
            theirs = verl_engine.forward_backward(model, sequences, list(TEMPERATURES), use_fused_kernels=False, **run)
            with verl_engine.plugin_on("torch"):
                mine = verl_engine.forward_backward(model, sequences, list(TEMPERATURES), **run)
        check.close("log_prob", mine.log_probs, theirs.log_probs, tol=OUT_TOL, kind=kind)
        check.close("entropy", mine.entropy, theirs.entropy, tol=OUT_TOL, kind=kind)
        if sorted(mine.mtp_losses) != sorted(theirs.mtp_losses) or len(theirs.mtp_losses) != 2:
            check.fail(f"MTP losses logged: {mine.mtp_losses} vs verl's {theirs.mtp_losses}")
        for key, value in theirs.mtp_losses.items():
            if abs(mine.mtp_losses.get(key, float("nan")) - value) > 2e-6 * abs(value):
                check.fail(f"{key}: {mine.mtp_losses.get(key)} vs verl's {value}")
        if mine.grads.keys() != theirs.grads.keys() or not any(n.startswith("mtp.") for n in theirs.grads):
            check.fail(f"gradients of different parameters: {set(mine.grads) ^ set(theirs.grads)}")
        worst, where = 0.0, ""
        for name, grad in mine.grads.items():
            error = normwise_relative_error(grad, theirs.grads[name])
            if error > worst:
                worst, where = error, name
        print(f"{_describe((tp, cp, sp))} MTP: worst normwise grad error {worst:.2e} ({where}); {mine.mtp_losses}")
        if worst > GRAD_TOL:
            check.fail(f"grad {where}: normwise relative error {worst:.2e} > {GRAD_TOL}")
    check.done()


def _reference(hidden, weight, labels, temperature):
    return outputs_from_logits(hidden.reshape(-1, hidden.shape[-1]) @ weight.t(), labels.reshape(-1), temperature)


def test_verl_plugin_kernel_reduces_d_hidden_by_the_call_sites_sp_setting(check):
    """The plugin's kernel at verl's call pattern: under a call site that says SP on, ``hidden``
    comes from Megatron's SP gather and each rank's shard gets the full gradient; SP off, the
    head all-reduces; outside every wrapped call site with TP > 1 and a gradient it raises."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    torch.manual_seed(shared_seed())
    t, h, vocab, temperature = 8, 16, 64, 0.7
    hidden = torch.randn(t, 1, h, dtype=torch.float64)  # verl's packed THD layout
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (1, t))
    g_lp, g_ent = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, temperature)
    ref_dh, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_h, ref_w))
    hidden, weight, labels, g_lp, g_ent = (x.to(DEVICE) for x in (hidden, weight, labels, g_lp, g_ent))
    kind = "verl plugin kernel vs fp64"
    layout = tp_cp_groups(2)
    if layout.tp_group is not None:
        shard = weight.chunk(2)[layout.tp_rank]
        for sp in (True, False):
            check.case(f"tp=2 sp={sp}")
            w = shard.clone().requires_grad_()
            if sp:
                local = hidden.chunk(2, dim=0)[layout.tp_rank].clone().requires_grad_()
                x = gather_from_sequence_parallel_region(local, group=layout.tp_group)
            else:
                local = x = hidden.clone().requires_grad_()
            with call_site("test", sequence_parallel=sp):
                lp, ent = plugin.linear_cross_entropy(x, w, labels, temperature, "none", layout.tp_group)
            check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
            check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            expected = ref_dh.chunk(2, dim=0)[layout.tp_rank] if sp else ref_dh
            check.close("d_hidden", local.grad, expected, tol=1e-12, kind=kind)
            check.close("d_weight", w.grad, ref_dw.chunk(2)[layout.tp_rank], tol=1e-12, kind=kind)
        check.case("tp=2 outside verl's call sites")
        x = hidden.clone().requires_grad_()
        try:
            plugin.linear_cross_entropy(x, shard, labels, temperature, "none", layout.tp_group)
            check.fail("no error for TP 2 with a gradient outside verl's wrapped call sites")
        except RuntimeError as err:
            if "sequence parallelism" not in str(err):
                check.fail(f"unclear error: {err}")
        with torch.no_grad():  # no gradient: nothing to reduce, nothing to know
            lp, _ = plugin.linear_cross_entropy(hidden, shard, labels, temperature, "none", layout.tp_group)
        check.close("log_prob (no grad, no call site)", lp, ref_lp, tol=1e-12, kind=kind)
    check.done()


def test_verl_compat_tp_values_and_partial_d_hidden(check):
    torch.manual_seed(shared_seed())
    s, b, h, vocab, temperature = 8, 2, 16, 64, 0.8
    hidden = torch.randn(s, b, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64)
    labels = torch.randint(0, vocab, (s, b))
    g_lp, g_ent = torch.randn(s * b, dtype=torch.float64), torch.randn(s * b, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, temperature)
    ref_dh, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_h, ref_w))
    hidden, weight, labels, g_lp, g_ent = (t.to(DEVICE) for t in (hidden, weight, labels, g_lp, g_ent))
    kind = "verl linear_cross_entropy vs fp64"
    for tp in fitting((2, 4, 8), lambda tp: tp, lambda tp: f"TP{tp}"):
        layout = tp_cp_groups(tp)
        if layout.tp_group is None:
            continue
        check.case(f"tp={tp}")
        x = hidden.clone().requires_grad_()
        shard = weight.chunk(tp)[layout.tp_rank].clone().requires_grad_()
        lp, ent = linear_cross_entropy(x, shard, labels, temperature, "none", layout.tp_group, backend=BACKEND)
        check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
        check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        check.close("d_weight", shard.grad, ref_dw.chunk(tp)[layout.tp_rank], tol=1e-12, kind=kind)
        partial = x.grad.clone()
        if torch.allclose(partial.cpu(), ref_dh):
            check.fail("d_hidden came back reduced over TP; verl's contract is the partial")
        dist.all_reduce(partial, group=layout.tp_group)
        check.close("d_hidden (partial, all-reduced)", partial, ref_dh, tol=1e-12, kind=kind)

        # verl's Megatron usage with SP: the SP gather's reduce-scatter completes d_hidden.
        local = hidden.chunk(tp, dim=0)[layout.tp_rank].clone().requires_grad_()
        gathered = gather_sequence_parallel(local, layout.tp_group)  # verl: gather_from_sequence_parallel_region
        lp, ent = linear_cross_entropy(
            gathered, shard.detach(), labels, temperature, "none", layout.tp_group, backend=BACKEND
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        check.close("d_hidden (SP)", local.grad, ref_dh.chunk(tp, dim=0)[layout.tp_rank], tol=1e-12, kind=kind)
    check.done()


# Σπ² and top-k distillation (verl's logits-only micro-batch outputs) on the fused path.
K = 8  # the teacher's top-k
PROMPTS = (3, 6, 2)
# |a - b| <= DISTILL_TOL (1 + |b|): the head's fp32 against verl's fp64 logits (fp32 outputs)
DISTILL_TOL = 2e-6
# The output layer scaled so the student's log-probs spread and the clamp cuts some of them.
OUTPUT_SCALE, CLAMP = 25.0, -5.0


def _distill_model(seed: int, sp: bool) -> torch.nn.Module:
    model = build_gpt_model(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
        max_sequence_length=MAX_LEN, sequence_parallel=sp, params_dtype=torch.float64, seed=seed % 100_000,
        transformer_layer_spec=local_gpt_spec(attention="sdpa"), device=DEVICE, position_embedding_type="rope",
    )  # fmt: skip
    with torch.no_grad():
        model.output_layer.weight.mul_(OUTPUT_SCALE)
    return model


def _distill_batch(seed: int, *, distill: bool, **flags):
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[int(j % 3 != 1) for j in range(n - p)] for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    teacher = verl_distill.random_teacher(LENGTHS, VOCAB, K, seed + 1) if distill else None
    return verl_distill.make_distill_batch(
        sequences, list(TEMPERATURES), teacher, prompt_lengths=PROMPTS, response_masks=masks, device=DEVICE, **flags
    )


def _compare(check, mine, theirs, what):
    for d in verl_distill.compare_runs(mine, theirs, out_tol=DISTILL_TOL, grad_tol=GRAD_TOL):
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
            model = _distill_model(seed, sp)
            batch = _distill_batch(seed, distill=True, distillation_only=distillation_only, calculate_entropy=True)
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
        model = _distill_model(seed, False)
        batch = _distill_batch(seed, distill=True, distillation_only=True)
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
            model = _distill_model(seed, sp)
            batch = _distill_batch(seed, distill=distill, calculate_sum_pi_squared=True)
            theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
            with verl_engine.plugin_on("torch"):
                mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
        if "sum_pi_squared" not in theirs.outputs:
            check.fail(f"verl's logits path returned {sorted(theirs.outputs)}")
        _compare(check, mine, theirs, what)
    check.done()


def test_a_teacher_k_refused_on_one_tp_rank_raises_on_every_rank_before_the_topk_pass(check):
    """Rank 0 of a TP 2 group gives teacher tensors with k above MAX_TOPK: the route's own
    refusal is shared at the student's top-k pass's verdict, so rank 0 raises naming the argument
    and rank 1 raises too, before a top-k pass whose k would differ between the ranks."""
    from mcore_ppo.integrations.verl import distill_topk
    from mcore_ppo.options import HiddenGrad, Layout, TokenOrder, call_options

    torch.manual_seed(shared_seed())
    n, h, k = 6, 16, 4
    hidden = torch.randn(n, h, dtype=torch.float64, device=DEVICE)
    weight = torch.randn(VOCAB, h, dtype=torch.float64, device=DEVICE)
    labels = torch.randint(0, VOCAB, (n,), device=DEVICE)
    layout = tp_cp_groups(2)
    if layout.tp_group is not None:
        check.case("TP2, rank 0 with k = 129 teacher ids, rank 1 with 4")
        width = 129 if layout.tp_rank == 0 else k
        ids = torch.randint(0, VOCAB, (1, n, width), device=DEVICE)
        logps = torch.full((1, n, width), -5.0, dtype=torch.float64, device=DEVICE)
        options = call_options(None, ignore_index=-100, backend="torch", return_entropy=False, validate=True)
        student = distill_topk.Student(
            hidden, weight.chunk(2)[layout.tp_rank], labels, 1.0, layout.tp_group,
            Layout(TokenOrder.MEGATRON, HiddenGrad.PARTIAL), options, "torch", None,
        )  # fmt: skip
        match = "k must be in" if layout.tp_rank == 0 else "another rank"
        check.raises(ValueError, match, distill_topk.forward_kl_topk, student, logps, ids, None)
    check.done()
