"""verl's fused path with multi-token prediction (MTP), kept on by the plugin (``MCORE_PPO_VERL_MTP=1``).

verl turns its fused path off whenever MTP is enabled; with the variable set the plugin keeps it
on, runs verl's MTP postprocess with the head as its output processor and computes each MTP
depth's loss on the head. Here verl's own ``forward_step`` (``mcore_ppo_testing.verl_engine``)
runs on a real Megatron ``GPTModel`` with MTP layers (fp64, CPU shims, one gloo rank), with verl's
MTP patches applied as verl's engine applies them, and the plugin's fused path is compared with
verl's non-fused logits path with MTP on the same model and batch: log-probs, entropy, the MTP
losses verl logs (``get_megatron_mtp_loss``) and every parameter's gradient (the MTP loss reaches
the MTP layers, and the decoder, through ``MTPLossAutoScaler``), for MTP depth 1 and 2 with
``mtp.enable_train`` on and off, a loss mask with zeros (verl's prompt tokens), and per-sample
temperatures (the MTP loss is at temperature 1 on both paths). The installed megatron-core's route
runs (``_fused_GPTModel_forward`` below 0.18), and the hook route (``output_processor`` through
``GPTModel._postprocess``, megatron-core >= 0.18) is run too by giving the model that forward
(``verl_engine.megatron_hook_route``). The output layer's module is never called on the fused
path: no ``[s, b, V]`` logits. TP 2 with SP off and on: ``tests/distributed/test_verl_tp_cp.py``.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

from mcore_ppo.integrations import verl as plugin
from mcore_ppo.integrations.verl import mtp as plugin_mtp
from mcore_ppo.integrations.verl import mtp_loss
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
TEMPERATURES = [0.6, 1.0, 1.7, 0.85]
# The head's fp32 outputs against verl's fp64 logits path (as in test_verl_live.py).
OUT_TOL = {"rtol": 2e-6, "atol": 2e-6}
# MTP losses: verl logs them from fp32 trackers (Megatron's), the head's CE is fp32.
MTP_LOSS_RTOL = 2e-6
GRAD_TOL = 1e-5  # normwise per parameter; a wrong label shift, mask or scale gives O(1e-2) or more


@pytest.fixture(scope="module")
def verl_modules(megatron_tp1):
    verl_engine.import_verl_engine()
    yield
    plugin.uninstall()


@pytest.fixture
def mtp_on(monkeypatch):
    monkeypatch.setenv(plugin_mtp.ENV_MTP, "1")


def _model(depths: int, *, tied: bool = False) -> torch.nn.Module:
    return build_gpt_model(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=MAX_LEN,
        tie_embeddings=tied,
        params_dtype=torch.float64,
        seed=next_seed(),
        transformer_layer_spec=local_gpt_spec(attention="sdpa"),
        position_embedding_type="rope",
        mtp_block_spec=verl_engine.mtp_block_spec,
        mtp_num_layers=depths,
        mtp_loss_scaling_factor=0.3,
    )


def _batch(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token sequences and loss masks with a 'prompt' of zeros (verl's response mask)."""
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in LENGTHS]
    return sequences, masks


class _LogitsCounter:
    """Counts calls of the model's output layer module (it makes [s, b, V/tp] logits)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.output_layer.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


def _assert_same(mine, theirs, what, depths, train):
    torch.testing.assert_close(mine.log_probs, theirs.log_probs, **OUT_TOL, msg=lambda m: f"{what}: log_probs: {m}")
    torch.testing.assert_close(mine.entropy, theirs.entropy, **OUT_TOL, msg=lambda m: f"{what}: entropy: {m}")
    assert sorted(mine.mtp_losses) == sorted(theirs.mtp_losses), (mine.mtp_losses, theirs.mtp_losses)
    assert len(theirs.mtp_losses) == (depths if train else 0)
    for key, value in theirs.mtp_losses.items():
        assert mine.mtp_losses[key] == pytest.approx(value, rel=MTP_LOSS_RTOL), f"{what}: {key}"
    assert mine.grads.keys() == theirs.grads.keys(), set(mine.grads) ^ set(theirs.grads)
    assert any(name.startswith("mtp.") for name in theirs.grads) == train
    worst, where = 0.0, ""
    for name, grad in mine.grads.items():
        error = normwise_relative_error(grad, theirs.grads[name])
        if error > worst:
            worst, where = error, name
    print(f"{what}: depth {depths}, train {train}: worst normwise grad error {worst:.2e} ({where})")
    assert worst <= GRAD_TOL, f"{what}: {where}: normwise relative error {worst:.2e} > {GRAD_TOL:.0e}"


# Every depth x training case on the installed megatron-core's route; the hook route for two.
CASES = [("installed", d, t) for d in (1, 2) for t in (True, False)] + [("hook", 2, True), ("hook", 1, False)]


@pytest.mark.usefixtures("verl_modules", "mtp_on")
@pytest.mark.parametrize(
    "route, depths, train", CASES, ids=[f"{r}-depth{d}-{'train' if t else 'no-train'}" for r, d, t in CASES]
)
def test_fused_path_with_mtp_equals_verls_logits_path_with_mtp(route, depths, train, caplog):
    import verl.models.mcore.model_forward_fused as fused

    model = _model(depths, tied=depths == 2)
    (sequences, masks), seed = _batch(next_seed()), next_seed()
    run = dict(grad_seed=seed, mtp=True, mtp_train=train, loss_mask=masks)
    counter = _LogitsCounter(model)
    theirs = verl_engine.forward_backward(model, sequences, TEMPERATURES, use_fused_kernels=False, **run)
    assert counter.calls == 1 + (depths if train else 0)  # verl's logits path: main head + one per depth
    counter.calls = 0
    forget_logged()
    switch = verl_engine.megatron_hook_route(model) if route == "hook" else verl_engine.plugin_on("torch")
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"), switch:
        mine = verl_engine.forward_backward(model, sequences, TEMPERATURES, **run)
        taken = fused._get_fused_forward_mode(model)
    counter.handle.remove()
    assert counter.calls == 0, "the fused path called the output layer (logits)"
    from mcore_ppo.model import supports_output_processor

    assert taken == ("hook" if route == "hook" or supports_output_processor(model) else "legacy")
    print(f"verl fused route: {taken}")
    _assert_same(mine, theirs, f"plugin fused path ({taken}) vs verl's logits path with MTP", depths, train)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "mcore_ppo"]
    assert any(level == logging.WARNING and plugin_mtp.ENV_MTP in m and "stays on" in m for level, m in messages)
    assert any(level == logging.INFO and "verl plugin: on:" in m for level, m in messages)
    if taken == "hook" or train:  # the MTP postprocess runs (the legacy route without training does not need it)
        assert any("MTP postprocess called the output processor" in m for _, m in messages), messages


@pytest.mark.usefixtures("verl_modules")
def test_without_the_variable_verl_turns_the_fused_path_off_and_the_plugin_warns(monkeypatch, caplog):
    monkeypatch.delenv(plugin_mtp.ENV_MTP, raising=False)
    model = _model(1)
    batch = verl_engine.make_batch(_batch(next_seed())[0], 1.0)
    forget_logged()
    with caplog.at_level(logging.INFO, logger="mcore_ppo"), verl_engine.plugin_on("torch"):
        engine = verl_engine.make_engine(model, mtp=True, mtp_train=True)
        assert not engine.engine_config.use_fused_kernels
        verl_engine.run_forward_step(engine, model, batch)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "mcore_ppo"]
    assert len(warnings) == 1 and "does nothing" in warnings[0] and f"{plugin_mtp.ENV_MTP}=1" in warnings[0]


@pytest.mark.usefixtures("verl_modules")
def test_remove_padding_off_still_turns_the_fused_path_off_with_the_variable(mtp_on):
    with verl_engine.plugin_on("torch"):
        engine = verl_engine.make_engine(_model(1), mtp=True, mtp_train=True, use_remove_padding=False)
    assert not engine.engine_config.use_fused_kernels
    assert plugin.engine.fused_path_off_reason(engine)[1] == "actor_rollout_ref.model.use_remove_padding=True"


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_value_of_the_variable_is_refused(monkeypatch, value):
    monkeypatch.setenv(plugin_mtp.ENV_MTP, value)
    with pytest.raises(ValueError, match=plugin_mtp.ENV_MTP):
        plugin_mtp.mtp_enabled()


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), ("0", False), ("", False), (None, False)])
def test_the_variable_is_off_unless_set(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(plugin_mtp.ENV_MTP, raising=False)
    else:
        monkeypatch.setenv(plugin_mtp.ENV_MTP, value)
    assert plugin_mtp.mtp_enabled() is on


@pytest.mark.usefixtures("verl_modules", "mtp_on")
def test_per_token_loss_scaling_of_the_mtp_loss_equals_verls():
    """``calculate_per_token_loss``: each depth's loss times ``original / depth`` token counts
    (Megatron then divides every gradient by the main loss's tokens), on both paths."""
    model = _model(2)
    (sequences, masks), seed = _batch(next_seed()), next_seed()
    run = dict(grad_seed=seed, mtp=True, mtp_train=True, loss_mask=masks)
    model.config.calculate_per_token_loss = True
    try:
        theirs = verl_engine.forward_backward(model, sequences, 1.0, use_fused_kernels=False, **run)
        with verl_engine.plugin_on("torch"):
            mine = verl_engine.forward_backward(model, sequences, 1.0, **run)
    finally:
        model.config.calculate_per_token_loss = False
    _assert_same(mine, theirs, "calculate_per_token_loss: plugin vs verl's logits path with MTP", 2, True)
    per_sequence = verl_engine.forward_backward(model, sequences, 1.0, use_fused_kernels=False, **run)
    # Not a no-op: the MTP layers' gradients differ by the token-count ratio.
    assert not torch.allclose(
        per_sequence.grads["mtp.layers.1.eh_proj.weight"], theirs.grads["mtp.layers.1.eh_proj.weight"]
    )


class _NewestTracker:
    calls: ClassVar[list] = []

    @staticmethod
    def save_loss_to_tracker(
        loss_sum, num_tokens, layer_number, num_layers, correct=None, total=None, reduce_group=None,
        avg_group=None, calculate_per_token_loss=False,
    ):  # fmt: skip
        _NewestTracker.calls.append((loss_sum, num_tokens, layer_number, num_layers, correct, total))


class _MetricsTracker:
    calls: ClassVar[list] = []

    @staticmethod
    def save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, reduce_group=None, avg_group=None):
        _MetricsTracker.calls.append((loss, correct, total, layer_number, num_layers))


@pytest.mark.usefixtures("verl_modules")
@pytest.mark.parametrize("api", [_NewestTracker, _MetricsTracker], ids=["loss_sum-api", "metrics-api"])
def test_mtp_tracker_apis_get_megatrons_loss_and_acceptance_counts(api, monkeypatch):
    """Newer megatron-core trackers (raw sums; loss plus acceptance counts): the values their MTP
    loss passes, the acceptance counts from the top-1 id against an argmax of full logits."""
    from megatron.core.transformer import multi_token_prediction

    monkeypatch.setattr(multi_token_prediction, "MTPLossLoggingHelper", api)
    api.calls.clear()
    gen = torch.Generator().manual_seed(next_seed())
    t = 11
    hidden = torch.randn(t, 1, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    preds = (hidden[:, 0] @ weight.t()).argmax(-1)[None]
    labels = torch.where(torch.rand(1, t, generator=gen) < 0.5, preds, torch.randint(0, VOCAB, (1, t), generator=gen))
    loss_mask = torch.rand(1, t, generator=gen) < 0.7
    loss_sum, num_tokens = torch.tensor(3.5), loss_mask.sum()
    config = type("Config", (), {"sequence_parallel": False, "calculate_per_token_loss": False})()
    mtp_loss._save_to_tracker(loss_sum, num_tokens, hidden, weight, labels, loss_mask, 1, 2, config)
    correct = float(((preds == labels) & loss_mask).sum())
    assert 0 < correct < float(num_tokens)  # the case distinguishes right from wrong counts
    (call,) = api.calls
    if api is _NewestTracker:
        assert call[:4] == (loss_sum, num_tokens, 1, 2)
        assert (float(call[4]), float(call[5])) == (correct, float(num_tokens))
    else:
        assert float(call[0]) == pytest.approx(3.5 / float(num_tokens))
        assert (float(call[1]), float(call[2]), call[3], call[4]) == (correct, float(num_tokens), 1, 2)
