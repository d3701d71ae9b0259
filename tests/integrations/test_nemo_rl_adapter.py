"""The NeMo-RL adapter on one rank, against NeMo-RL's logits-path contract
(``mcore_ppo_testing.nemo_rl_reference``). TP, SP and CP layouts:
``tests/distributed/test_nemo_rl_tp_cp.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mcore_ppo.integrations.nemo_rl import from_parallel_hidden_states_to_logprobs
from mcore_ppo_testing.nemo_rl_reference import logits_path_logprobs

VOCAB, H = 48, 12
TOL = {"rtol": 1e-10, "atol": 1e-12}


@dataclass
class TrainingSamplingParams:  # nemo_rl/algorithms/logits_sampling_utils.py
    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def _tensors(seed: int, tokens: int, batch: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, batch, H, dtype=torch.float64, generator=gen)
    weight = torch.randn(VOCAB, H, dtype=torch.float64, generator=gen)
    return hidden, weight, gen


def _nemo_rl_call(hidden, weight, target, **extra):
    """The call of NeMo-RL's patched GPT forward (_gpt_forward_with_linear_ce_fusion), positional as there."""
    return from_parallel_hidden_states_to_logprobs(
        hidden, weight, None, target, vocab_start_index=0, vocab_end_index=VOCAB, inference_only=False,
        tp_group=None, cp_group=None, chunk_size=128, **extra,
    )  # fmt: skip


def _check_against_reference(mine, hidden, weight, ref_inputs, ref_kwargs, temperature):
    (lp, ent), (x, w) = mine
    rx, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = logits_path_logprobs(rx, rw, *ref_inputs, temperature, **ref_kwargs)
    assert lp.shape == ref_lp.shape and ent.shape == ref_ent.shape
    torch.testing.assert_close(lp.double(), ref_lp, **TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **TOL)
    gen = torch.Generator().manual_seed(9)
    g_lp = torch.randn(ref_lp.shape, dtype=torch.float64, generator=gen)
    g_ent = torch.randn(ref_lp.shape, dtype=torch.float64, generator=gen)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ref_dx, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (rx, rw))
    torch.testing.assert_close(x.grad, ref_dx, **TOL)
    torch.testing.assert_close(w.grad, ref_dw, **TOL)


def test_padded_like_the_logits_path(test_seed):
    hidden, weight, gen = _tensors(test_seed, 10, 3)
    target = torch.randint(0, VOCAB, (3, 10), generator=gen)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    params = TrainingSamplingParams(temperature=0.7)
    out = _nemo_rl_call(x, w, target, sampling_params=params, return_entropy=True, backend="torch")
    assert out[0].shape == (3, 9)
    _check_against_reference((out, (x, w)), hidden, weight, (target,), {}, 0.7)


def test_packed_like_the_logits_path(test_seed):
    bounds = [0, 5, 12, 16]
    hidden, weight, gen = _tensors(test_seed, 16, 1)
    target = torch.randint(0, VOCAB, (1, 16), generator=gen)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = _nemo_rl_call(
        x, w, target, temperature=1.3, cu_seqlens_padded=torch.tensor(bounds, dtype=torch.int32), unpacked_seqlen=8,
        return_entropy=True, backend="torch",
    )  # fmt: skip
    assert out[0].shape == (3, 7)
    kwargs = {"cu_seqlens_padded": bounds, "unpacked_seqlen": 8}
    _check_against_reference((out, (x, w)), hidden, weight, (target,), kwargs, 1.3)


def test_log_probs_only_and_inference_only(test_seed):
    hidden, weight, gen = _tensors(test_seed, 6, 2)
    target = torch.randint(0, VOCAB, (2, 6), generator=gen)
    x = hidden.clone().requires_grad_()
    lp = _nemo_rl_call(x, weight, target, backend="torch")  # return_entropy=False: the head skips the entropy
    assert isinstance(lp, torch.Tensor) and lp.shape == (2, 5) and lp.requires_grad
    g = torch.randn(lp.shape, dtype=torch.float64, generator=gen)
    (lp * g).sum().backward()
    rx = hidden.clone().requires_grad_()
    (ref_dx,) = torch.autograd.grad((logits_path_logprobs(rx, weight, target)[0] * g).sum(), (rx,))
    torch.testing.assert_close(x.grad, ref_dx, **TOL)
    lp = from_parallel_hidden_states_to_logprobs(hidden, weight, None, target, 0, VOCAB, None, True)
    assert not lp.requires_grad
    torch.testing.assert_close(lp.double(), logits_path_logprobs(hidden.detach(), weight, target)[0], **TOL)


@pytest.mark.parametrize(
    "params, match",
    [
        (TrainingSamplingParams(top_k=50), "top-k/top-p"),
        (TrainingSamplingParams(top_p=0.9), "top-k/top-p"),
    ],
)
def test_refusals(params, match):
    hidden, weight, _ = _tensors(0, 4, 1)
    target = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        _nemo_rl_call(hidden, weight, target, sampling_params=params)
    with pytest.raises(ValueError, match="differs from sampling_params"):
        _nemo_rl_call(hidden, weight, target, sampling_params=TrainingSamplingParams(), temperature=0.5)
    with pytest.raises(ValueError, match="shard"):
        from_parallel_hidden_states_to_logprobs(hidden, weight, None, target, 0, VOCAB - 1, None)
    with pytest.raises(ValueError, match="target must be"):
        _nemo_rl_call(hidden, weight, torch.zeros(1, 5, dtype=torch.long))
    # No filtering asked (top_k None or <= 0, top_p 1): accepted.
    _nemo_rl_call(hidden, weight, target, sampling_params=TrainingSamplingParams(top_k=-1, temperature=0.9))


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"sampling_params": {"temperature": 0.5}}, TypeError, r"^sampling_params must be NeMo-RL's TrainingSampling"),
        ({"inference_only": "yes"}, TypeError, r"^inference_only must be a bool, got str"),
        ({"vocab_start_index": "0"}, TypeError, r"^vocab_start_index must be an int, got str"),
        ({"vocab_end_index": float(VOCAB)}, TypeError, r"^vocab_end_index must be an int, got float"),
        ({"unpacked_seqlen": 0}, ValueError, r"^unpacked_seqlen must be >= 1, got 0"),
        ({"unpacked_seqlen": 4.0}, TypeError, r"^unpacked_seqlen must be an int"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_by_name(overrides, error, match):
    """Each argument is checked for what it must be, naming it; a mapping in place of the
    sampling params would otherwise leave its temperature unread (T = 1, a plausible number)."""
    hidden, weight, _ = _tensors(0, 4, 1)
    args = {
        "tensor_parallel_hidden_states": hidden, "output_weight_layer": weight, "runtime_gather_output": None,
        "target": torch.zeros(1, 4, dtype=torch.long), "vocab_start_index": 0, "vocab_end_index": VOCAB,
        "tp_group": None,
    }  # fmt: skip
    if "unpacked_seqlen" in overrides:
        args["cu_seqlens_padded"] = torch.tensor([0, 4])
    with pytest.raises(error, match=match):
        from_parallel_hidden_states_to_logprobs(**{**args, **overrides})


@pytest.mark.parametrize("precision", ["fp32_faithful", "ieee"])
def test_precision_with_a_bf16_trunk_and_an_fp32_head(test_seed, precision):
    """NeMo-RL's fp32 LM head on a bf16 trunk: bf16 hidden states with an fp32 weight under a
    precision that allows it; the log-probs are those of the fp64 logits path of the same values."""
    hidden, weight, gen = _tensors(test_seed, 10, 2)
    target = torch.randint(0, VOCAB, (2, 10), generator=gen)
    x16, w32 = hidden.bfloat16(), weight.float()
    lp = _nemo_rl_call(x16, w32, target, temperature=0.9, backend="torch", precision=precision)
    ref, _ = logits_path_logprobs(x16.double(), w32.double(), target, 0.9)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="must match hidden dtype"):  # the default keeps one dtype
        _nemo_rl_call(x16, w32, target, backend="torch")


def test_bad_precision_variable_is_refused_naming_it(monkeypatch):
    from mcore_ppo.integrations import nemo_rl as nemo_rl_switch

    monkeypatch.setenv("MCORE_PPO_NEMO_RL_PRECISION", "double")
    with pytest.raises(ValueError, match="MCORE_PPO_NEMO_RL_PRECISION must be one of auto, fp32_faithful, ieee"):
        nemo_rl_switch.enable()
    assert not nemo_rl_switch.is_enabled()


def test_an_fp32_weight_takes_fp32_faithful_unless_the_variable_says_otherwise(monkeypatch):
    """The integrations' backend: an fp32 weight (the framework's fp32 LM head) with the
    precision variable unset runs ``fp32_faithful``; a 16-bit one, or the variable set, as said."""
    from mcore_ppo.backends import backend_precision
    from mcore_ppo.integrations.import_hook import head_backend_from_environment

    variables = ("MCORE_PPO_NEMO_RL_BACKEND", "MCORE_PPO_NEMO_RL_PRECISION")
    monkeypatch.delenv(variables[1], raising=False)
    monkeypatch.setenv(variables[0], "torch")
    assert backend_precision(head_backend_from_environment(*variables, torch.zeros(2, 2))) == "fp32_faithful"
    assert head_backend_from_environment(*variables, torch.zeros(2, 2, dtype=torch.bfloat16)) == "torch"
    monkeypatch.setenv(variables[1], "auto")
    assert head_backend_from_environment(*variables, torch.zeros(2, 2)) == "torch"
    monkeypatch.setenv(variables[1], "ieee")
    assert backend_precision(head_backend_from_environment(*variables, torch.zeros(2, 2))) == "ieee"
