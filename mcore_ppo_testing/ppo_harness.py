"""Helpers shared by the PPO demo (``scripts/ppo_step.py``) and the actor tests.

- :func:`init_distributed`: the process group of a torchrun script (NCCL on GPUs, gloo + CPU shims).
- :func:`init_layout`: Megatron ``parallel_state`` for a TP × CP × PP layout, with CP inside the
  model where TransformerEngine attention is installed and at the head otherwise.
- :func:`build_actor_model`: a small GPT with the fused head, on the layer spec that runs
  packed THD batches here (TransformerEngine's, else the THD reference attention).
- :func:`synthetic_rollout`: random prompts + responses of varied lengths, GRPO-style advantages.
- :func:`logits_path_outputs`: the *unfused* reference — the model's full logits gathered over
  TP, ``log_softmax`` in fp64 — for the rollout's response tokens.
- :func:`layout_independent_init`: the same global weights under every TP × PP layout.
- :func:`full_parameters`: every parameter with its TP shards gathered (layout-independent).

Not part of the library: the library never imports ``mcore_ppo_testing``.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mcore_ppo.actor import ActorParallel
from mcore_ppo.actor.batching import PackedRollout, pack_micro_batch
from mcore_ppo.model import gpt_log_probs_and_entropy, install_fused_head, unwrap_gpt_model
from mcore_ppo.parallel.groups import ProcessGroup, group_size
from mcore_ppo_testing.gpt_builder import build_gpt_model


def te_available() -> bool:
    """Whether TransformerEngine is importable (then ``GPTModel`` can run CP itself)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed() -> torch.device:
    """Initialise the default process group of a torchrun script and return this rank's device.

    CUDA: NCCL, one GPU per rank (``LOCAL_RANK``), Megatron unmodified. CPU: gloo, with
    :func:`mcore_ppo_testing.cpu_shims.install_cpu_shims`. Collectives time out after
    ``MCORE_PPO_DIST_TIMEOUT`` seconds (default 300), so a rank left behind cannot hang forever.
    """
    timeout = datetime.timedelta(seconds=int(os.environ.get("MCORE_PPO_DIST_TIMEOUT", "300")))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible: "
                "start at most one rank per GPU, or run on the CPUs (gloo) with CUDA_VISIBLE_DEVICES=''"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        from mcore_ppo_testing.cpu_shims import install_cpu_shims

        install_cpu_shims()
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


_CP_AT_HEAD_GROUPS: dict[tuple[int, int, int], dict[tuple, Any]] = {}


def init_layout(tp: int, cp: int = 1, pp: int = 1, *, cp_at_head: bool = False) -> ActorParallel:
    """Initialise Megatron's ``parallel_state`` for ``tp × cp × pp`` over the whole world.

    Args:
        tp, cp, pp: tensor-, context- and pipeline-parallel sizes; ``world / (tp·cp·pp)`` is the
            data-parallel size (data-parallel ranks may hold the same data: the actor's global
            counts make the result the same).
        cp_at_head: apply CP at the head only (the model sees whole sequences; see
            :meth:`ActorParallel.cp_at_head`). Default False: CP runs inside the model, which
            needs a CP-capable core attention (TransformerEngine's, or the harness's
            :class:`~mcore_ppo_testing.attention.SdpaAttention`: :func:`build_actor_model` picks it).

    Returns:
        The actor's groups. Call :func:`destroy_layout` when done.
    """
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} does not divide by tp*cp*pp = {tp * cp * pp}")
    if not cp_at_head or cp == 1:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
        return ActorParallel.from_parallel_state()
    # CP at the head: Megatron sees TP × DP' (DP' = cp · dp) and the actor carves CP out of DP'
    # with Megatron's rank order: rank = t + tp·(c + cp·d + DP'·s) for TP rank t, CP rank c,
    # DP rank d and pipeline stage s (TP fastest, then CP, then DP, then PP).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dpp = world // (tp * pp)
    dp = dpp // cp
    key = (tp, cp, pp)
    if key not in _CP_AT_HEAD_GROUPS:
        # Every rank creates every group, in the same order (dist.new_group's rule).
        groups: dict[tuple[int, ...], Any] = {}
        for s in range(pp):
            for t in range(tp):
                for d in range(dp):
                    ranks = tuple(t + tp * (c + cp * d + dpp * s) for c in range(cp))
                    groups[("cp", *ranks)] = dist.new_group(list(ranks))
                for c in range(cp):
                    ranks = tuple(t + tp * (c + cp * d + dpp * s) for d in range(dp))
                    groups[("dp", *ranks)] = dist.new_group(list(ranks))
        _CP_AT_HEAD_GROUPS[key] = groups
    me = dist.get_rank()
    groups = _CP_AT_HEAD_GROUPS[key]
    cp_group = next(g for k, g in groups.items() if k[0] == "cp" and me in k[1:])
    dp_group = next(g for k, g in groups.items() if k[0] == "dp" and me in k[1:])
    return ActorParallel.cp_at_head(cp_group=cp_group, dp_group=dp_group)


def destroy_layout() -> None:
    """Tear Megatron's ``parallel_state`` down (the groups of :func:`init_layout` are kept for reuse)."""
    parallel_state.destroy_model_parallel()


def layer_spec(attention: str = "reference") -> Any:
    """The spec that runs packed THD batches, SP and CP: TransformerEngine's, else Megatron's local
    spec with THD/CP core attention and SP-capable norms (``attention``: ``"reference"`` or
    ``"sdpa"``, see :func:`mcore_ppo_testing.layer_specs.local_gpt_spec`)."""
    if te_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    from mcore_ppo_testing.layer_specs import local_gpt_spec

    return local_gpt_spec(attention=attention)


def build_actor_model(
    model_cfg: dict[str, Any],
    *,
    sequence_parallel: bool,
    temperature: float = 1.0,
    backend: str = "auto",
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    packed_attention: bool = True,
    buffer_budget_bytes: int | str | None = None,
    attention: str | None = None,
) -> torch.nn.Module:
    """A ``GPTModel`` (on the current ``parallel_state``) with the fused head installed.

    ``packed_attention=False`` uses Megatron's own ``DotProductAttention`` (local spec, SP norms), which rejects
    ``PackedSeqParams``; the actor then feeds packed batches with a block-diagonal causal mask.
    ``attention`` picks the THD core attention without TransformerEngine (:func:`layer_spec`);
    None: ``"sdpa"`` when the model runs CP (the only one that can), else ``"reference"``.

    ``buffer_budget_bytes`` (not None) sizes the triton backend's probability buffer: the head
    gets a ``TritonBackend`` with it (:func:`head_backend`).

    ``model_cfg`` holds ``build_gpt_model``'s shape keywords (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, ``vocab_size``, ``max_sequence_length``, optional
    ``ffn_hidden_size`` and ``tie_embeddings``).
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if attention is None:
        attention = "sdpa" if parallel_state.get_context_parallel_world_size() > 1 else "reference"
    # Pipeline stages: the actor pads every micro-batch to one shape (fixed-shape p2p). On CPU
    # the p2p's post-batch `torch.cuda.synchronize()` is switched off (a config option, not a
    # shim; it guards an old PyTorch race on CUDA streams, and there are none on the CPU).
    overrides: dict[str, Any] = {"batch_p2p_sync": False} if pp > 1 and not torch.cuda.is_available() else {}
    model = build_gpt_model(
        **model_cfg,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        seed=seed,
        transformer_layer_spec=layer_spec(attention if packed_attention else "megatron"),
        **overrides,
    )
    install_fused_head(model, temperature=temperature, backend=head_backend(backend, buffer_budget_bytes))
    return model


def head_backend(backend: str, buffer_budget_bytes: int | str | None):
    """The head's ``backend`` for a config's ``(backend, buffer_budget_bytes)``: the name, or, when a
    budget is given and the name runs the triton kernels (``triton``; ``auto`` on CUDA), a
    ``TritonBackend`` that carries the budget (the knob is the backend's)."""
    if buffer_budget_bytes is None or not (backend == "triton" or (backend == "auto" and torch.cuda.is_available())):
        return backend
    from mcore_ppo.backends import TritonBackend, TritonConfig

    return TritonBackend(TritonConfig(buffer_budget_bytes=buffer_budget_bytes))


def synthetic_rollout(
    *,
    num_seqs: int,
    vocab_size: int,
    prompt_len: Sequence[int],
    response_len: Sequence[int],
    seed: int,
    device: torch.device | str | None = None,
) -> PackedRollout:
    """Random packed rollout: ``num_seqs`` prompts and responses of lengths drawn uniformly from
    the inclusive ``prompt_len`` / ``response_len`` ranges, one advantage per sequence
    (standardised over the batch, GRPO-style) on its response tokens; ``old_log_probs`` unset.
    Identical on every rank for the same ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens, masks, advantages, cu = [], [], [], [0]
    scores = torch.randn(num_seqs, generator=gen, dtype=torch.float64)
    scores = (scores - scores.mean()) / (scores.std() + 1e-6)
    for i in range(num_seqs):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=gen))
        tokens.append(torch.randint(0, vocab_size, (p + r,), generator=gen))
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        masks.append(mask)
        advantages.append(torch.where(mask, scores[i], 0.0).to(torch.float32))
        cu.append(cu[-1] + p + r)
    device = _device() if device is None else torch.device(device)
    return PackedRollout(
        tokens=torch.cat(tokens).to(device),
        cu_seqlens=torch.tensor(cu, device=device),
        response_mask=torch.cat(masks).to(device),
        advantages=torch.cat(advantages).to(device),
    )


def _all_gather_last_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def full_log_softmax(
    model: torch.nn.Module,
    rollout: PackedRollout,
    parallel: ActorParallel,
    *,
    temperature: float,
    align: int,
    packed_attention: bool = True,
) -> tuple[torch.Tensor, Any, int] | None:
    """fp64 ``log_softmax(logits / T)`` ``[1, t, V]`` of the whole rollout packed as one
    micro-batch, the model's vocab-parallel logits gathered over TP, with that micro-batch and
    the CP size the model ran; None off the last pipeline stage.

    Runs the model without labels (its output layer then returns the logits, as
    ``ColumnParallelLinear``) through Megatron's schedule, so pipeline stages pass activations on.
    """
    gpt = unwrap_gpt_model(model)
    model_cp = parallel.cp_size if parallel.model_runs_cp else 1
    mb = pack_micro_batch(
        rollout,
        list(range(rollout.num_seqs)),
        align=align,
        cp_size=model_cp,
        cp_rank=parallel.cp_rank if model_cp > 1 else 0,
        model_cp_size=model_cp,
        build_attention_mask=not packed_attention,
    )
    attention_mask = None if packed_attention else mb.attention_mask
    packed = mb.packed_seq_params if packed_attention else None

    def forward_step(data_iterator, model_chunk):
        next(data_iterator)
        out = gpt_log_probs_and_entropy(
            model_chunk, mb.input_ids, mb.position_ids, attention_mask, None, packed_seq_params=packed
        )
        return out, lambda logits: (torch.zeros((), device=logits.device), {"logits": logits})

    with torch.no_grad():
        was_training = model.training
        model.eval()
        try:
            store = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([mb]),
                model=model,
                num_microbatches=1,
                seq_length=parallel.schedule_seq_length(mb.input_ids.shape[1]),
                micro_batch_size=1,
                forward_only=True,
            )
        finally:
            model.train(was_training)
    if not gpt.post_process:
        return None
    logits = _all_gather_last_dim(store[0]["logits"], parallel.tp).to(torch.float64) / temperature  # [1, t, V]
    return torch.log_softmax(logits, dim=-1), mb, model_cp


def logits_path_outputs(
    model: torch.nn.Module,
    rollout: PackedRollout,
    parallel: ActorParallel,
    *,
    temperature: float,
    align: int,
    packed_attention: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The unfused reference: full logits (gathered over TP), fp64 ``log_softmax(logits / T)``
    (:func:`full_log_softmax`): the log-probability of each response token and the entropy.

    Returns ``(log_probs, entropy)`` fp64 ``[T]`` aligned with ``rollout.tokens`` (zero off the
    response) on the last pipeline stage; None on other stages.
    """
    full = full_log_softmax(
        model, rollout, parallel, temperature=temperature, align=align, packed_attention=packed_attention
    )
    if full is None:
        return None
    log_softmax, mb, model_cp = full
    safe = mb.labels.clamp(min=0)
    log_probs = log_softmax.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    total = rollout.tokens.shape[0]
    out = torch.zeros(2, total, dtype=torch.float64, device=log_softmax.device)
    index = mb.token_index.view(-1)
    keep = mb.loss_mask.view(-1)
    out[0, index[keep]] = log_probs.view(-1)[keep]
    out[1, index[keep]] = entropy.view(-1)[keep]
    if model_cp > 1:
        dist.all_reduce(out, group=parallel.cp)
    return out[0], out[1]


def _global_name(gpt: torch.nn.Module, name: str) -> str:
    """``name`` with a pipeline stage's local layer index replaced by the global one."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(gpt.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def layout_independent_init(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter from ``(seed, its global name)`` so that any TP × PP layout
    holds the same *global* weights (Megatron's own init depends on the pipeline split).

    Each global tensor is drawn whole (weights ``N(0, 0.05²)``, norm scales ``1 + N(0, 0.1²)``,
    biases ``N(0, 0.05²)``) and this rank keeps its TP shard: equal chunks along
    ``partition_dim``, as Megatron's CPU initialisation splits a master weight.
    """
    gpt = unwrap_gpt_model(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            gname = _global_name(gpt, name)
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(gname.encode())) % 2**62)
            shape = list(param.shape)
            sharded = tp > 1 and getattr(param, "tensor_model_parallel", False)
            if sharded:
                shape[param.partition_dim] *= tp
            values = torch.randn(shape, generator=gen, dtype=torch.float64)
            is_norm = "norm" in gname and gname.endswith("weight")
            values = 1.0 + 0.1 * values if is_norm else 0.05 * values
            if sharded:
                values = values.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(values.to(param.dtype))


def full_parameters(model: torch.nn.Module, tp_group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters, TP shards gathered along their partition dim (cloned),
    keyed by *global* name (layer indices counted over all stages), so layouts compare."""
    world = group_size(tp_group)
    gpt = unwrap_gpt_model(model)
    out = {}
    for name, param in gpt.named_parameters():
        value = param.detach()
        if world > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            value = torch.cat(parts, dim=param.partition_dim)
        out[_global_name(gpt, name)] = value.clone()
    return out
