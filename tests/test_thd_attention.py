"""The SDPA THD core attention (benchmarks) equals the reference THD attention (tests), fp64, one rank.

Same GPT (same seed) with each core attention, on a packed THD batch of sequences of different
lengths (padded to an alignment, so padding segments are attended within their sequence):
logits and every parameter gradient agree to fp64 rounding. GQA (2 query groups) is covered.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_ppo.batching import pack_micro_batch
from mcore_ppo.model import build_gpt_model
from mcore_ppo_testing.ppo_harness import synthetic_rollout
from mcore_ppo_testing.thd_attention import thd_local_layer_spec

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
VOCAB = 64


# One-rank process group and Megatron parallel_state (TP 1) for every test here: tests/conftest.py.
pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _run(attention: str, batch, grad_out: torch.Tensor | None):
    model = build_gpt_model(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_sequence_length=64,
        params_dtype=torch.float64,
        seed=7,
        transformer_layer_spec=thd_local_layer_spec(attention=attention),
        device=DEVICE,
    )
    logits = model(batch.input_ids, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    if grad_out is None:
        grad_out = torch.randn_like(logits)
    logits.backward(grad_out)
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, grad_out


def test_sdpa_attention_matches_reference():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    torch.manual_seed(seed)
    rollout = synthetic_rollout(num_seqs=4, vocab_size=VOCAB, prompt_len=(1, 9), response_len=(2, 17), seed=seed)
    batch = pack_micro_batch(rollout, list(range(4)), align=4, device=DEVICE)
    ref_logits, ref_grads, grad_out = _run("reference", batch, None)
    logits, grads, _ = _run("sdpa", batch, grad_out)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="attention must be one of"):
        thd_local_layer_spec(attention="flash")
