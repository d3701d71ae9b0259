"""``mcore_ppo.integrations.nemo_rl.enable()`` against NeMo-RL's real source (vendored,
``mcore_ppo_testing/vendor/nemo_rl``) at TP 2, sequence parallelism on and off.

NeMo-RL's own Megatron train loop (``train.megatron_forward_backward``) runs a small float64
GPT through NeMo-RL's patched ``GPTModel.forward`` on the same weights and batch: the log-prob
pass and a training step with the fused path switched to the head (:func:`enable`) equal
NeMo-RL's logits path (``from_parallel_logits_to_logprobs``), values on every rank and every
parameter's gradient shard, at T = 0.7. CP is not a layout NeMo-RL allows with its fused path
(``setup.py`` asserts it off). The 4-rank world runs TP 2 twice (data parallel 2).
One rank: ``tests/integrations/test_nemo_rl_real.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import DEVICE, megatron_timeout_minutes, require_ranks, shared_seed
from megatron.core import parallel_state

import mcore_ppo.integrations.nemo_rl as nemo_rl_switch
from mcore_ppo import build_gpt_model
from mcore_ppo_testing.gpt_reference import pop_parameter_grads
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.real_nemo_rl import log_prob_pass, microbatch, train_pass, vendored_nemo_rl
from mcore_ppo_testing.reference import normwise_relative_error

VOCAB, HIDDEN, HEADS, LAYERS, BATCH, SEQ = 96, 32, 4, 2, 2, 12
TEMPERATURE = 0.7
FP32 = {"rtol": 2e-6, "atol": 2e-6}  # NeMo-RL's logits path and the fused outputs are fp32


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    yield


@contextlib.contextmanager
def _tp2() -> Iterator[None]:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, create_gloo_process_groups=False,
        distributed_timeout_minutes=megatron_timeout_minutes(),
    )  # fmt: skip
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _step(nemo_rl, model, batch, weights, params, fused):
    log_probs = log_prob_pass(nemo_rl, model, batch, params, fused)
    train_log_probs = train_pass(nemo_rl, model, batch, params, fused, weights)
    return log_probs, train_log_probs, pop_parameter_grads(model)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2sp"])
def test_enable_matches_nemo_rls_logits_path_tp2(sp):
    require_ranks(2, "TP 2")
    seed = shared_seed()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous().to(DEVICE)
    weights = torch.randn(BATCH, SEQ - 1, dtype=torch.float64, generator=gen).to(DEVICE)
    batch = microbatch(ids, positions)
    with _tp2(), vendored_nemo_rl() as nemo_rl:
        from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

        params = TrainingSamplingParams(temperature=TEMPERATURE)
        nemo_rl.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=5)
        model = build_gpt_model(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
            max_sequence_length=SEQ, sequence_parallel=sp, params_dtype=torch.float64, seed=seed,
            transformer_layer_spec=local_gpt_spec(attention="sdpa"), device=DEVICE, position_embedding_type="rope",
        )  # fmt: skip
        logits_path = _step(nemo_rl, model, batch, weights, params, fused=False)
        nemo_rl_switch.enable()
        try:
            mine = _step(nemo_rl, model, batch, weights, params, fused=True)
        finally:
            nemo_rl_switch.disable()
    assert logits_path[0].shape == mine[0].shape == (BATCH, SEQ)
    torch.testing.assert_close(mine[0], logits_path[0], **FP32)
    torch.testing.assert_close(mine[1], logits_path[1], **FP32)
    assert mine[2].keys() == logits_path[2].keys()
    worst = 0.0
    for name, grad in mine[2].items():
        error = normwise_relative_error(grad, logits_path[2][name])
        worst = max(worst, error)
        assert error <= 1e-6, f"grad {name} (this rank's shard): normwise relative error {error:.2e}"
    print(
        f"sp={sp}: max |fused - logits path| {(mine[0] - logits_path[0]).abs().max():.2e}, "
        f"worst grad normwise {worst:.2e}"
    )
