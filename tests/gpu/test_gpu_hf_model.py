"""A Hugging Face Qwen2 through the fused head on CUDA equals Hugging Face (marked ``gpu``).

``tests/megatron/test_hf_model.py`` on a GPU: the same random Qwen2 (tied and untied), packed
THD sequences of different lengths and a padded batch, the fused head's ``backend="triton"``
kernels in fp32, against ``log_softmax`` of Hugging Face's own fp32 logits on the same device,
within 1e-4 relative (log-probs and entropy). TF32 is off for the duration, so both sides do
fp32 matmuls (the head's kernels use IEEE fp32 dots for fp32 inputs anyway).

Two ways to the Megatron model:

- this repo's conversion (:func:`mcore_ppo_testing.hf_models.qwen2_gpt_model` +
  ``load_qwen2_weights``; local spec, no TransformerEngine needed);
- verl's vanilla-mbridge route (``AutoBridge.from_config`` + ``get_model`` + ``load_weights``
  from safetensors): with mbridge's TransformerEngine layers (skipped, with the reason, without
  ``mbridge`` or TransformerEngine), and with the local spec in their place (skipped without
  ``mbridge``; ``pip install --no-deps mbridge einops``).

A one-rank NCCL group (mbridge's ``load_weights`` scatters each tensor over the TP group, which
gloo cannot do for CUDA tensors).
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from mcore_ppo import gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo_testing import hf_models

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RTOL = 1e-4
LENGTHS = (37, 5, 90, 18)
SEED = 4321
TIES = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
KINDS = pytest.mark.parametrize("kind", ["packed", "padded"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_tp1_nccl():
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _hf(tied: bool):
    config = hf_models.small_qwen2_config(
        tie_word_embeddings=tied, vocab_size=1024, hidden_size=128, num_attention_heads=8, max_position_embeddings=128
    )
    return config, hf_models.random_qwen2_model(config, seed=SEED).to("cuda")


def _compare(gpt, hf, config, kind: str) -> None:
    batch = hf_models.comparison_batch(
        kind,
        vocab_size=config.vocab_size,
        lengths=LENGTHS,
        generator=torch.Generator().manual_seed(SEED + 1),
        device="cuda",
    )
    ref_lp, ref_ent = hf_models.hf_log_probs_and_entropy(hf, batch)
    install_fused_head(gpt, backend="triton")
    with torch.no_grad():
        lp, ent = gpt_log_probs_and_entropy(gpt, labels=batch.batch.labels, **batch.batch.model_inputs())
    assert lp.is_cuda and lp.dtype == torch.float32
    valid = batch.batch.labels != -100
    assert torch.all(lp[~valid] == 0) and torch.all(ent[~valid] == 0)
    lp_err = hf_models.max_relative_error(lp, ref_lp, valid)
    ent_err = hf_models.max_relative_error(ent, ref_ent, valid)
    print(f"{kind}: max relative error vs Hugging Face fp32: log-prob {lp_err:.3e}, entropy {ent_err:.3e}")
    assert lp_err <= RTOL
    assert ent_err <= RTOL


@KINDS
@TIES
def test_converted_qwen2_through_triton_head_equals_hugging_face(megatron_tp1_nccl, tied: bool, kind: str):
    config, hf = _hf(tied)
    gpt = hf_models.qwen2_gpt_model(config, params_dtype=torch.float32, device="cuda")
    hf_models.load_qwen2_weights(gpt, hf)
    _compare(gpt.eval(), hf, config, kind)


@pytest.mark.parametrize("layer_spec", ["transformer_engine", "local"])
@KINDS
@TIES
def test_mbridge_qwen2_through_triton_head_equals_hugging_face(
    megatron_tp1_nccl, tmp_path, tied: bool, kind: str, layer_spec: str
):
    needs = ("mbridge", "transformer_engine") if layer_spec == "transformer_engine" else ("mbridge",)
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"verl's mbridge route ({layer_spec} layers) needs {module}")
    config, hf = _hf(tied)
    gpt = hf_models.mbridge_gpt_model(hf, str(tmp_path), layer_spec=layer_spec)
    _compare(gpt, hf, config, kind)
