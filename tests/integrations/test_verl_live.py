"""verl's live Megatron path, as verl 0.9.1 (and verl-project/verl at 1dda039b) runs it, with the plugin.

verl's engine computes log-probs in ``MegatronEngineWithLMHead.forward_step``: with
``use_fused_kernels`` it calls ``fused_forward_model_engine`` (THD packing of the nested batch,
labels rolled by verl, the patched ``GPTModel.forward`` on megatron-core < 0.18 or the
``output_processor`` hook on >= 0.18, ending in ``linear_cross_entropy``); without it verl's
non-fused ``gptmodel_forward_model_engine`` and ``_lm_head_logits_processor`` take them from full
logits. Here verl's own ``forward_step`` runs (``mcore_ppo_testing.verl_engine``) on a real
Megatron ``GPTModel`` (fp64, CPU shims, one gloo rank) and the plugin's fused path is compared
with (a) the same verl code with an fp64 full-logits kernel bound where verl binds its Triton
kernel (which needs CUDA) and (b) verl's non-fused path: log-probs, entropy and every
parameter's gradient. Then what the plugin adds to verl's path: per-sample temperatures,
``calculate_entropy=False``, and the WARNING when verl's engine never takes the fused path.
TP 2 with SP on and off and CP 2: ``tests/distributed/test_verl_tp_cp.py``.
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
from mcore_ppo_testing.reference import normwise_relative_error
from mcore_ppo_testing.seeds import next_seed

require_verl()

from mcore_ppo_testing import verl_engine  # noqa: E402  (it imports verl)

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN = 96, 32, 4, 2, 32
LENGTHS = (7, 13, 3, 10)
# The head's fp32 outputs and accumulation against fp64 logits (its contract: fp32 rounding).
OUT_TOL = {"rtol": 2e-6, "atol": 2e-6}
# Gradients normwise per parameter, ||a - b|| / ||b||: fp32 rounding of the head's d_hidden is
# ~1e-7 of the gradient's scale (an element near 0 can be off by more, relatively); a TP factor
# or a wrong token pairing gives O(1).
GRAD_TOL = 1e-5


@pytest.fixture(scope="module")
def verl_modules(megatron_tp1):
    """verl's engine imported (the Ray stand-in where Ray is missing); the plugin off after."""
    verl_engine.import_verl_engine()
    yield
    plugin.uninstall()


def _model(*, tied: bool = False, attention: str = "sdpa") -> torch.nn.Module:
    return build_gpt_model(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=MAX_LEN,
        tie_embeddings=tied,
        params_dtype=torch.float64,
        seed=next_seed(),
        transformer_layer_spec=local_gpt_spec(attention=attention),
        position_embedding_type="rope",
    )


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _assert_runs_equal(mine, theirs, what, out_tol=OUT_TOL, grad_tol=GRAD_TOL):
    torch.testing.assert_close(mine.log_probs, theirs.log_probs, **out_tol, msg=lambda m: f"{what}: log_probs: {m}")
    if theirs.entropy is not None:
        torch.testing.assert_close(mine.entropy, theirs.entropy, **out_tol, msg=lambda m: f"{what}: entropy: {m}")
    assert mine.grads.keys() == theirs.grads.keys()
    for name, grad in mine.grads.items():
        error = normwise_relative_error(grad, theirs.grads[name])
        assert error <= grad_tol, f"{what}: {name}: normwise relative error {error:.2e} > {grad_tol:.0e}"


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_live_fused_path_with_the_plugin_equals_fp64_kernel_and_verls_non_fused_path(tied, caplog):
    import verl.models.mcore.model_forward_fused as fused

    model = _model(tied=tied)
    sequences, temperature, seed = _sequences(next_seed()), 0.7, next_seed()
    with verl_engine.kernel_in_place_of_verls(verl_engine.fp64_kernel):
        fp64 = verl_engine.forward_backward(model, sequences, temperature, grad_seed=seed)
    non_fused = verl_engine.forward_backward(model, sequences, temperature, use_fused_kernels=False, grad_seed=seed)
    forget_logged()
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        assert fused.linear_cross_entropy is plugin.linear_cross_entropy
        mine = verl_engine.forward_backward(model, sequences, temperature, grad_seed=seed)
        route = fused._get_fused_forward_mode(model)
    print(f"verl fused route: {route}; tokens {mine.log_probs.numel()}")
    assert mine.log_probs.numel() == sum(LENGTHS)
    _assert_runs_equal(mine, fp64, "plugin vs fp64 kernel in verl's fused path")
    _assert_runs_equal(mine, non_fused, "plugin vs verl's non-fused path")
    on = [r for r in caplog.records if "verl plugin: on:" in r.getMessage()]
    assert len(on) == 1 and on[0].levelno == logging.INFO
    assert "_fused_GPTModel_forward" in on[0].getMessage() or "fused_output_processor" in on[0].getMessage()
    # Only the plugin's own records: megatron-core may warn about its own deprecations here.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("mcore_ppo")]


@pytest.mark.usefixtures("verl_modules")
def test_the_on_line_is_logged_for_the_forward_only_and_the_training_pass(caplog):
    """The plugin's "on" line says each kind of pass once: verl's forward-only log-prob pass and
    its training pass decide the TP reduction differently, and both are logged, in their order."""
    model = _model()
    sequences = _sequences(next_seed())
    forget_logged()
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        verl_engine.verl_log_probs(model, sequences, 0.7)
        verl_engine.forward_backward(model, sequences, 0.7)
        verl_engine.verl_log_probs(model, sequences, 0.7)
        verl_engine.forward_backward(model, sequences, 0.7)
    on = [r.getMessage() for r in caplog.records if "verl plugin: on:" in r.getMessage()]
    assert len(on) == 2, on
    assert "forward-only pass: no TP reduction needed" in on[0], on[0]
    assert "training pass: no TP reduction needed" in on[1], on[1]


@pytest.mark.usefixtures("verl_modules")
def test_per_sample_temperatures_through_the_plugin_equal_verls_non_fused_path():
    from verl.workers.engine.megatron.transformer_impl import _resolve_fused_temperature

    model = _model()
    sequences, seed = _sequences(next_seed()), next_seed()
    temperatures = [0.6, 1.0, 1.7, 0.85]
    # verl alone refuses them on its fused path (its kernel takes one float).
    with pytest.raises(NotImplementedError, match="uniform temperature"):
        _resolve_fused_temperature(torch.tensor(temperatures))
    non_fused = verl_engine.forward_backward(model, sequences, temperatures, use_fused_kernels=False, grad_seed=seed)
    with verl_engine.plugin_on("torch"):
        mine = verl_engine.forward_backward(model, sequences, temperatures, grad_seed=seed)
        uniform = verl_engine.forward_backward(model, sequences, [0.6] * 4, grad_seed=seed)
    _assert_runs_equal(mine, non_fused, "per-sample temperatures: plugin vs verl's non-fused path")
    # Not a no-op: one temperature for all gives other values.
    assert not torch.allclose(uniform.log_probs, mine.log_probs, rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("verl_modules")
def test_calculate_entropy_false_skips_the_entropy_in_the_head(monkeypatch):
    from mcore_ppo.integrations.verl import kernel

    model = _model()
    sequences, seed = _sequences(next_seed()), next_seed()
    asked = []
    real = kernel.linear_cross_entropy

    def spy(*args, **kwargs):
        asked.append(kwargs.get("return_entropy", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "linear_cross_entropy", spy)
    with verl_engine.plugin_on("torch"):
        with_entropy = verl_engine.forward_backward(model, sequences, 0.9, grad_seed=seed)
        without = verl_engine.forward_backward(model, sequences, 0.9, calculate_entropy=False, grad_seed=seed)
    assert asked == [True, False]
    assert without.entropy is None
    torch.testing.assert_close(without.log_probs, with_entropy.log_probs, rtol=0, atol=0)
    # The entropy's share of the gradient is gone: log-probs alone through verl's non-fused path.
    reference = verl_engine.forward_backward(
        model, sequences, 0.9, use_fused_kernels=False, calculate_entropy=False, grad_seed=seed
    )
    _assert_runs_equal(without, reference, "calculate_entropy=False: plugin vs verl's non-fused path")


@pytest.mark.usefixtures("verl_modules")
def test_plain_helper_returns_per_token_values_in_sequence_order():
    model = _model()
    sequences = _sequences(next_seed())
    out = verl_engine.verl_log_probs(model, sequences, [0.8, 1.0, 1.2, 0.9], backend="torch")
    with verl_engine.kernel_in_place_of_verls(verl_engine.fp64_kernel):
        verls = verl_engine.verl_log_probs(model, sequences, 0.8, plugin=False)
    assert [t.shape[0] for t in out.log_probs] == [n - 1 for n in LENGTHS]
    assert [t.shape[0] for t in out.entropy] == [n - 1 for n in LENGTHS]
    torch.testing.assert_close(out.log_probs[0], verls.log_probs[0], **OUT_TOL)  # the first has T = 0.8 in both
    # Independently: the first sequence's next-token log-probs from the model's own logits.
    from verl.models.mcore.model_forward_fused import unpatch_fused_forward

    unpatch_fused_forward(model)  # verl's fused forward returns log-probs, not logits
    device = next(model.parameters()).device  # Megatron builds on the GPU where there is one
    with torch.no_grad():
        ids = torch.tensor(sequences[0], device=device)[None]
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None], attention_mask=None)
    log_softmax = torch.log_softmax(logits[0, :-1].double() / 0.8, dim=-1)
    expected = log_softmax.gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs[0].double(), expected, **OUT_TOL)


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize(
    "setup, setting",
    [
        ({"use_fused_kernels": False}, "actor_rollout_ref.model.use_fused_kernels=True"),
        ({"use_remove_padding": False}, "actor_rollout_ref.model.use_remove_padding=True"),
        ({"mtp": True}, "actor_rollout_ref.model.mtp.enable=False"),
    ],
    ids=["fused-kernels-off", "no-remove-padding", "mtp"],
)
def test_warning_when_verls_engine_never_takes_the_fused_path(setup, setting, caplog):
    model = _model()
    batch = verl_engine.make_batch(_sequences(next_seed()), 1.0)
    forget_logged()
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        engine = verl_engine.make_engine(model, **setup)
        assert not engine.engine_config.use_fused_kernels
        for _ in range(2):  # the second forward says nothing more
            if setup.get("use_remove_padding", True):
                out = verl_engine.run_forward_step(engine, model, batch)
                assert out["log_probs"].values().numel() == sum(LENGTHS)
            else:
                # verl's padded [b, s] path hands the attention a mask in TransformerEngine's
                # layout, which no attention without TransformerEngine takes; the check comes first.
                with pytest.raises((RuntimeError, NotImplementedError)):
                    verl_engine.run_forward_step(engine, model, batch)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "mcore_ppo"]
    assert len(warnings) == 1, warnings
    assert setting in warnings[0] and "does nothing" in warnings[0]
    assert not [r for r in caplog.records if "verl plugin: on:" in r.getMessage()]  # the head never ran


@pytest.mark.usefixtures("verl_modules")
def test_value_model_is_noted_not_warned(caplog):
    model = _model()
    batch = verl_engine.make_batch(_sequences(next_seed()), 1.0)
    forget_logged()
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        engine = verl_engine.make_engine(model, value_model=True)
        type(engine).forward_step(engine, iter([batch]), model, None, lambda *a, **k: None)
    mine = [r for r in caplog.records if r.name == "mcore_ppo"]
    assert not [r for r in mine if r.levelno >= logging.WARNING]
    assert any("value model" in r.getMessage() and r.levelno == logging.INFO for r in mine)


@pytest.mark.usefixtures("verl_modules")
def test_uninstall_restores_every_verl_function():
    import verl.models.mcore.model_forward_fused as fused
    import verl.models.mcore.registry as registry
    import verl.trainer.distillation.megatron.losses as distill_losses
    import verl.workers.engine.megatron.transformer_impl as impl

    def current():
        return [
            fused.linear_cross_entropy,
            fused.fused_output_processor,
            fused._fused_GPTModel_forward,
            fused.fused_forward_model_engine,
            registry.fused_forward_model_engine,
            impl._resolve_fused_temperature,
            impl.MegatronEngine.__dict__["_maybe_enable_fused_kernels"],
            impl.MegatronEngineWithLMHead.__dict__["forward_step"],
            impl.MegatronEngineWithValueHead.__dict__["forward_step"],
            distill_losses._VocabParallelKLDivergence,
        ]

    plugin.uninstall()
    verls = current()
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verls_kernel

    assert verls[0] is verls_kernel
    plugin.install()
    plugin.install()  # idempotent: nothing wrapped twice
    mine = current()
    assert all(a is not b for a, b in zip(mine, verls, strict=True))
    assert all(getattr(f, "__mcore_ppo_original__", None) is v for f, v in zip(mine[1:], verls[1:], strict=True))
    plugin.uninstall()
    assert all(a is b for a, b in zip(current(), verls, strict=True))


@pytest.mark.usefixtures("verl_modules")
def test_verls_real_output_processor_hook_route_with_the_plugin():
    """verl's ``fused_output_processor`` (the route megatron-core >= 0.18 takes; this CPU's
    megatron-core may predate the hook, so it is called here as Megatron's postprocess calls it)
    with the plugin equals the fp64 kernel in verl's place: values and d_hidden / d_weight."""
    import verl.models.mcore.model_forward_fused as fused

    model = _model()
    gen = torch.Generator().manual_seed(next_seed())
    t = 12
    device = next(model.parameters()).device  # Megatron builds on the GPU where there is one
    hidden = torch.randn(t, 1, HIDDEN, generator=gen, dtype=torch.float64).to(device)  # verl's packed THD layout
    labels = torch.randint(0, VOCAB, (1, t), generator=gen).to(device)
    g = torch.randn(2, t, generator=gen, dtype=torch.float64).to(device)

    def run():
        x = hidden.clone().requires_grad_()
        model.output_layer.weight.grad = None
        out = fused.fused_output_processor(
            hidden_states=x, output_layer=model.output_layer, output_weight=None, labels=labels,
            context=fused.FusedOutputProcessorContext(temperature=0.8), config=model.config,
        )  # fmt: skip
        ((out.log_probs.double() * g[0]).sum() + (out.entropy.double() * g[1]).sum()).backward()
        return out.log_probs.detach().double(), out.entropy.detach().double(), x.grad, model.output_layer.weight.grad

    with verl_engine.kernel_in_place_of_verls(verl_engine.fp64_kernel):
        reference = run()
    with verl_engine.plugin_on("torch"):
        assert hasattr(fused.fused_output_processor, "__mcore_ppo_original__")
        mine = run()
    for a, b in zip(mine, reference, strict=True):
        torch.testing.assert_close(a, b, **OUT_TOL)
