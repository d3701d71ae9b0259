"""verl's live Megatron path (``forward_step`` -> ``fused_forward_model_engine``) on CUDA with the
plugin's ``triton`` backend, one rank (NCCL), as verl runs it: the TP 1 comparison of
``tests/integrations/test_verl_live.py`` on the GPU, where megatron-core >= 0.18 takes verl's
``output_processor`` hook route, plus verl's own Triton kernel side by side.

- fp32 model (TF32 off): the plugin against the same verl code with an fp64 full-logits kernel
  bound in place of verl's kernel, and against verl's non-fused logits path: log-probs, entropy,
  every parameter's gradient; per-sample temperatures (which verl alone refuses on this path).
- bf16 model: the plugin against verl's own kernel (``use_fused_kernels=True`` without the plugin).
- MTP (``MCORE_PPO_VERL_MTP=1``, depth 2, ``enable_train`` on and off), fp32: the plugin's fused
  path against verl's logits path with MTP (outputs, MTP losses, gradients).

Skips without CUDA or without verl (``bash scripts/install.sh``).
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from mcore_ppo.integrations import verl as plugin
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.reference import normwise_relative_error
from mcore_ppo_testing.seeds import next_seed

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed"),
]

# verl's Triton kernel wants a hidden size that is a multiple of 128.
VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN = 1024, 128, 4, 2, 64
LENGTHS = (17, 40, 9, 31)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def verl_on_cuda():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_ppo_testing import verl_engine

    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    verl_engine.import_verl_engine()
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield verl_engine
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        plugin.uninstall()
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _model(dtype):
    return build_gpt_model(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=MAX_LEN,
        params_dtype=dtype,
        seed=next_seed(),
        transformer_layer_spec=local_gpt_spec(attention="sdpa"),
        device="cuda",
        position_embedding_type="rope",
    )


def _sequences():
    gen = torch.Generator().manual_seed(next_seed())
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _assert_same(mine, theirs, what, out_tol, grad_tol):
    worst = 0.0
    for name in ("log_probs", "entropy"):
        a, b = getattr(mine, name), getattr(theirs, name)
        torch.testing.assert_close(a, b, **out_tol, msg=lambda m, n=name: f"{what}: {n}: {m}")
    assert mine.grads.keys() == theirs.grads.keys()
    for name, grad in mine.grads.items():
        error = normwise_relative_error(grad.double(), theirs.grads[name].double())
        worst = max(worst, error)
        assert error <= grad_tol, f"{what}: {name}: normwise relative error {error:.2e} > {grad_tol}"
    print(f"{what}: max |log_prob diff| {(mine.log_probs - theirs.log_probs).abs().max():.2e}, worst grad {worst:.2e}")


def test_live_path_triton_fp32_equals_fp64_kernel_and_non_fused_path(verl_on_cuda):
    verl_engine = verl_on_cuda
    import verl.models.mcore.model_forward_fused as fused

    model, sequences, seed = _model(torch.float32), _sequences(), next_seed()
    for temperature in (0.7, [0.6, 1.0, 1.6, 0.9]):
        with verl_engine.plugin_on("triton"):
            mine = verl_engine.forward_backward(model, sequences, temperature, grad_seed=seed)
            print(f"verl fused route: {fused._get_fused_forward_mode(model)}")
        non_fused = verl_engine.forward_backward(model, sequences, temperature, use_fused_kernels=False, grad_seed=seed)
        # fp32 head vs fp64 / fp32 logits: rounding of fp32 sums over the vocabulary.
        _assert_same(mine, non_fused, f"T={temperature}: plugin vs non-fused", {"rtol": 1e-4, "atol": 1e-4}, 1e-4)
        if isinstance(temperature, float):
            with verl_engine.kernel_in_place_of_verls(verl_engine.fp64_kernel):
                fp64 = verl_engine.forward_backward(model, sequences, temperature, grad_seed=seed)
            _assert_same(mine, fp64, "plugin vs fp64 kernel", {"rtol": 1e-5, "atol": 1e-5}, 1e-5)


def test_live_path_triton_bf16_equals_verls_own_kernel(verl_on_cuda):
    verl_engine = verl_on_cuda
    model, sequences, seed = _model(torch.bfloat16), _sequences(), next_seed()
    verls = verl_engine.forward_backward(model, sequences, 0.8, grad_seed=seed)  # plugin off: verl's Triton kernel
    with verl_engine.plugin_on("triton"):
        mine = verl_engine.forward_backward(model, sequences, 0.8, grad_seed=seed)
    # Both fp32 results from the same bf16 hidden states; the gradients flow back through bf16 layers.
    _assert_same(mine, verls, "plugin vs verl's Triton kernel (bf16 model)", {"rtol": 2e-3, "atol": 2e-3}, 1e-2)


@pytest.mark.parametrize("train", [True, False], ids=["enable_train", "no-train"])
def test_live_path_with_mtp_triton_fp32_equals_verls_logits_path_with_mtp(verl_on_cuda, monkeypatch, train):
    """``MCORE_PPO_VERL_MTP=1``: verl's fused path kept on with MTP (depth 2) on the installed
    megatron-core's route (the ``output_processor`` hook through verl's MTP ``_postprocess`` on
    >= 0.18), against verl's logits path with MTP: outputs, the MTP losses verl logs, every
    gradient; the output layer is never called on the fused path (no logits)."""
    verl_engine = verl_on_cuda
    import verl.models.mcore.model_forward_fused as fused

    from mcore_ppo.integrations.verl.mtp import ENV_MTP

    monkeypatch.setenv(ENV_MTP, "1")
    try:
        model = build_gpt_model(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            vocab_size=VOCAB,
            max_sequence_length=MAX_LEN,
            params_dtype=torch.float32,
            seed=next_seed(),
            transformer_layer_spec=local_gpt_spec(attention="sdpa"),
            device="cuda",
            position_embedding_type="rope",
            mtp_block_spec=verl_engine.mtp_block_spec,
            mtp_num_layers=2,
            mtp_loss_scaling_factor=0.3,
        )
    except TypeError as err:
        if "isinstance() arg 2" not in str(err):
            raise
        pytest.skip(f"this megatron-core cannot build an MTP layer without TransformerEngine ({err})")
    sequences, seed = _sequences(), next_seed()
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in LENGTHS]
    run = dict(grad_seed=seed, mtp=True, mtp_train=train, loss_mask=masks)
    calls = []
    handle = model.output_layer.register_forward_hook(lambda *args: calls.append(1))
    theirs = verl_engine.forward_backward(model, sequences, [0.6, 1.0, 1.6, 0.9], use_fused_kernels=False, **run)
    assert len(calls) == 1 + (2 if train else 0)
    calls.clear()
    with verl_engine.plugin_on("triton"):
        mine = verl_engine.forward_backward(model, sequences, [0.6, 1.0, 1.6, 0.9], **run)
        print(f"verl fused route with MTP: {fused._get_fused_forward_mode(model)}; MTP losses {mine.mtp_losses}")
    handle.remove()
    assert not calls, "the fused path called the output layer (logits)"
    assert sorted(mine.mtp_losses) == sorted(theirs.mtp_losses) and len(theirs.mtp_losses) == (2 if train else 0)
    for key, value in theirs.mtp_losses.items():
        assert mine.mtp_losses[key] == pytest.approx(value, rel=1e-4), key
    _assert_same(mine, theirs, f"MTP train={train}: plugin vs verl's logits path", {"rtol": 1e-4, "atol": 1e-4}, 1e-4)


def test_live_path_triton_fp32_topk_distillation_and_sum_pi_squared_equal_verls_logits_path(verl_on_cuda):
    """Top-k distillation (k 16, ``log_prob_min_clamp=-5``, per-sample temperatures, a response
    mask with zeros) and Σπ² in the same micro-batch, on the installed megatron-core's route (the
    ``output_processor`` hook on >= 0.18) with the triton backend and ``fused_topk``'s kernels,
    against verl's logits path: every output, verl's distillation loss and metrics, every gradient
    (fp32 model, TF32 off). The student's top-k ids decide ``overlap_count``: a near-tie at the
    k-th value within fp32 rounding may pick another id, so those two outputs may differ on at
    most 2 % of the tokens."""
    from mcore_ppo_testing import verl_distill

    verl_engine = verl_on_cuda
    k, prompts = 16, [5, 12, 3, 10]
    model = _model(torch.float32)
    with torch.no_grad():
        model.output_layer.weight.mul_(25.0)  # the student's log-probs spread: the clamp cuts some
    seed = next_seed()
    sequences = _sequences()
    masks = [[int(j % 3 != 1) for j in range(n - p)] for n, p in zip(LENGTHS, prompts, strict=True)]
    batch = verl_distill.make_distill_batch(
        sequences, [0.6, 1.0, 1.6, 0.9], verl_distill.random_teacher(LENGTHS, VOCAB, k, seed), prompt_lengths=prompts,
        response_masks=masks, calculate_sum_pi_squared=True, device="cuda",
    )  # fmt: skip
    configs = verl_distill.distill_configs(k, -5.0, distillation_only=False)
    theirs = verl_distill.distill_step(model, batch, configs, use_fused_kernels=False, grad_seed=seed)
    with verl_engine.plugin_on("triton"):
        mine = verl_distill.distill_step(model, batch, configs, use_fused_kernels=True, grad_seed=seed)
    bad = []
    for d in verl_distill.compare_runs(mine, theirs, out_tol=1e-4, grad_tol=1e-4):
        print(f"top-k distillation + Σπ² (triton): {d.name}: max abs {d.max_abs:.2e}, max rel {d.max_rel:.2e} {d.note}")
        if d.ok:
            continue
        if d.name in ("overlap_count", "overlap_token_advantage", "metric distillation/overlap_ratio",
                      "metric distillation/overlap_token_advantage"):  # fmt: skip
            a, b = (run.outputs["overlap_count"].values() for run in (mine, theirs))
            if (a != b).float().mean().item() <= 0.02:
                continue
        bad.append(d)
    assert not bad, bad
