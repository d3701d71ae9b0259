"""verl's top-k distillation and Σπ² on its fused path with the plugin, against verl's logits path (one rank).

verl's trainer asks its Megatron engine, by micro-batch flags, for what only its logits path
served: ``calculate_sum_pi_squared`` (verl's fused path raises ``NotImplementedError``) and
``distillation_use_topk`` / ``distillation_only`` with ``loss_mode="forward_kl_topk"`` (verl's
fused path silently drops them: no distillation outputs). Here verl's own ``forward_step`` runs
(``mcore_ppo_testing.verl_engine`` / ``verl_distill``) on a real Megatron ``GPTModel`` (fp64, CPU,
one gloo rank) with verl's own configs and loss function (``distillation_ppo_loss`` bound as
verl's worker binds it), once on the logits path and once on the fused path with the plugin:
every returned tensor (same keys, nested layout, dtype), verl's distillation loss and metrics on
them (``distillation_loss``: its masks, clamps, ``agg_loss``), and every parameter's gradient, with
per-sample temperatures, a response mask with zeros and ``log_prob_min_clamp`` on and off.
TP 2 (SP off/on) and TP 2 × CP 2: ``tests/distributed/test_verl_tp_cp.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mcore_ppo.integrations import verl as plugin
from mcore_ppo.logs import forget_logged
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.real_verl import require_verl
from mcore_ppo_testing.seeds import next_seed

require_verl()

from mcore_ppo_testing import verl_distill, verl_engine  # noqa: E402  (they import verl)

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN, K = 64, 32, 4, 2, 32, 8
LENGTHS = (7, 13, 4, 10)
PROMPTS = (3, 5, 1, 4)
TEMPERATURES = [0.6, 1.0, 1.7, 0.85]
# The head's fp32 outputs against verl's fp64 logits path (its outputs are fp32 too):
# |a - b| <= OUT_TOL (1 + |b|).
OUT_TOL = 2e-6
GRAD_TOL = 1e-5  # normwise per parameter; a TP factor or a dropped term gives O(1e-2 .. 1)
# The output layer scaled so the student's log-probs spread over [-15, 0]: the clamp then cuts some.
OUTPUT_SCALE = 25.0
CLAMP = -5.0


@pytest.fixture(scope="module")
def verl_modules(megatron_tp1):
    verl_engine.import_verl_engine()
    yield
    plugin.uninstall()


def _model(tied: bool = False) -> torch.nn.Module:
    model = build_gpt_model(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
        max_sequence_length=MAX_LEN, tie_embeddings=tied, params_dtype=torch.float64, seed=next_seed(),
        transformer_layer_spec=local_gpt_spec(attention="sdpa"), position_embedding_type="rope",
    )  # fmt: skip
    with torch.no_grad():
        (model.embedding.word_embeddings if tied else model.output_layer).weight.mul_(OUTPUT_SCALE)
    return model


def _batch(seed: int, *, distill: bool = True, temperatures=TEMPERATURES, **flags):
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[int(j % 3 != 1) for j in range(n - p)] for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    teacher = verl_distill.random_teacher(LENGTHS, VOCAB, K, seed + 1) if distill else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return verl_distill.make_distill_batch(
        sequences, temperatures, teacher, prompt_lengths=PROMPTS, response_masks=masks, device=device, **flags
    )


def _counted_statistics_passes(monkeypatch) -> list:
    """A list that grows by one per statistics pass of the head (``shard._statistics_pass``)."""
    from mcore_ppo import shard

    passes, original = [], shard._statistics_pass

    def counted(*args, **kwargs):
        passes.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(shard, "_statistics_pass", counted)
    return passes


def _assert_same(mine, theirs, what):
    differences = verl_distill.compare_runs(mine, theirs, out_tol=OUT_TOL, grad_tol=GRAD_TOL)
    for d in differences:
        print(f"{what}: {d.name}: max abs {d.max_abs:.2e}, max rel {d.max_rel:.2e} {d.note}")
    bad = [d for d in differences if not d.ok]
    assert not bad, f"{what}: {bad}"


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize(
    "distillation_only, clamp, entropy, tied",
    [(False, CLAMP, True, False), (True, CLAMP, False, True), (False, None, True, False)],
    ids=["with-log-probs-clamp", "distillation-only-clamp-tied", "no-clamp"],
)
def test_topk_distillation_on_the_fused_path_equals_verls_logits_path(
    distillation_only, clamp, entropy, tied, caplog, monkeypatch
):
    """The plugin's top-k KL against verl's logits path; the head runs no statistics pass of its
    own (the student's top-k pass reduced them: one read of the vocab in the forward)."""
    model = _model(tied)
    seed = next_seed()
    configs = verl_distill.distill_configs(K, clamp, distillation_only=distillation_only)
    batch = _batch(seed, calculate_entropy=entropy, distillation_only=distillation_only)
    theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
    forget_logged()
    passes = _counted_statistics_passes(monkeypatch)
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
    assert passes == []
    expected = {"distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"}
    expected |= {"entropy"} if entropy else set()
    expected |= set() if distillation_only else {"log_probs"}
    assert set(theirs.outputs) == expected
    _assert_same(mine, theirs, "top-k distillation: plugin vs verl's logits path")
    assert theirs.outputs["overlap_count"].values().max() > 0  # the overlap diagnostics are exercised
    if clamp is not None:  # the clamp cuts some of the student's log-probs at the teacher's ids, not all
        mass = theirs.outputs["student_mass"].values()
        assert (mass > K * torch.exp(torch.tensor(clamp)) + 1e-6).any()
    logged = [r.getMessage() for r in caplog.records if r.name == "mcore_ppo"]
    assert any("top-k distillation" in m for m in logged)


@pytest.mark.usefixtures("verl_modules")
def test_without_the_plugin_verls_fused_path_drops_topk_distillation():
    """What the plugin fixes: verl's fused path returns no distillation output (no error either)."""
    model = _model()
    seed = next_seed()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=True)
    batch = _batch(seed, temperatures=0.8, distillation_only=True)
    with verl_engine.kernel_in_place_of_verls(verl_engine.fp64_kernel):
        dropped = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, backward=False)
    assert "distillation_losses" not in dropped.outputs and "log_probs" in dropped.outputs
    with verl_engine.plugin_on("torch"):
        mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, backward=False)
    assert "distillation_losses" in mine.outputs and "log_probs" not in mine.outputs


def _bad_batch(seed: int, change):
    """A distillation_only micro-batch whose teacher tensors ``change(ids, logps)`` returns."""
    teacher = verl_distill.random_teacher(LENGTHS, VOCAB, K, seed + 1)
    ids, logps = change([t.clone() for t in teacher[0]], [t.clone() for t in teacher[1]])
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    return verl_distill.make_distill_batch(
        sequences, 0.9, (ids, logps), prompt_lengths=PROMPTS, distillation_only=True,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )  # fmt: skip


def _first(values, value):
    values[1][3, 2] = value
    return values


# Teacher id values are read where that is free (CPU tensors); on CUDA a bad one gives NaN instead
# of a host sync (tests/distill/test_bad_values.py, docs/design.md §5).
_READ = pytest.mark.skipif(torch.cuda.is_available(), reason="no value is read back on CUDA: the NaN rule")


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize(
    "change, error, match",
    [
        pytest.param(lambda i, p: (_first(i, VOCAB), p), ValueError, r"teacher_ids must be in \[0, 64\)", marks=_READ),
        pytest.param(lambda i, p: (_first(i, -1), p), ValueError, r"teacher_ids must be in \[0, 64\)", marks=_READ),
        (lambda i, p: (i, [x[:, :-1] for x in p]), ValueError, "same shape"),
        (lambda i, p: ([x.float() for x in i], p), TypeError, "teacher_ids must be an integer tensor"),
        (lambda i, p: (i, [x.long() for x in p]), TypeError, "teacher_logprobs must be a floating-point"),
    ],
    ids=["id-above-vocab", "negative-id", "k-mismatch", "float-ids", "integer-logprobs"],
)
def test_bad_teacher_inputs_raise_naming_the_argument(change, error, match):
    model = _model()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=True)
    batch = _bad_batch(next_seed(), change)
    with verl_engine.plugin_on("torch"), pytest.raises(error, match=match):
        verl_distill.distill_step(model, batch, configs, use_fused_kernels=True)


@pytest.mark.usefixtures("verl_modules")
def test_a_loss_that_needs_the_logits_is_refused_not_given_a_wrong_answer():
    """A logits processor that reads the student's logits itself (not through verl's
    ``_VocabParallelKLDivergence``) gets a RuntimeError on the fused path, never made-up values;
    so does one that computes nothing, and a missing loss function is a TypeError."""
    model = _model()
    batch = _bad_batch(next_seed(), lambda i, p: (i, p))

    def own_loss(student_logits=None, **kwargs):
        return {"distillation_losses": torch.logsumexp(student_logits, dim=-1)}

    with verl_engine.plugin_on("torch"):
        engine = verl_engine.make_engine(model, use_fused_kernels=True)
        with pytest.raises(RuntimeError, match="no student logits"):
            type(engine).forward_step(engine, iter([batch]), model, own_loss, None)
        with pytest.raises(RuntimeError, match="did not compute the top-k KL"):
            type(engine).forward_step(engine, iter([batch]), model, lambda **kwargs: {}, None)
        with pytest.raises(TypeError, match="logits_processor_func"):
            type(engine).forward_step(engine, iter([batch]), model, None, None)


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize(
    "distill, entropy",
    [(False, True), (False, False), (True, True)],
    ids=["log-prob-pass", "no-entropy", "with-topk-distillation"],
)
def test_sum_pi_squared_on_the_fused_path_equals_verls_logits_path(distill, entropy, caplog, monkeypatch):
    """``calculate_sum_pi_squared=True``: verl's fused path refuses it; with the plugin the head
    computes it (same key, nested layout and dtype as verl's ``vocab_parallel_sum_pi_squared`` on
    the logits), alone and together with top-k distillation in the same pass (the student's
    top-k pass then reduces the entropy and Σπ²: the head runs no statistics pass of its own)."""
    from verl.utils import tensordict_utils as tu

    model = _model()
    seed = next_seed()
    configs = verl_distill.distill_configs(K, CLAMP, distillation_only=False) if distill else None
    batch = _batch(seed, distill=distill, calculate_sum_pi_squared=True, calculate_entropy=entropy)
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared=True is not supported"):
        verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, backward=False)
    theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
    forget_logged()
    passes = _counted_statistics_passes(monkeypatch)
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
    assert (passes == []) == distill
    assert "sum_pi_squared" in theirs.outputs
    _assert_same(mine, theirs, f"sum_pi_squared (distill={distill}): plugin vs verl's logits path")
    spi = theirs.outputs["sum_pi_squared"].values()
    assert (spi > 1.5 / VOCAB).all() and (spi < 1).all()  # not the uniform floor: a real spread
    assert tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=None) is True  # flag restored
    lifted = [r for r in caplog.records if "calculate_sum_pi_squared=True on verl's fused path" in r.getMessage()]
    assert len(lifted) == 1 and lifted[0].levelno == logging.WARNING
