"""The harness's core attentions and SP norm, one rank (CP > 1: tests/distributed/test_model_cp.py).

- ``SdpaAttention`` equals the reference THD attention (Megatron's unfused softmax over a packed
  causal mask) inside a whole GPT, fp64: logits and every parameter gradient, packed THD with
  GQA, and padded ``[s, b]`` batches.
- The CP segment plan: every local query chunk attends to exactly the keys of its sequence up to
  its own global position, found at the right rows of the CP-gathered keys.
- ``SequenceParallelTorchNorm`` marks its parameters for Megatron's SP gradient all-reduce and
  builds in the config's dtype.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from mcore_ppo.actor.batching import pack_micro_batch
from mcore_ppo.parallel.context_parallel import cp_token_index
from mcore_ppo_testing.attention import _plan
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec, local_layer_spec
from mcore_ppo_testing.norms import SequenceParallelTorchNorm
from mcore_ppo_testing.ppo_harness import synthetic_rollout

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
VOCAB = 64

# One-rank process group and Megatron parallel_state (TP 1) for every test here: tests/conftest.py.
pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _run(attention: str, inputs: dict, grad_out: torch.Tensor | None):
    model = build_gpt_model(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_sequence_length=64,
        params_dtype=torch.float64,
        seed=7,
        transformer_layer_spec=local_gpt_spec(attention=attention),
        device=DEVICE,
    )
    logits = model(**inputs)
    if grad_out is None:
        grad_out = torch.randn_like(logits)
    logits.backward(grad_out)
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, grad_out


def _assert_same_model_outputs(inputs: dict) -> None:
    ref_logits, ref_grads, grad_out = _run("reference", inputs, None)
    logits, grads, _ = _run("sdpa", inputs, grad_out)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)


def test_sdpa_attention_matches_reference_packed(test_seed):
    rollout = synthetic_rollout(num_seqs=4, vocab_size=VOCAB, prompt_len=(1, 9), response_len=(2, 17), seed=test_seed)
    batch = pack_micro_batch(rollout, list(range(4)), align=4, device=DEVICE)
    _assert_same_model_outputs(
        {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            "attention_mask": None,
            "packed_seq_params": batch.packed_seq_params,
        }
    )


def test_sdpa_attention_matches_reference_padded(test_seed):
    generator = torch.Generator().manual_seed(test_seed)
    ids = torch.randint(0, VOCAB, (3, 12), generator=generator).to(DEVICE)
    positions = torch.arange(12, device=DEVICE).expand(3, 12).contiguous()
    _assert_same_model_outputs({"input_ids": ids, "position_ids": positions, "attention_mask": None})


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        local_gpt_spec(attention="flash")


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_cp_plan_attends_to_the_causal_prefix(cp_size):
    # Sequences of different lengths (one empty), each a multiple of 2·cp.
    lengths = [4 * cp_size, 0, 2 * cp_size, 6 * cp_size]
    bounds = tuple(itertools.accumulate([0, *lengths]))
    gathered = [p for rank in range(cp_size) for p in cp_token_index(bounds, cp_size, rank)]
    for rank in range(cp_size):
        local = cp_token_index(bounds, cp_size, rank)
        plan = _plan(bounds, cp_size, rank)
        assert plan.q_cu[-1] == len(local)
        for (qa, qb), (ka, kb) in zip(itertools.pairwise(plan.q_cu), itertools.pairwise(plan.k_cu), strict=True):
            queries = local[qa:qb]
            keys = list(range(ka, kb)) if plan.key_rows is None else [gathered[r] for r in plan.key_rows[ka:kb]]
            if plan.key_rows is None:
                keys = [local[r] for r in keys]
            start = max(b for b in bounds if b <= queries[0])
            # Bottom-right causal: the last query sees every key; keys are its sequence's prefix.
            assert keys == list(range(start, queries[-1] + 1))
            assert queries == list(range(queries[-1] - len(queries) + 1, queries[-1] + 1))


def _norm_config(**overrides):
    base = {
        "layernorm_zero_centered_gamma": False,
        "memory_efficient_layer_norm": False,
        "normalization": "LayerNorm",
        "params_dtype": torch.float64,
        "sequence_parallel": True,
    }
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_sequence_parallel_norm_marks_its_parameters(normalization, sequence_parallel):
    config = _norm_config(normalization=normalization, sequence_parallel=sequence_parallel)
    norm = SequenceParallelTorchNorm(config, 16, eps=1e-6)
    assert isinstance(norm, torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm)
    params = list(norm.parameters())
    assert params and all(p.dtype == torch.float64 for p in params)
    assert all(p.sequence_parallel is sequence_parallel for p in params)
    assert norm.eps == 1e-6


def test_sequence_parallel_norm_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="normalization"):
        SequenceParallelTorchNorm(_norm_config(normalization="L2Norm"), 16)
    with pytest.raises(NotImplementedError, match="zero-centred"):
        SequenceParallelTorchNorm(_norm_config(layernorm_zero_centered_gamma=True), 16)


def test_layer_spec_uses_the_sp_norms():
    spec = local_layer_spec(attention="sdpa")
    assert spec.submodules.input_layernorm is SequenceParallelTorchNorm
    assert spec.submodules.pre_mlp_layernorm is SequenceParallelTorchNorm
