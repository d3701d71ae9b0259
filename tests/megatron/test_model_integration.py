"""Single-process checks of the Megatron GPT integration (TP 1; CPU with the shims, or CUDA).

What needs several ranks (TP/SP/CP layouts) is in ``tests/distributed/test_model_parity.py``.
Here: the installed head keeps the model's parameters and state-dict keys, ``labels=None``
still gives logits, both forward paths (megatron-core >= 0.18's ``output_processor`` hook, and
the fallback) equal the logits path in values and in every parameter's gradient, pipeline
stages, hooks carried over, and the CPU shims themselves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

import mcore_ppo
from mcore_ppo import gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo import model as model_module
from mcore_ppo.options import HeadOptions
from mcore_ppo_testing import cpu_shims, install_cpu_shims, shims_installed, uninstall_cpu_shims
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import (
    logits_log_probs_and_entropy,
    pop_parameter_grads,
    synthetic_batch,
    weighted_backward,
)
from mcore_ppo_testing.hooked_gpt import HookedGPTModel, as_hooked, forward_path
from mcore_ppo_testing.layer_specs import local_gpt_spec

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 32, 4, 2, 16
TEMPERATURE = 0.7
TOL = {"rtol": 1e-9, "atol": 1e-11}
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# One-rank process group and Megatron parallel_state (TP 1) for every test here: tests/conftest.py.
pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _model(*, tied: bool = False, pre_process: bool = True, post_process: bool = True, layers: int = LAYERS):
    return build_gpt_model(
        num_layers=layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        tie_embeddings=tied,
        params_dtype=torch.float64,
        pre_process=pre_process,
        post_process=post_process,
        seed=2024,
        transformer_layer_spec=local_gpt_spec(),
        device=DEVICE,
    )


def _batch(kind: str, seed: int):
    return synthetic_batch(
        kind, vocab_size=VOCAB, seq_length=SEQ, generator=torch.Generator().manual_seed(seed), device=DEVICE
    )


# ---------------------------------------------------------------------------------------------
# install_fused_head
# ---------------------------------------------------------------------------------------------


def test_install_keeps_weight_parameter_and_state_dict():
    model = _model()
    old_weight = model.output_layer.weight
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    param_ids = [id(p) for p in model.parameters()]
    head = install_fused_head(model, temperature=TEMPERATURE)
    assert isinstance(head, mcore_ppo.VocabParallelFusedPPOHead)
    assert model.output_layer is head
    assert head.weight is old_weight  # the same Parameter object: optimizer/DDP state stays valid
    assert head.weight.is_embedding_or_output_parameter
    assert [id(p) for p in model.parameters()] == param_ids
    after = model.state_dict()
    assert list(after.keys()) == list(model.state_dict().keys())
    assert {k for k, v in after.items() if isinstance(v, torch.Tensor)} == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # A checkpoint saved before the swap loads strictly after it.
    model.load_state_dict({**after, **before}, strict=True)
    assert head.temperature == TEMPERATURE


def test_install_checkpoint_roundtrip_changes_weight_in_place():
    model = _model()
    head = install_fused_head(model)
    state = model.state_dict()
    new = torch.randn_like(head.weight)
    state["output_layer.weight"] = new
    model.load_state_dict(state)
    assert torch.equal(head.weight, new)


def test_install_tied_allocates_no_weight():
    model = _model(tied=True)
    keys = list(model.state_dict().keys())
    assert model.output_layer.weight is None
    head = install_fused_head(model)
    assert head.weight is None
    assert list(model.state_dict().keys()) == keys
    assert "output_layer.weight" not in keys


def test_install_is_idempotent_and_updates_options():
    model = _model()
    head = install_fused_head(model, temperature=1.0, backend="torch", validate=False)
    assert (head.backend, head.validate) == ("torch", False)
    again = install_fused_head(model, temperature=0.5, backend="auto", ignore_index=-1, return_entropy=False)
    assert again is head
    assert (head.temperature, head.backend, head.ignore_index) == (0.5, "auto", -1)
    assert (head.return_entropy, head.validate) == (False, True)
    assert head.options == HeadOptions(backend="auto", ignore_index=-1, return_entropy=False)


def test_install_rejects_foreign_output_layer_and_bad_options():
    model = _model()
    with pytest.raises(ValueError, match="temperature"):
        install_fused_head(model, temperature=0.0)
    with pytest.raises(TypeError, match="ignore_index"):
        install_fused_head(model, ignore_index=1.5)
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        install_fused_head(model, return_sum_pi_squared="yes")
    model.config.defer_embedding_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="defer_embedding_wgrad_compute"):
        install_fused_head(model)
    model.config.defer_embedding_wgrad_compute = False
    install_fused_head(model)
    model.config.use_mup = True
    batch = _batch("padded", 0)
    with pytest.raises(NotImplementedError, match="MuP"):
        gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())
    model.config.use_mup = False
    model.output_layer = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    with pytest.raises(TypeError, match="ColumnParallelLinear"):
        install_fused_head(model)
    with pytest.raises(TypeError, match="install_fused_head"):
        gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())


@pytest.mark.parametrize("name", ["input_ids", "position_ids"])
def test_float_token_or_position_ids_are_refused_by_name(name):
    """Ids of a floating dtype are refused naming them, before the model runs (its embedding
    would raise deep inside Megatron)."""
    model = _model()
    install_fused_head(model)
    batch = _batch("padded", 0)
    inputs = batch.model_inputs()
    inputs[name] = inputs[name].float()
    with pytest.raises(TypeError, match=rf"^{name} must be an integer tensor, got dtype torch.float32"):
        gpt_log_probs_and_entropy(model, labels=batch.labels, **inputs)


def test_install_through_wrappers_and_carries_forward_pre_hooks():
    """Hooks registered on the old output layer (Megatron DDP's param-gather wait) fire on the head,
    and a DDP-like wrapper's handle table is re-keyed so its disable_forward_pre_hook still works."""
    model = _model()
    calls = []
    handle = model.output_layer.register_forward_pre_hook(lambda module, args: calls.append(type(module).__name__))

    class Wrapper(torch.nn.Module):  # stands for Megatron DDP / Float16Module
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.remove_forward_pre_hook_handles = {model.output_layer: handle}

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    wrapped = Wrapper(model)
    old = model.output_layer
    head = install_fused_head(wrapped)
    assert model.output_layer is head
    assert wrapped.remove_forward_pre_hook_handles == {head: handle}
    assert old not in wrapped.remove_forward_pre_hook_handles
    batch = _batch("padded", 1)
    for path in ("fallback", "hook"):
        with forward_path(wrapped, path):
            gpt_log_probs_and_entropy(wrapped, labels=batch.labels, **batch.model_inputs())
    assert calls == ["VocabParallelFusedPPOHead"] * 2
    wrapped.remove_forward_pre_hook_handles[head].remove()
    gpt_log_probs_and_entropy(wrapped, labels=batch.labels, **batch.model_inputs())
    assert len(calls) == 2


# ---------------------------------------------------------------------------------------------
# The forward: both paths against the logits path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fallback", "hook"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_head_matches_logits_path_values_and_every_grad(kind: str, tied: bool, path: str):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    batch = _batch(kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    g_lp = torch.randn(batch.labels.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    g_ent = torch.randn(batch.labels.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    model = _model(tied=tied)
    ref_lp, ref_ent = logits_log_probs_and_entropy(
        model, labels=batch.labels, temperature=TEMPERATURE, **batch.model_inputs()
    )
    weighted_backward(ref_lp, ref_ent, g_lp, g_ent)
    ref_grads = pop_parameter_grads(model)

    install_fused_head(model, temperature=TEMPERATURE, backend="torch")
    native_hook = model_module.supports_output_processor(model)
    hook_calls = HookedGPTModel.hook_calls
    with forward_path(model, path):
        lp, ent = gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())
    if not native_hook:  # the emulated hook counts its calls: the path taken is the path asked for
        assert HookedGPTModel.hook_calls == hook_calls + (path == "hook")
    assert lp.shape == ent.shape == batch.labels.shape
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    assert bool((lp[batch.labels == -100] == 0).all()) and bool((ent[batch.labels == -100] == 0).all())
    weighted_backward(lp, ent, g_lp, g_ent)
    grads = pop_parameter_grads(model)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if tied:
        assert "embedding.word_embeddings.weight" in grads and "output_layer.weight" not in grads


def test_temperature_per_call_overrides_head_default():
    batch = _batch("padded", 3)
    model = _model()
    ref_lp, ref_ent = logits_log_probs_and_entropy(model, labels=batch.labels, temperature=1.3, **batch.model_inputs())
    install_fused_head(model, temperature=TEMPERATURE)
    with torch.no_grad():
        lp, ent = gpt_log_probs_and_entropy(model, labels=batch.labels, temperature=1.3, **batch.model_inputs())
        default_lp, _ = gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    assert not torch.allclose(default_lp, lp)
    with pytest.raises(ValueError, match="temperature"):
        gpt_log_probs_and_entropy(model, labels=batch.labels, temperature=-1.0, **batch.model_inputs())


@pytest.mark.parametrize("path", ["fallback", "hook"])
def test_sum_pi_squared_through_the_model(path: str):
    """Σπ² from the model path (head option and per-call switch, per-token temperature, entropy
    off) equals the head's own on the model's final hidden states and softmax(logits / T)² summed
    in fp64 from the model's logits; off, the same call returns the pair."""
    batch = _batch("padded", 11)
    temperature = torch.linspace(0.5, 1.5, batch.labels.numel(), dtype=torch.float64, device=DEVICE).view_as(
        batch.labels
    )
    model = _model()
    ignored = batch.labels == -100
    with torch.no_grad():
        probs = torch.softmax(model(batch.input_ids, batch.position_ids, None) / temperature.unsqueeze(-1), dim=-1)
    ref = torch.where(ignored, 0.0, (probs * probs).sum(-1))
    head = install_fused_head(model, backend="torch", return_sum_pi_squared=True)
    assert head.options == HeadOptions(backend="torch", return_sum_pi_squared=True)
    inputs = batch.model_inputs()
    hook_calls = HookedGPTModel.hook_calls
    with forward_path(model, path):
        lp, ent, spi = gpt_log_probs_and_entropy(
            model, labels=batch.labels, temperature=temperature, return_entropy=False, **inputs
        )
        pair = gpt_log_probs_and_entropy(model, labels=batch.labels, return_sum_pi_squared=False, **inputs)
        head.return_sum_pi_squared = False
        with torch.no_grad():
            per_call = gpt_log_probs_and_entropy(
                model, labels=batch.labels, temperature=temperature, return_sum_pi_squared=True, **inputs
            )
        with pytest.raises(TypeError, match="return_sum_pi_squared"):
            gpt_log_probs_and_entropy(model, labels=batch.labels, return_sum_pi_squared=1, **inputs)
    if not model_module.supports_output_processor(model):
        assert HookedGPTModel.hook_calls == hook_calls + 3 * (path == "hook")
    assert ent is None and spi.shape == batch.labels.shape and not spi.requires_grad and lp.requires_grad
    torch.testing.assert_close(spi, ref, **TOL)
    assert bool((spi[ignored] == 0).all())
    hidden, _ = model_module.hidden_states_without_postprocess(model, batch.input_ids, batch.position_ids, None, {})
    with torch.no_grad():
        own = head(hidden, batch.labels, temperature=temperature, return_sum_pi_squared=True)[2]
    torch.testing.assert_close(spi, own, rtol=0, atol=0)
    assert len(pair) == 2 and pair[1] is not None
    assert len(per_call) == 3
    torch.testing.assert_close(per_call[2], spi, rtol=0, atol=0)
    torch.testing.assert_close(per_call[0], lp.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "head_options", [{"return_sum_pi_squared": True}, {"return_entropy": False}], ids=["sum-pi-squared", "no-entropy"]
)
def test_actor_gets_its_pair_whatever_the_heads_outputs(head_options):
    """The PPO actor's forward asks for the entropy and not Σπ² (what its loss and metrics read):
    a head installed with Σπ² on, or with the entropy off, gives the same log-probs, entropy and
    update metrics as the default head."""
    from mcore_ppo.actor import MegatronPPOActor, PPOActorConfig
    from mcore_ppo_testing.ppo_harness import synthetic_rollout

    rollout = synthetic_rollout(num_seqs=3, vocab_size=VOCAB, prompt_len=(2, 4), response_len=(3, 6), seed=5)
    config = PPOActorConfig(temperature=TEMPERATURE, micro_batch_size=2, entropy_coeff=0.01)
    results = []
    for on in (True, False):
        model = _model()
        install_fused_head(model, backend="torch", **(head_options if on else {}))
        actor = MegatronPPOActor(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        log_probs, entropy = actor.compute_log_prob(rollout, calculate_entropy=True)
        metrics = actor.update_policy(dataclasses.replace(rollout, old_log_probs=log_probs - 0.01))
        results.append((log_probs, entropy, metrics))
    (lp_on, ent_on, metrics_on), (lp_off, ent_off, metrics_off) = results
    torch.testing.assert_close(lp_on, lp_off, rtol=0, atol=0)
    torch.testing.assert_close(ent_on, ent_off, rtol=0, atol=0)
    assert metrics_on == metrics_off


def test_labels_none_returns_the_models_logits():
    batch = _batch("padded", 4)
    model = _model()
    with torch.no_grad():
        before = model(batch.input_ids, batch.position_ids, None)
        install_fused_head(model)
        after = gpt_log_probs_and_entropy(model, batch.input_ids, batch.position_ids, None, None)
        direct = model(batch.input_ids, batch.position_ids, None)
    assert after.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(direct, before, rtol=0, atol=0)


def test_output_processor_detection():
    import megatron.core

    major_minor = tuple(int(x) for x in megatron.core.__version__.split(".")[:2])
    model = _model()
    assert model_module.supports_output_processor(model) == (major_minor >= (0, 18))
    hooked = as_hooked(_model())
    assert isinstance(hooked, HookedGPTModel)
    assert model_module.supports_output_processor(hooked)

    class NoHook(torch.nn.Module):
        post_process = True

        def forward(self, input_ids, position_ids, attention_mask, labels=None):
            raise AssertionError("not called")

    assert not model_module.supports_output_processor(NoHook())


def test_hook_path_receives_what_megatron_passes(monkeypatch):
    """Through the hook the processor is called with the output layer and, for tied models, the
    embedding's weight (untied: None), and it calls the head module."""
    seen = {}
    original = model_module.fused_output_processor

    def spy(**kwargs):
        seen.update(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(model_module, "fused_output_processor", spy)
    batch = _batch("packed", 5)
    for tied in (False, True):
        seen.clear()
        model = _model(tied=tied)
        head = install_fused_head(model)
        with forward_path(model, "hook"):
            gpt_log_probs_and_entropy(model, labels=batch.labels, temperature=1.1, **batch.model_inputs())
        assert seen["output_layer"] is head
        assert seen["labels"] is batch.labels
        assert seen["packed_seq_params"] is batch.packed_seq_params
        assert seen["context"].temperature == 1.1
        assert seen["hidden_states"].shape == (batch.labels.shape[1], 1, HIDDEN)
        expected_weight = model.embedding.word_embeddings.weight if tied else None
        assert seen["output_weight"] is expected_weight


def test_fallback_restores_post_process_after_an_error():
    model = _model()
    install_fused_head(model)
    batch = _batch("padded", 6)
    with forward_path(model, "fallback"), pytest.raises(Exception):  # noqa: B017 - any model error
        gpt_log_probs_and_entropy(model, batch.input_ids.float(), batch.position_ids, None, batch.labels)
    assert model.post_process is True
    with forward_path(model, "fallback"), pytest.raises(ValueError, match="labels"):
        gpt_log_probs_and_entropy(model, labels=batch.labels[:, :-1], **batch.model_inputs())
    assert model.post_process is True


def test_pipeline_stages_pass_hidden_states_through():
    """A non-last stage returns its hidden states untouched (and gets no head); the last stage fed
    those hidden states gives the full model's log-probs."""
    batch = _batch("padded", 7)
    full = _model()
    first = _model(post_process=False, layers=1)
    last = _model(pre_process=False, layers=1)
    source = full.state_dict()
    first_state = {k: v for k, v in source.items() if k.startswith(("embedding.", "decoder.layers.0."))}
    missing, unexpected = first.load_state_dict(first_state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    last_state = {
        k.replace("decoder.layers.1.", "decoder.layers.0."): v
        for k, v in source.items()
        if k.startswith(("decoder.layers.1.", "decoder.final_layernorm.", "output_layer."))
    }
    missing, unexpected = last.load_state_dict(last_state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected

    assert install_fused_head(first) is None
    assert not isinstance(getattr(first, "output_layer", None), mcore_ppo.VocabParallelFusedPPOHead)
    install_fused_head(full, temperature=TEMPERATURE)
    install_fused_head(last, temperature=TEMPERATURE)
    with torch.no_grad():
        expected_hidden = first(batch.input_ids, batch.position_ids, None)
        hidden = gpt_log_probs_and_entropy(first, labels=batch.labels, **batch.model_inputs())
        assert hidden.shape == (SEQ, 2, HIDDEN)
        torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
        ref_lp, ref_ent = gpt_log_probs_and_entropy(full, labels=batch.labels, **batch.model_inputs())
        last.set_input_tensor(hidden)
        lp, ent = gpt_log_probs_and_entropy(last, None, batch.position_ids, None, batch.labels)
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)


@pytest.mark.parametrize("precision", ["fp64-ddp", "bf16-float16module-ddp"])
def test_under_megatron_wrappers_grads_reach_main_grad(precision: str):
    """The head installed through Megatron's DistributedDataParallel (and Float16Module for bf16):
    DDP's gradient hooks move every parameter's gradient into ``main_grad`` as on the logits path.
    fp64: to 1e-9. bf16: the reference is the bf16 logits path itself, so a bf16-level normwise
    tolerance (measured 9e-3 at these seeds); this case checks the wiring through the wrappers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    bf16 = precision.startswith("bf16")
    batch = _batch("padded", 8)
    results = {}
    for mode in ("logits", "fallback", "hook"):
        model = build_gpt_model(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            params_dtype=torch.bfloat16 if bf16 else torch.float64,
            seed=9,
            transformer_layer_spec=local_gpt_spec(),
            device=DEVICE,
        )
        inner = Float16Module(model.config, model) if bf16 else model
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
        wrapped = DistributedDataParallel(model.config, ddp_config, inner)
        if mode == "logits":
            lp, ent = logits_log_probs_and_entropy(wrapped, labels=batch.labels, **batch.model_inputs())
        else:
            head = install_fused_head(wrapped, backend="torch")
            assert model.output_layer is head
            with forward_path(wrapped, mode):
                lp, ent = gpt_log_probs_and_entropy(wrapped, labels=batch.labels, **batch.model_inputs())
            assert lp.dtype == ent.dtype == (torch.float32 if bf16 else torch.float64)
        (lp.sum() + ent.sum()).backward()
        main_grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}
        assert all(p.grad is None for p in model.parameters())  # DDP's hooks took them
        results[mode] = (lp.detach().double(), ent.detach().double(), main_grads)

    ref_lp, ref_ent, ref_grads = results["logits"]
    for mode in ("fallback", "hook"):
        lp, ent, grads = results[mode]
        if not bf16:
            torch.testing.assert_close(lp, ref_lp, **TOL)
            torch.testing.assert_close(ent, ref_ent, **TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=f"{mode} {name}": f"{n}: {m}")
            continue
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-2)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-2)
        for name, grad in grads.items():
            ref = ref_grads[name].double()
            assert ref.norm() > 0, name
            error = ((grad.double() - ref).norm() / ref.norm()).item()
            assert error < 3e-2, f"{mode} {name}: normwise relative error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# build_gpt_model
# ---------------------------------------------------------------------------------------------


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = _model(), _model()
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert pa.dtype == torch.float64, name
    assert isinstance(a, GPTModel)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_rotary_model_head_matches_logits_path(kind: str, test_seed: int):
    """``position_embedding_type="rope"`` (as verl's Llama/Qwen models): positions from the
    sequence or the packed ``cu_seqlens``; the fused head equals the logits path there too."""
    model = build_gpt_model(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
        max_sequence_length=SEQ, params_dtype=torch.float64, seed=test_seed,
        transformer_layer_spec=local_gpt_spec(), device=DEVICE, position_embedding_type="rope",
    )  # fmt: skip
    assert model.position_embedding_type == "rope" and not hasattr(model.embedding, "position_embeddings")
    batch = _batch(kind, test_seed)
    ref_lp, ref_ent = logits_log_probs_and_entropy(
        model, labels=batch.labels, temperature=TEMPERATURE, **batch.model_inputs()
    )
    weighted_backward(ref_lp, ref_ent, torch.ones_like(ref_lp), torch.ones_like(ref_ent))
    ref_grads = pop_parameter_grads(model)
    install_fused_head(model, temperature=TEMPERATURE, backend="torch")
    lp, ent = gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    weighted_backward(lp, ent, torch.ones_like(lp), torch.ones_like(ent))
    for name, grad in pop_parameter_grads(model).items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("value", "error"), [("rotary", ValueError), ("mrope", ValueError), (None, TypeError)])
def test_build_rejects_bad_position_embedding_type(value, error):
    with pytest.raises(error, match="position_embedding_type"):
        build_gpt_model(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
            max_sequence_length=SEQ, position_embedding_type=value,
        )  # fmt: skip


def test_build_needs_parallel_state(monkeypatch):
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        _model()


# ---------------------------------------------------------------------------------------------
# CPU shims
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU shims refuse to install on a CUDA machine")
def test_cpu_shims_install_restore_and_nest():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    was_installed = shims_installed()
    uninstall_cpu_shims()
    try:
        original_device, original_fork = torch.cuda.current_device, CudaRNGStatesTracker.fork
        assert schedules.torch is torch
        install_cpu_shims()
        install_cpu_shims()  # idempotent
        assert torch.cuda.current_device() == torch.device("cpu")
        assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert schedules.torch.float32 is torch.float32
        uninstall_cpu_shims()
        assert torch.cuda.current_device is original_device and CudaRNGStatesTracker.fork is original_fork
        assert schedules.torch is torch
        with cpu_shims():
            with cpu_shims():
                pass
            assert shims_installed()  # the inner context does not undo the outer one
        assert not shims_installed()
    finally:
        if was_installed:
            install_cpu_shims()


def test_cpu_shims_refuse_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        install_cpu_shims()


def test_model_path_compiles_and_the_head_adds_no_graph_break(monkeypatch):
    """``gpt_log_probs_and_entropy`` on a model with the fused head under ``torch.compile``:
    every graph break is Megatron's own (its layers call ``warnings.warn``), as many as the
    model's logits path has, none raised in mcore_ppo's code (the head runs as its ops); the
    compiled step's outputs and gradients equal eager's. The step compiles through AOTAutograd
    (``aot_eager``): inductor's code generation for each of Megatron's graphs would take minutes
    here and tests nothing of the head's (inductor compiles the head itself in ``tests/ops``,
    ``tests/distributed`` and ``tests/gpu/test_gpu_ops.py``)."""
    if DEVICE.type == "cuda":
        # Megatron's RNG tracker sets the CUDA state through torch.cuda._lazy_call, whose
        # callback runs under a non-reentrant lock; dynamo compiles that callback after the
        # tracker's graph break and restores the RNG state through _lazy_call again: a deadlock
        # in torch <= 2.13 (pytorch/pytorch#182948), the head's or not. Kept out of the trace, as
        # a user compiling a Megatron model on CUDA does (docs/design.md §9).
        from megatron.core.tensor_parallel import random as mcore_random

        monkeypatch.setattr(
            mcore_random, "_set_cuda_rng_state", torch.compiler.disable(mcore_random._set_cuda_rng_state)
        )
    batch = _batch("padded", 5)
    model = _model()
    g_lp, g_ent = (torch.randn(batch.labels.shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                   .to(DEVICE) for s in (6, 7))  # fmt: skip

    def logits_step(labels, inputs):
        return logits_log_probs_and_entropy(model, labels=labels, temperature=TEMPERATURE, **inputs)

    logits_breaks = torch._dynamo.explain(logits_step)(batch.labels, batch.model_inputs()).graph_break_count
    install_fused_head(model, temperature=TEMPERATURE, backend="torch")

    def step(labels, inputs):
        return gpt_log_probs_and_entropy(model, labels=labels, **inputs)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(batch.labels, batch.model_inputs())
    for reason in explained.break_reasons:
        innermost = reason.user_stack[-1].filename if reason.user_stack else ""
        assert "mcore_ppo/" not in innermost.replace("\\", "/"), f"a graph break in mcore_ppo: {reason}"
    assert explained.graph_break_count <= logits_breaks, (explained.graph_break_count, logits_breaks)
    torch._dynamo.reset()
    results = []
    for run in (step, torch.compile(step, backend="aot_eager")):
        lp, ent = run(batch.labels, batch.model_inputs())
        weighted_backward(lp, ent, g_lp, g_ent)
        results.append((lp.detach(), ent.detach(), pop_parameter_grads(model)))
    (lp, ent, grads), (c_lp, c_ent, c_grads) = results
    torch.testing.assert_close(c_lp, lp, **TOL)
    torch.testing.assert_close(c_ent, ent, **TOL)
    assert grads.keys() == c_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are CUDA's (set_sync_debug_mode)")
def test_model_path_head_call_makes_no_host_sync():
    """The head's part of a model step on CUDA (the model runs once outside: Megatron's own
    layers are not the head's to vouch for): forward and backward of the fused head on the
    model's final hidden states, with the model path's options, under ``set_sync_debug_mode("error")``."""
    batch = _batch("padded", 8)
    model = _model()
    head = install_fused_head(model, temperature=TEMPERATURE)
    hidden = torch.randn(SEQ, batch.labels.shape[0], HIDDEN, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def head_step():
        lp, ent = head(hidden, batch.labels)
        (lp.sum() + ent.sum()).backward()

    head_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
