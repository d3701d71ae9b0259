"""``mcore_ppo.integrations.nemo_rl.enable()`` against NeMo-RL's real source (vendored unmodified,
``mcore_ppo_testing/vendor/nemo_rl``), one rank.

NeMo-RL's own train loop (``train.megatron_forward_backward``: its ``forward_with_post_processing_fn``,
``model_forward``, temperature scaling, post-processors) runs a small Megatron GPT through NeMo-RL's
patched ``GPTModel.forward``, three ways on the same weights and batch:

- the logits path (``use_fused_linear_logprobs`` off): ``from_parallel_logits_to_logprobs``, NeMo-RL's reference;
- the fused path with :func:`enable`: must equal it, values and every parameter's gradient, at T = 1 and T ≠ 1;
- the fused path without it (NeMo-RL's own function): equals the logits path at T = 1 and is
  ``log p_1 / T`` at T ≠ 1 (train.py divides its log-probs by T), which shows the comparison at
  T ≠ 1 can fail.

The switch itself: the import hook, ``disable``, the ``.pth`` line in fresh interpreters.
TP 2 with and without SP: ``tests/distributed/test_nemo_rl_tp_cp.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mcore_ppo.integrations.nemo_rl as nemo_rl_switch
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import pop_parameter_grads
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.nemo_rl_reference import logits_path_logprobs
from mcore_ppo_testing.real_nemo_rl import log_prob_pass, microbatch, train_pass, vendored_nemo_rl
from mcore_ppo_testing.reference import normwise_relative_error

REPO = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, HEADS, LAYERS, BATCH, SEQ = 96, 32, 4, 2, 3, 12


@pytest.fixture
def nemo_rl(megatron_tp1):
    with vendored_nemo_rl() as modules:
        modules.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=5)
        try:
            yield modules
        finally:
            nemo_rl_switch.disable()


def _model(seed: int) -> torch.nn.Module:
    return build_gpt_model(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB, max_sequence_length=SEQ,
        params_dtype=torch.float64, seed=seed, transformer_layer_spec=local_gpt_spec(attention="sdpa"),
        position_embedding_type="rope",
    )  # fmt: skip


def _batch(seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ).contiguous()
    weights = torch.randn(BATCH, SEQ - 1, dtype=torch.float64, generator=gen).to(device)
    return microbatch(ids, positions), weights


def _step(nemo_rl, model, batch, weights, params, fused):
    log_probs = log_prob_pass(nemo_rl, model, batch, params, fused)
    train_log_probs = train_pass(nemo_rl, model, batch, params, fused, weights)
    return log_probs, train_log_probs, pop_parameter_grads(model)


def _bound(modules) -> str:
    """The module of the function NeMo-RL's patched forward will call."""
    return modules.model_utils.from_parallel_hidden_states_to_logprobs.__module__


def _assert_grads_equal(mine, theirs, tol):
    assert mine.keys() == theirs.keys()
    for name, grad in mine.items():
        error = normwise_relative_error(grad, theirs[name])
        assert error <= tol, f"grad {name}: normwise relative error {error:.2e} > {tol}"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_enable_matches_nemo_rls_logits_path(nemo_rl, test_seed, temperature):
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    model = _model(test_seed)
    # Megatron builds on the GPU where there is one (the CPU shims stand aside there).
    batch, weights = _batch(test_seed + 1, next(model.parameters()).device)
    params = TrainingSamplingParams(temperature=temperature)
    # fp64 reference on the decoder's output (NeMo-RL's logits path computes in fp32).
    captured = []
    hook = model.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    logits_path = _step(nemo_rl, model, batch, weights, params, fused=False)
    hook.remove()
    exact, _ = logits_path_logprobs(captured[0], model.output_layer.weight.detach(), batch.input_ids, temperature)

    nemo_rls_own = _step(nemo_rl, model, batch, weights, params, fused=True)
    nemo_rl_switch.enable()
    assert _bound(nemo_rl) == "mcore_ppo.integrations.nemo_rl.fused"
    mine = _step(nemo_rl, model, batch, weights, params, fused=True)

    fp32 = {"rtol": 2e-6, "atol": 2e-6}
    for passed in (mine[0][:, 1:], mine[1]):  # the log-prob pass (0 prepended) and the loss's input
        torch.testing.assert_close(passed.double(), exact, **fp32)
    torch.testing.assert_close(mine[0], logits_path[0], **fp32)
    torch.testing.assert_close(mine[1], logits_path[1], **fp32)
    _assert_grads_equal(mine[2], logits_path[2], 1e-6)
    print(f"T={temperature}: max |fused - logits path| {(mine[0] - logits_path[0]).abs().max():.2e}")

    if temperature == 1.0:
        torch.testing.assert_close(nemo_rls_own[0], logits_path[0], **fp32)
    else:
        # NeMo-RL's own fused path: train.py divides its log p_1 by T.
        p1 = logits_path_logprobs(captured[0], model.output_layer.weight.detach(), batch.input_ids)[0]
        torch.testing.assert_close(nemo_rls_own[1].double(), p1 / temperature, **fp32)
        assert (nemo_rls_own[1] - logits_path[1]).abs().max() > 1e-2


def test_import_hook_and_disable(megatron_tp1):
    nemo_rl_switch.enable()
    try:
        assert nemo_rl_switch.is_enabled()
        with vendored_nemo_rl() as modules:  # imported after enable(): rebound by the hook
            from mcore_ppo.integrations.nemo_rl import fused

            assert modules.model_utils.from_parallel_hidden_states_to_logprobs is fused.fused_hidden_states_to_logprobs
            step = modules.train.forward_with_post_processing_fn
            assert step.__wrapped__.__module__ == "nemo_rl.models.megatron.train"
            nemo_rl_switch.enable()  # idempotent: not wrapped twice
            assert modules.train.forward_with_post_processing_fn is step
            nemo_rl_switch.disable()
            assert _bound(modules) == "nemo_rl.distributed.model_utils"
            assert modules.train.forward_with_post_processing_fn is step.__wrapped__
        with vendored_nemo_rl() as modules:  # disabled: no hook
            assert _bound(modules) == "nemo_rl.distributed.model_utils"
    finally:
        nemo_rl_switch.disable()
    assert not nemo_rl_switch.is_enabled()


def test_fused_call_refuses_cp_and_unknown_layouts(nemo_rl):
    from mcore_ppo.integrations.nemo_rl.fused import fused_hidden_states_to_logprobs

    hidden, weight = torch.randn(6, 2, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="positions"):
        fused_hidden_states_to_logprobs(hidden, weight, None, torch.zeros(2, 5, dtype=torch.long), 0, 8, None)
    out = fused_hidden_states_to_logprobs(hidden, weight, None, torch.zeros(2, 6, dtype=torch.long), 0, 8, None)
    assert out.shape == (2, 5) and out.dtype == torch.float32


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import site
site.addsitedir(sys.argv[2])
import mcore_ppo.integrations.nemo_rl as m
print(json.dumps({"enabled": m.is_enabled(), "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("switch, enabled", [("1", True), ("", False), ("0", False)])
def test_pth_switch_in_a_fresh_interpreter(tmp_path, switch, enabled):
    path = nemo_rl_switch.install_pth(tmp_path)
    assert path.name == nemo_rl_switch.PTH_NAME and path.read_text() == nemo_rl_switch.pth_line()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PPO_NEMO_RL")}
    env[nemo_rl_switch.ENV_SWITCH] = switch
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(REPO), str(tmp_path)], env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    state = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert state["enabled"] is enabled
    if not enabled:
        assert not state["torch"], "the .pth line imported torch with the switch off"


def test_install_pth_refuses_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="existing folder"):
        nemo_rl_switch.install_pth(tmp_path / "missing")
