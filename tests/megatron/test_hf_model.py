"""A Hugging Face Qwen2 (a model nobody here wrote) through the fused head equals Hugging Face.

The model is a small random ``transformers.Qwen2ForCausalLM`` (grouped-query attention, q/k/v
biases, SwiGLU, RMSNorm, a non-default rotary base; tied and untied embeddings), converted to a
Megatron-Core ``GPTModel`` by :mod:`mcore_ppo_testing.hf_models` (the route and why: its
module doc). The fused head's per-token log-probs and entropy must equal ``log_softmax`` of
Hugging Face's own fp32 logits within 1e-4 relative, for packed THD sequences of different
lengths (verl's layout) and a right-padded batch:

- (a) through this repo's path, ``install_fused_head`` + ``gpt_log_probs_and_entropy``, with the
  torch and the triton backend (Triton's interpreter on CPU);
- (b) through verl's live fused path with the mcore_ppo plugin on
  (:mod:`mcore_ppo_testing.verl_engine`: verl's ``forward_step`` -> ``fused_forward_model_engine``,
  which packs the sequences into THD itself), log-probs and entropy.

The comparison is shown able to fail (a wrong rotary base, q/k/v not grouped, gate and up
swapped each miss by orders of magnitude), the conversion is strict, and where ``mbridge``
(the bridge verl uses) is installed its conversion, and the model its route builds and loads
(with the local spec in place of TransformerEngine's), must equal this one bitwise.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from mcore_ppo import gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo_testing import hf_models
from mcore_ppo_testing.reference import normwise_relative_error
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("megatron_tp1", "one_thread")

RTOL = 1e-4
LENGTHS = (9, 4, 13)  # packed: one THD row; padded: three rows padded to 13
TIES = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
KINDS = pytest.mark.parametrize("kind", ["packed", "padded"])
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _models(tied: bool, *, params_dtype: torch.dtype = torch.float32):
    config = hf_models.small_qwen2_config(tie_word_embeddings=tied)
    hf = hf_models.random_qwen2_model(config, seed=next_seed(), dtype=params_dtype).to(DEVICE)
    gpt = hf_models.qwen2_gpt_model(config, params_dtype=params_dtype, device=DEVICE)
    hf_models.load_qwen2_weights(gpt, hf)
    return config, hf, gpt.eval()


def _batch(config, kind: str) -> hf_models.ComparisonBatch:
    return hf_models.comparison_batch(
        kind, vocab_size=config.vocab_size, lengths=LENGTHS, generator=generator(next_seed()), device=DEVICE
    )


def _fused(gpt, batch: hf_models.ComparisonBatch, backend: str):
    install_fused_head(gpt, backend=backend)
    with torch.no_grad():
        return gpt_log_probs_and_entropy(gpt, labels=batch.batch.labels, **batch.batch.model_inputs())


def _errors(actual_lp, actual_ent, ref_lp, ref_ent, labels):
    valid = labels != -100
    assert torch.all(actual_lp[~valid] == 0) and torch.all(actual_ent[~valid] == 0)
    return (
        hf_models.max_relative_error(actual_lp, ref_lp, valid),
        hf_models.max_relative_error(actual_ent, ref_ent, valid),
    )


# ---------------------------------------------------------------------------------------------
# (a) this repo's path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@KINDS
@TIES
def test_fused_head_log_probs_and_entropy_equal_hugging_face(tied: bool, kind: str, backend: str):
    config, hf, gpt = _models(tied)
    batch = _batch(config, kind)
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
    lp, ent = _fused(gpt, batch, backend)
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == batch.batch.labels.shape
    lp_err, ent_err = _errors(lp, ent, ref_lp, ref_ent, batch.batch.labels)
    print(f"max relative error vs Hugging Face fp32: log-prob {lp_err:.3e}, entropy {ent_err:.3e}")
    assert lp_err <= RTOL
    assert ent_err <= RTOL


@KINDS
@TIES
def test_fused_head_gradients_equal_hugging_face(tied: bool, kind: str):
    """Every parameter's gradient of ``Σ g·log_prob + Σ e·entropy`` (random per-token ``g``,
    ``e``) through the fused head equals Hugging Face's own, mapped by the same conversion (it
    only reorders and concatenates, so it maps gradients as it maps weights; a tied model's
    embedding gradient is the sum of both uses on both sides), within 1e-4 normwise."""
    config, hf, gpt = _models(tied)
    batch = _batch(config, kind)
    gen = generator(next_seed())
    g_lp, g_ent = (torch.randn(batch.batch.labels.shape, generator=gen).to(DEVICE) for _ in range(2))
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch, grad=True)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    hf_grads = {name: param.grad for name, param in hf.named_parameters()}
    expected = hf_models.qwen2_to_megatron_state_dict(hf_grads, config)

    install_fused_head(gpt, backend="torch")
    lp, ent = gpt_log_probs_and_entropy(gpt, labels=batch.batch.labels, **batch.batch.model_inputs())
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    actual = {name: param.grad for name, param in gpt.named_parameters()}
    assert actual.keys() == expected.keys()
    errors = {name: normwise_relative_error(actual[name], expected[name]) for name in expected}
    worst = max(errors, key=errors.get)
    print(f"worst gradient: {worst} normwise relative error {errors[worst]:.3e}")
    assert errors[worst] <= RTOL


def test_fp64_conversion_is_exact_up_to_rotary_tables():
    """With float64 weights on both sides the two agree to the head's fp32 output rounding
    (~1e-7; both models also build their rotary cos/sin tables in fp32): what the fp32
    comparison leaves is rounding, not the mapping."""
    config, hf, gpt = _models(False, params_dtype=torch.float64)
    batch = _batch(config, "packed")
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
    lp, ent = _fused(gpt, batch, "torch")
    lp_err, ent_err = _errors(lp, ent, ref_lp, ref_ent, batch.batch.labels)
    print(f"fp64 max relative error: log-prob {lp_err:.3e}, entropy {ent_err:.3e}")
    assert lp_err <= 1e-6 and ent_err <= 1e-6


@pytest.mark.parametrize("mistake", ["rotary_base", "qkv_not_grouped", "gate_up_swapped"])
def test_comparison_detects_a_wrong_conversion(mistake: str):
    config, hf, gpt = _models(False)
    batch = _batch(config, "packed")
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
    if mistake == "rotary_base":
        wrong = copy.deepcopy(config)
        wrong.rope_parameters = {"rope_type": "default", "rope_theta": 100.0}
        gpt = hf_models.qwen2_gpt_model(wrong, device=DEVICE)
        hf_models.load_qwen2_weights(gpt, hf)
    else:
        state = gpt.state_dict()
        hf_state = hf.state_dict()
        with torch.no_grad():
            for i in range(config.num_hidden_layers):
                attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                prefix = f"decoder.layers.{i}."
                if mistake == "qkv_not_grouped":
                    for suffix in ("weight", "bias"):
                        state[prefix + f"self_attention.linear_qkv.{suffix}"].copy_(
                            torch.cat([hf_state[attn + f"{p}_proj.{suffix}"] for p in "qkv"])
                        )
                else:
                    state[prefix + "mlp.linear_fc1.weight"].copy_(
                        torch.cat([hf_state[mlp + "up_proj.weight"], hf_state[mlp + "gate_proj.weight"]])
                    )
    lp, ent = _fused(gpt.eval(), batch, "torch")
    lp_err, _ = _errors(lp, ent, ref_lp, ref_ent, batch.batch.labels)
    print(f"{mistake}: max relative error {lp_err:.3e}")
    assert lp_err > 100 * RTOL


# ---------------------------------------------------------------------------------------------
# The conversion itself
# ---------------------------------------------------------------------------------------------


def test_qkv_rows_are_grouped_per_query_group():
    """Row blocks of ``linear_qkv``: for each KV group, its query heads, its key head, its value head."""
    config = hf_models.small_qwen2_config()
    hf = hf_models.random_qwen2_model(config, seed=next_seed())
    state = hf_models.qwen2_to_megatron_state_dict(hf.state_dict(), config)
    d, groups = 16, config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    q = hf.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    k = hf.state_dict()["model.layers.1.self_attn.k_proj.weight"]
    v = hf.state_dict()["model.layers.1.self_attn.v_proj.weight"]
    qkv = state["decoder.layers.1.self_attention.linear_qkv.weight"]
    block = (per_group + 2) * d
    assert qkv.shape == (groups * block, config.hidden_size)
    for g in range(groups):
        rows = qkv[g * block : (g + 1) * block]
        assert torch.equal(rows[: per_group * d], q[g * per_group * d : (g + 1) * per_group * d])
        assert torch.equal(rows[per_group * d : (per_group + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(rows[(per_group + 1) * d :], v[g * d : (g + 1) * d])


@TIES
def test_conversion_is_strict(tied: bool):
    config = hf_models.small_qwen2_config(tie_word_embeddings=tied)
    hf_state = hf_models.random_qwen2_model(config, seed=next_seed()).state_dict()
    converted = hf_models.qwen2_to_megatron_state_dict(hf_state, config)
    assert ("output_layer.weight" in converted) is not tied
    with pytest.raises(KeyError, match="up_proj"):
        hf_models.qwen2_to_megatron_state_dict(
            {k: v for k, v in hf_state.items() if k != "model.layers.0.mlp.up_proj.weight"}, config
        )
    with pytest.raises(ValueError, match="q_norm"):
        hf_models.qwen2_to_megatron_state_dict(
            {**hf_state, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, config
        )
    if tied:
        with pytest.raises(ValueError, match=r"lm_head\.weight differs"):
            hf_models.qwen2_to_megatron_state_dict(
                {**hf_state, "lm_head.weight": hf_state["model.embed_tokens.weight"] + 1}, config
            )


def test_conversion_rejects_what_it_does_not_map():
    from transformers import LlamaConfig

    config = hf_models.small_qwen2_config()
    with pytest.raises(ValueError, match="qwen2"):
        hf_models.qwen2_gpt_model(LlamaConfig(), device=DEVICE)
    sliding = copy.deepcopy(config)
    sliding.use_sliding_window = True
    with pytest.raises(NotImplementedError, match="sliding"):
        hf_models.qwen2_gpt_model(sliding, device=DEVICE)
    scaled = copy.deepcopy(config)
    scaled.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="yarn"):
        hf_models.qwen2_gpt_model(scaled, device=DEVICE)
    gpt = hf_models.qwen2_gpt_model(config, device=DEVICE)
    other = hf_models.random_qwen2_model(hf_models.small_qwen2_config(intermediate_size=64), seed=next_seed())
    with pytest.raises(ValueError, match=r"linear_fc1\.weight: converted shape"):
        hf_models.load_qwen2_weights(gpt, other)


def test_rope_theta_from_either_transformers_layout():
    config = hf_models.small_qwen2_config(rope_theta=12345.0)
    assert hf_models.hf_rope_theta(config) == 12345.0
    assert hf_models.qwen2_gpt_model(config, device=DEVICE).rotary_base == 12345.0
    legacy = copy.deepcopy(config)
    legacy.rope_theta = 777.0  # transformers 4 keeps it on the config itself
    assert hf_models.hf_rope_theta(legacy) == 777.0


@TIES
def test_conversion_equals_mbridge(tied: bool):
    """mbridge's own Qwen2 conversion (verl's bridge) of every parameter equals this one bitwise."""
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install --no-deps mbridge einops)")
    config = hf_models.small_qwen2_config(tie_word_embeddings=tied)
    hf_state = hf_models.random_qwen2_model(config, seed=next_seed()).state_dict()
    ours = hf_models.qwen2_to_megatron_state_dict(hf_state, config)
    theirs = hf_models.mbridge_state_dict(hf_state, config, list(ours))
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


@TIES
def test_mbridge_route_loads_the_same_model(tied: bool, tmp_path):
    """verl's vanilla-mbridge route run as far as it runs without TransformerEngine: mbridge's
    config and model provider (the local spec in place of its TransformerEngine spec) and its
    ``load_weights`` from the Hugging Face model's safetensors give this conversion's state
    dict bitwise, and through the fused head Hugging Face's log-probs and entropy."""
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install --no-deps mbridge einops)")
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA mbridge's load_weights scatters over NCCL: tests/gpu/test_gpu_hf_model.py runs it there")
    config, hf, ours = _models(tied)
    gpt = hf_models.mbridge_gpt_model(hf, str(tmp_path), layer_spec="local")
    theirs, expected = gpt.state_dict(), ours.state_dict()
    assert theirs.keys() == expected.keys()
    for name, tensor in expected.items():
        if not name.endswith("_extra_state"):
            assert torch.equal(theirs[name], tensor), name
    assert gpt.rotary_base == ours.rotary_base == hf_models.hf_rope_theta(config)
    for kind in ("packed", "padded"):
        batch = _batch(config, kind)
        ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
        lp, ent = _fused(gpt, batch, "torch")
        lp_err, ent_err = _errors(lp, ent, ref_lp, ref_ent, batch.batch.labels)
        print(f"mbridge route, {kind}: max relative error log-prob {lp_err:.3e}, entropy {ent_err:.3e}")
        assert lp_err <= RTOL and ent_err <= RTOL


# ---------------------------------------------------------------------------------------------
# (b) verl's live fused path with the mcore_ppo plugin
# ---------------------------------------------------------------------------------------------

_VERL_ENGINE = importlib.util.find_spec("mcore_ppo_testing.verl_engine")


@pytest.mark.skipif(_VERL_ENGINE is None, reason="mcore_ppo_testing.verl_engine is not in this tree")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@TIES
def test_verl_fused_path_log_probs_and_entropy_equal_hugging_face(tied: bool, backend: str, monkeypatch):
    """verl's own ``forward_step`` -> ``fused_forward_model_engine`` (verl packs the sequences
    into THD itself) with the mcore_ppo plugin on: the plugin's kernel runs (counted), and the
    per-token log-probs and entropy equal Hugging Face's within 1e-4 relative."""
    from mcore_ppo.integrations.verl import kernel as plugin_kernel
    from mcore_ppo_testing import verl_engine

    calls = []
    original = plugin_kernel.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return original(*args, **kwargs)

    monkeypatch.setattr(plugin_kernel, "linear_cross_entropy", counted)
    config, hf, gpt = _models(tied)
    batch = _batch(config, "packed")
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
    sequences = [batch.batch.input_ids[row, start:end] for row, start, end in batch.segments]
    out = verl_engine.verl_log_probs(gpt, sequences, backend=backend)
    # The model's fp32 output weight is a framework's fp32 LM head: the plugin runs it on the
    # named backend built with precision="fp32_faithful" (MCORE_PPO_VERL_PRECISION unset).
    from mcore_ppo.backends import backend_precision
    from mcore_ppo.integrations.import_hook import precision_from_environment
    from mcore_ppo.integrations.verl import ENV_PRECISION

    assert [getattr(b, "name", b) for b in calls] == [backend]
    fp32 = next(gpt.parameters()).dtype == torch.float32
    expected = precision_from_environment(ENV_PRECISION) or ("fp32_faithful" if fp32 else "auto")
    assert (calls[0] if isinstance(calls[0], str) else backend_precision(calls[0])) in (
        (backend,) if expected == "auto" else (expected,)
    )
    lp_err = ent_err = 0.0
    for i, (row, start, end) in enumerate(batch.segments):
        valid = torch.ones(end - start - 1, dtype=torch.bool, device=DEVICE)
        lp_err = max(lp_err, hf_models.max_relative_error(out.log_probs[i], ref_lp[row, start : end - 1], valid))
        ent_err = max(ent_err, hf_models.max_relative_error(out.entropy[i], ref_ent[row, start : end - 1], valid))
    print(f"verl fused path: max relative error vs Hugging Face fp32: log-prob {lp_err:.3e}, entropy {ent_err:.3e}")
    assert lp_err <= RTOL
    assert ent_err <= RTOL
