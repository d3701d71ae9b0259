"""A Hugging Face Qwen2 model as a Megatron-Core ``GPTModel``, and Hugging Face's own log-probs.

The question these helpers answer: does a model nobody here wrote, converted the way verl
converts it, give through the fused head the per-token log-probs Hugging Face gives? verl
builds Megatron models from a Hugging Face config with ``mbridge``
(``AutoBridge.from_config(hf_config)``, ``bridge.get_model()``, ``bridge.load_weights(model,
path)``) or with ``megatron-bridge``. Neither runs on the CPU:

- ``megatron-bridge`` (0.3.1) requires ``transformer-engine[core_cu13,pytorch]``, ``mamba-ssm``
  and ``transformers<5`` (transformers 5 is installed);
- ``mbridge`` (0.15.1, pure Python) builds its models with
  ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (TransformerEngine
  layers, CUDA only), moves them with ``.cuda()``, and reads ``hf_config.rope_theta``, which
  transformers 5 moved into ``rope_parameters`` (verl sets the attribute back before building).

So on the CPU the model is built with this repository's local spec (``build_gpt_model`` +
:func:`mcore_ppo_testing.layer_specs.local_gpt_spec`) and the weights are converted by
:func:`qwen2_to_megatron_state_dict`, which produces what ``mbridge``'s Qwen2 bridge produces
(its ``_weight_to_mcore_format``), under the local spec's parameter names:

- ``linear_qkv`` rows are interleaved per query group: for each of the ``g`` KV heads, that
  group's ``n/g`` query heads, then its key head, then its value head (so a TP split along
  rows keeps whole groups); the Qwen2 q/k/v biases the same way;
- ``linear_fc1`` is ``[gate_proj; up_proj]`` (Megatron's gated unit: ``silu(first half) *
  second half``);
- RMSNorm weights as they are (the local spec's pre-attention and pre-MLP norms are separate
  modules: TransformerEngine's spec fuses them into ``linear_qkv``/``linear_fc1`` as
  ``layer_norm_weight``); rotary base from the config (``rope_parameters["rope_theta"]``).

:func:`mbridge_state_dict` runs ``mbridge``'s own conversion for a cross-check of that
mapping, and :func:`mbridge_gpt_model` runs verl's bridge route itself: with
``layer_spec="transformer_engine"`` exactly (CUDA and TransformerEngine), with
``layer_spec="local"`` the half that runs without TransformerEngine (mbridge's config, model
provider and ``load_weights`` from safetensors, the local spec in place of TransformerEngine's).
Both need ``pip install --no-deps mbridge einops`` (not installed in CI: the comparison itself
needs nothing beyond transformers).

Known quirk of mbridge 0.15.1, worked around in :func:`_mbridge`: a bridge for a tied config
writes ``output_layer -> embed_tokens`` into the class-level ``_DIRECT_MAPPING``, so a later
untied bridge in the same process would load ``lm_head`` from the embedding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import GPTBatch, synthetic_batch
from mcore_ppo_testing.layer_specs import local_gpt_spec

__all__ = [
    "ComparisonBatch",
    "comparison_batch",
    "hf_log_probs_and_entropy",
    "hf_rope_theta",
    "load_qwen2_weights",
    "max_relative_error",
    "mbridge_gpt_model",
    "mbridge_state_dict",
    "qwen2_gpt_model",
    "qwen2_to_megatron_state_dict",
    "random_qwen2_model",
    "small_qwen2_config",
]


def small_qwen2_config(
    *,
    tie_word_embeddings: bool = False,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 64,
    rope_theta: float = 50000.0,
    rms_norm_eps: float = 1e-6,
) -> Any:
    """A small ``transformers.Qwen2Config`` (grouped-query attention, qkv bias, SwiGLU, RMSNorm).

    The rotary base is not the library default (10000) so a converter that drops it fails.
    """
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        use_sliding_window=False,
    )


def random_qwen2_model(config: Any, *, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """``Qwen2ForCausalLM(config)`` with every parameter drawn from ``seed``, in eval mode.

    Hugging Face initialises norm weights to 1 and biases to 0, which would hide a converter
    that drops or misplaces them; here norms are ``1 + 0.1·N(0, 1)``, biases ``0.1·N(0, 1)``,
    and matrices ``N(0, 1)/sqrt(fan_in)`` (logits of order 1, a non-degenerate softmax).
    Eager attention: the plain softmax Hugging Face defines, no fused kernel's choices.
    """
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            else:
                value = noise / param.shape[-1] ** 0.5
            param.copy_(value.to(param.dtype))
    return model.eval()


def hf_rope_theta(config: Any) -> float:
    """The rotary base of a Hugging Face config: ``rope_theta`` (transformers 4) or
    ``rope_parameters["rope_theta"]`` (transformers 5)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        raise ValueError(f"{type(config).__name__} has neither rope_theta nor rope_parameters['rope_theta']")
    return float(theta)


def _check_qwen2(config: Any) -> None:
    if getattr(config, "model_type", None) != "qwen2":
        raise ValueError(
            f"config must be a Qwen2 config (model_type 'qwen2'), got {getattr(config, 'model_type', None)!r}"
        )
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention has no counterpart in the local spec")
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"only the default rotary embedding is mapped, got {rope.get('rope_type')!r}")
    if config.hidden_act != "silu":
        raise NotImplementedError(f"hidden_act must be 'silu' (SwiGLU), got {config.hidden_act!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qwen2_gpt_model(
    config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    attention: str = "reference",
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """A ``GPTModel`` shaped like the Qwen2 ``config`` (TP 1, local spec).

    The ``TransformerConfig`` fields are the ones ``mbridge``'s Qwen2 bridge sets
    (``LLMBridge._build_base_config`` + ``add_qkv_bias``): RMSNorm with the config's epsilon,
    SwiGLU, no linear biases except q/k/v, grouped-query attention, rotary positions with the
    config's base. Load weights with :func:`load_qwen2_weights`.

    Args:
        config: a ``transformers.Qwen2Config``.
        params_dtype: the Megatron parameters' dtype.
        attention: the local spec's core attention (:data:`mcore_ppo_testing.layer_specs.ATTENTIONS`).
        device: as for :func:`mcore_ppo_testing.gpt_builder.build_gpt_model`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    _check_qwen2(config)
    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise NotImplementedError("qwen2_gpt_model converts whole (TP 1) weights; tensor parallelism is not mapped")
    model = build_gpt_model(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=_head_dim(config),
        ffn_hidden_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        tie_embeddings=bool(config.tie_word_embeddings),
        params_dtype=params_dtype,
        transformer_layer_spec=local_gpt_spec(attention=attention),
        device=device,
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    # build_gpt_model has no rotary_base argument (GPTModel takes it as a constructor argument,
    # not a config field), so the rotary embedding GPTModel built with the default base is
    # rebuilt as GPTModel builds it, with the config's base. It holds no parameters or buffers:
    # the state dict is unchanged.
    model.rotary_pos_emb = RotaryEmbedding(
        kv_channels=model.config.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=model.config.rotary_interleaved,
        rotary_base=hf_rope_theta(config),
        use_cpu_initialization=model.config.use_cpu_initialization,
        cp_group=model.pg_collection.cp,
    )
    model.rotary_base = hf_rope_theta(config)
    return model


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Any) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows (weight ``[.., h]`` or bias ``[..]``): per query group, its
    query heads, then its key head, then its value head."""
    groups, head_dim = config.num_key_value_heads, _head_dim(config)
    tail = q.shape[1:]
    q = q.reshape(groups, (config.num_attention_heads // groups) * head_dim, *tail)
    k = k.reshape(groups, head_dim, *tail)
    v = v.reshape(groups, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def qwen2_to_megatron_state_dict(hf_state_dict: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen2 weights -> the local-spec ``GPTModel``'s state dict (TP 1).

    Raises:
        KeyError: a weight the conversion needs is missing.
        ValueError: a weight left over (a Hugging Face weight this mapping does not know).
    """
    _check_qwen2(config)
    src = dict(hf_state_dict)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"hf_state_dict has no {name!r}")
        used.add(name)
        return src[name]

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_hidden_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mc + "input_layernorm.weight"] = take(hf + "input_layernorm.weight")
        out[mc + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"), config
        )
        out[mc + "self_attention.linear_qkv.bias"] = _fuse_qkv(
            take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias"), config
        )
        out[mc + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        out[mc + "pre_mlp_layernorm.weight"] = take(hf + "post_attention_layernorm.weight")
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")], dim=0
        )
        out[mc + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if config.tie_word_embeddings:
        # Hugging Face's state dict may list the tied lm_head; it is the embedding itself.
        if "lm_head.weight" in src:
            if not torch.equal(src["lm_head.weight"], src["model.embed_tokens.weight"]):
                raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
            used.add("lm_head.weight")
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    left = sorted(set(src) - used)
    if left:
        raise ValueError(f"hf_state_dict has weights this Qwen2 mapping does not convert: {left}")
    return out


def load_qwen2_weights(model: torch.nn.Module, hf_model: Any) -> None:
    """Copy a ``Qwen2ForCausalLM``'s weights into a model from :func:`qwen2_gpt_model` (strict:
    every Megatron parameter is written, shapes must match, nothing is left over)."""
    converted = qwen2_to_megatron_state_dict(hf_model.state_dict(), hf_model.config)
    target = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, extra = sorted(set(target) - set(converted)), sorted(set(converted) - set(target))
    if missing or extra:
        raise ValueError(
            f"state dicts differ: Megatron keys not converted {missing}, converted keys not in Megatron {extra}"
        )
    with torch.no_grad():
        for name, tensor in target.items():
            value = converted[name]
            if value.shape != tensor.shape:
                raise ValueError(
                    f"{name}: converted shape {tuple(value.shape)} != Megatron shape {tuple(tensor.shape)}"
                )
            tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))


# TransformerEngine's spec fuses the pre-attention and pre-MLP norms into the next linear layer.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _mbridge(config: Any, dtype: torch.dtype) -> Any:
    """``mbridge.AutoBridge.from_config(config, dtype=dtype)`` without its class-level side effect.

    A tied config makes mbridge's constructor write ``output_layer -> embed_tokens`` into the
    class-level ``_DIRECT_MAPPING``, which every later (untied) bridge in the process would then
    read. The class mapping is restored and the instance keeps its own.
    """
    from mbridge import AutoBridge
    from mbridge.models.qwen2 import Qwen2Bridge

    class_mapping = dict(Qwen2Bridge._DIRECT_MAPPING)
    try:
        bridge = AutoBridge.from_config(config, dtype=dtype)
        bridge._DIRECT_MAPPING = dict(Qwen2Bridge._DIRECT_MAPPING)
    finally:
        Qwen2Bridge._DIRECT_MAPPING.clear()
        Qwen2Bridge._DIRECT_MAPPING.update(class_mapping)
    return bridge


def mbridge_gpt_model(hf_model: Any, weights_dir: str, *, layer_spec: str = "transformer_engine") -> torch.nn.Module:
    """verl's vanilla-mbridge route: the ``GPTModel`` ``mbridge`` builds for ``hf_model``'s config,
    with the weights ``mbridge`` loads from ``hf_model`` saved as safetensors in ``weights_dir``.

    As verl's Megatron engine does it: ``rope_theta`` set on the config from
    ``rope_parameters`` (transformers 5; verl's ``make_megatron_module``),
    ``AutoBridge.from_config(config, dtype=...)``, the model from the bridge, and
    ``bridge.load_weights(models, path)`` (reads the safetensors, converts, scatters over TP).

    Args:
        hf_model: the Hugging Face model (its dtype is the Megatron parameters' dtype).
        weights_dir: an empty folder for the safetensors.
        layer_spec: ``"transformer_engine"``: ``bridge.get_model(...)`` exactly (mbridge's
            TransformerEngine spec, moved to CUDA; here without DDP or ``Float16Module``, so the
            parameters keep the Hugging Face dtype): needs TransformerEngine and CUDA.
            ``"local"``: the runnable half without TransformerEngine: mbridge's config and
            model provider with :func:`~mcore_ppo_testing.layer_specs.local_gpt_spec` in place of
            its TransformerEngine spec, its fusions off (they need CUDA kernels), on the current
            device; its ``load_weights`` unchanged except that the local spec's two norm names
            are looked up under TransformerEngine's names.
    """
    from megatron.core import tensor_parallel

    if layer_spec not in ("transformer_engine", "local"):
        raise ValueError(f"layer_spec must be 'transformer_engine' or 'local', got {layer_spec!r}")
    config = copy.deepcopy(hf_model.config)
    config.rope_theta = hf_rope_theta(config)
    hf_model.save_pretrained(weights_dir, safe_serialization=True)
    if torch.cuda.is_available() and not tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bridge = _mbridge(config, hf_model.dtype)
    if layer_spec == "transformer_engine":
        models = bridge.get_model(wrap_with_ddp=False, bf16=False, fp16=False)
    else:
        bridge.set_extra_args(
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=True,
        )
        block_spec = local_gpt_spec()
        bridge._get_transformer_layer_spec = lambda vp_stage=None: block_spec(bridge.config)
        te_mapping = bridge._weight_name_mapping_mcore_to_hf
        bridge._weight_name_mapping_mcore_to_hf = lambda name: te_mapping(te_norm_name(name))
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        models = [bridge._model_provider([])(pre_process=True, post_process=True).to(device)]
    bridge.load_weights(models, weights_dir)
    if len(models) != 1:
        raise RuntimeError(f"expected one model chunk (no virtual pipeline), got {len(models)}")
    return models[0].eval()


def te_norm_name(name: str) -> str:
    """A local-spec parameter name with its norm named as TransformerEngine's spec names it
    (mbridge's mappings know only those); every other name as it is."""
    for local, te in _TE_NORM_NAMES.items():
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def mbridge_state_dict(
    hf_state_dict: dict[str, torch.Tensor], config: Any, names: list[str]
) -> dict[str, torch.Tensor]:
    """``mbridge``'s own Hugging Face -> Megatron conversion of the local-spec parameters ``names``.

    Uses the bridge verl uses (``mbridge.AutoBridge.from_config``) for its name mapping
    (``_weight_name_mapping_mcore_to_hf``) and tensor conversion (``_weight_to_mcore_format``),
    the two steps of its ``load_weights`` between reading safetensors and the TP scatter. The
    local spec's norm names are translated to TransformerEngine's for the lookup. Needs
    ``mbridge`` and Megatron's ``parallel_state`` (TP 1).
    """
    bridge = _mbridge(config, next(iter(hf_state_dict.values())).dtype)
    out = {}
    for name in names:
        lookup = te_norm_name(name)
        hf_names = bridge._weight_name_mapping_mcore_to_hf(lookup)
        out[name] = bridge._weight_to_mcore_format(lookup, [hf_state_dict[n] for n in hf_names])
    return out


@dataclass
class ComparisonBatch:
    """A Megatron batch and where each of its sequences lies, for Hugging Face to run one by one.

    Attributes:
        batch: the Megatron inputs and next-token labels (padded ``[b, s]`` or packed THD ``[1, t]``).
        segments: ``(row, start, end)`` of every sequence in ``batch.input_ids``.
    """

    batch: GPTBatch
    segments: list[tuple[int, int, int]]


def comparison_batch(
    kind: str,
    *,
    vocab_size: int,
    lengths: tuple[int, ...],
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    pad_id: int = 0,
    ignore_index: int = -100,
) -> ComparisonBatch:
    """Sequences of the given ``lengths`` as verl feeds Megatron: ``"packed"`` THD (``[1, sum]``,
    ``PackedSeqParams``, positions restarting per sequence; verl's default, padding removed) or
    ``"padded"`` (``[len(lengths), max]``, right-padded with ``pad_id``, causal attention; the
    padding's labels ignored). Every label is the next token within its sequence; each
    sequence's last token is ignored."""
    if kind == "packed":
        batch = synthetic_batch(
            "packed",
            vocab_size=vocab_size,
            seq_lengths=tuple(lengths),
            prompt_length=0,
            ignore_index=ignore_index,
            device=device,
            generator=generator,
        )
        bounds = batch.cu_seqlens
        return ComparisonBatch(batch, [(0, bounds[i], bounds[i + 1]) for i in range(len(lengths))])
    if kind != "padded":
        raise ValueError(f"kind must be 'padded' or 'packed', got {kind!r}")
    width = max(lengths)
    ids = torch.randint(0, vocab_size, (len(lengths), width), generator=generator)
    labels = torch.full_like(ids, ignore_index)
    for row, length in enumerate(lengths):
        ids[row, length:] = pad_id
        labels[row, : length - 1] = ids[row, 1:length]
    positions = torch.arange(width).expand(len(lengths), width).contiguous()
    batch = GPTBatch(ids.to(device), positions.to(device), labels.to(device))
    return ComparisonBatch(batch, [(row, 0, length) for row, length in enumerate(lengths)])


def hf_log_probs_and_entropy(
    hf_model: Any, batch: ComparisonBatch, *, ignore_index: int = -100, grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's per-token ``(log_probs, entropy)``, shaped like ``batch.batch.labels``.

    Each sequence runs alone through the Hugging Face model (no padding, no packing: its own
    forward as it defines it); the result is ``log_softmax`` of its logits (in their dtype)
    picked at the next-token label, and that distribution's entropy; 0 where the label is
    ``ignore_index`` and on padding. ``grad``: keep the autograd graph (for a backward into
    the Hugging Face parameters).
    """
    labels = batch.batch.labels
    log_probs = torch.zeros(labels.shape, dtype=hf_model.dtype, device=labels.device)
    entropy = torch.zeros_like(log_probs)
    with torch.set_grad_enabled(grad):
        for row, start, end in batch.segments:
            logits = hf_model(input_ids=batch.batch.input_ids[row : row + 1, start:end]).logits[0]
            log_softmax = torch.log_softmax(logits, dim=-1)
            seg_labels = labels[row, start:end]
            valid = seg_labels != ignore_index
            picked = log_softmax.gather(-1, torch.where(valid, seg_labels, 0).long().unsqueeze(-1)).squeeze(-1)
            ent = -(log_softmax.exp() * log_softmax).sum(-1)
            log_probs[row, start:end] = torch.where(valid, picked, 0.0)
            entropy[row, start:end] = torch.where(valid, ent, 0.0)
    return log_probs, entropy


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor) -> float:
    """``max |actual - expected| / |expected|`` over the ``valid`` tokens (in float64)."""
    if actual.shape != expected.shape or valid.shape != expected.shape:
        raise ValueError(
            f"shapes differ: actual {tuple(actual.shape)}, expected {tuple(expected.shape)}, valid {tuple(valid.shape)}"
        )
    a, e = actual.double()[valid], expected.double().to(actual.device)[valid]
    if a.numel() == 0:
        raise ValueError("no valid token to compare")
    return ((a - e).abs() / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max().item()
