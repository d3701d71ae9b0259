"""The NeMo-RL adapter under TP (SP on and off) and CP, padded and packed, against NeMo-RL's
logits-path contract computed on the whole sequence and vocab (``mcore_ppo_testing.nemo_rl_reference``).

Each rank gets what NeMo-RL's Megatron forward hands it: the hidden states of its CP part
(Megatron's load-balanced chunks of every sequence), sequence-sharded over TP under SP, its
vocab shard, and the *whole* unshifted target. Outputs must equal the reference on every rank.
Gradients follow NeMo-RL's CP convention (its ``AllGatherCPTensor`` sums the upstream gradients
over CP): this rank's ``d_hidden`` is ``cp ×`` the reference's at its positions, and ``d_W``
summed over CP is ``cp ×`` the reference's shard.

Then ``mcore_ppo.integrations.nemo_rl.enable()`` against NeMo-RL's real source (vendored,
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

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, fitting, model_parallel, require_ranks, shared_seed, tp_cp_groups
from head_cases import BACKEND

import mcore_ppo.integrations.nemo_rl as nemo_rl_switch
from mcore_ppo.integrations.nemo_rl import from_parallel_hidden_states_to_logprobs
from mcore_ppo.parallel import split_for_cp
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import pop_parameter_grads
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.nemo_rl_reference import logits_path_logprobs
from mcore_ppo_testing.real_nemo_rl import log_prob_pass, microbatch, train_pass, vendored_nemo_rl
from mcore_ppo_testing.reference import normwise_relative_error

VOCAB, H, TEMPERATURE = 64, 16, 0.8
# (tp, cp, sp); the last three need a world of 8.
LAYOUTS = (
    (2, 1, True), (2, 1, False), (1, 2, False), (2, 2, True), (4, 1, True), (8, 1, True), (4, 2, True), (2, 4, True),
)  # fmt: skip


def _cases():
    """(name, global hidden [S, b, h], target, cu_seqlens or None, unpacked_seqlen)."""
    gen = torch.Generator().manual_seed(shared_seed())
    padded = torch.randn(16, 2, H, dtype=torch.float64, generator=gen)
    padded_target = torch.randint(0, VOCAB, (2, 14), generator=gen)  # CP-padded by the model to 16
    packed = torch.randn(24, 1, H, dtype=torch.float64, generator=gen)
    packed_target = torch.randint(0, VOCAB, (1, 24), generator=gen)
    return [
        ("padded", padded, padded_target, None, None),
        ("packed", packed, packed_target, [0, 8, 16, 24], 12),
    ]


def test_nemo_rl_adapter_layouts(check):
    torch.manual_seed(shared_seed())
    weight = torch.randn(VOCAB, H, dtype=torch.float64)
    kind = "nemo_rl adapter vs logits path"
    for name, hidden, target, bounds, unpacked in _cases():
        ref_x, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kwargs = {} if bounds is None else {"cu_seqlens_padded": bounds, "unpacked_seqlen": unpacked}
        ref_lp, ref_ent = logits_path_logprobs(ref_x, ref_w, target, TEMPERATURE, **kwargs)
        g_lp, g_ent = torch.randn_like(ref_lp), torch.randn_like(ref_lp)
        ref_dx, ref_dw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (ref_x, ref_w))
        for tp, cp, sp in fitting(LAYOUTS, lambda lay: lay[0] * lay[1], lambda lay: f"TP{lay[0]}xCP{lay[1]}"):
            layout = tp_cp_groups(tp, cp)
            if layout.tp_group is None and layout.cp_group is None:
                continue
            check.case(f"{name} tp={tp} cp={cp} sp={sp}")
            local = split_for_cp(hidden, cp, layout.cp_rank, seq_dim=0, cu_seqlens=bounds)
            local_dx = split_for_cp(ref_dx, cp, layout.cp_rank, seq_dim=0, cu_seqlens=bounds)
            if sp:
                local, local_dx = local.chunk(tp)[layout.tp_rank], local_dx.chunk(tp)[layout.tp_rank]
            x = local.clone().to(DEVICE).requires_grad_()
            w = weight.chunk(tp)[layout.tp_rank].clone().to(DEVICE).requires_grad_()
            shard = VOCAB // tp
            extra = {}
            if bounds is not None:
                extra = {"cu_seqlens_padded": torch.tensor(bounds, device=DEVICE), "unpacked_seqlen": unpacked}
            lp, ent = from_parallel_hidden_states_to_logprobs(
                x, w, None, target.to(DEVICE), layout.tp_rank * shard, (layout.tp_rank + 1) * shard,
                layout.tp_group, cp_group=layout.cp_group, temperature=TEMPERATURE, sequence_parallel=sp,
                return_entropy=True, backend=BACKEND, **extra,
            )  # fmt: skip
            check.close("log_prob", lp, ref_lp, tol=1e-12, kind=kind)
            check.close("entropy", ent, ref_ent, tol=1e-12, kind=kind)
            ((lp * g_lp.to(DEVICE)).sum() + (ent * g_ent.to(DEVICE)).sum()).backward()
            check.close("d_hidden (x cp)", x.grad, cp * local_dx, tol=1e-12, kind=kind)
            dw = w.grad.clone()
            if layout.cp_group is not None:
                dist.all_reduce(dw, group=layout.cp_group)
            check.close("d_weight (sum over cp)", dw, cp * ref_dw.chunk(tp)[layout.tp_rank], tol=1e-12, kind=kind)
    check.done()


GPT_VOCAB, GPT_HIDDEN, GPT_HEADS, GPT_LAYERS, GPT_BATCH, GPT_SEQ = 96, 32, 4, 2, 2, 12
GPT_TEMPERATURE = 0.7
GPT_FP32 = {"rtol": 2e-6, "atol": 2e-6}  # NeMo-RL's logits path and the fused outputs are fp32


@pytest.fixture(scope="module")
def shims(gpt_cpu_shims):
    yield


def _step(nemo_rl, model, batch, weights, params, fused):
    log_probs = log_prob_pass(nemo_rl, model, batch, params, fused)
    train_log_probs = train_pass(nemo_rl, model, batch, params, fused, weights)
    return log_probs, train_log_probs, pop_parameter_grads(model)


@pytest.mark.usefixtures("shims")
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2sp"])
def test_enable_matches_nemo_rls_logits_path_tp2(sp):
    require_ranks(2, "TP 2")
    seed = shared_seed()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ), generator=gen).to(DEVICE)
    positions = torch.arange(GPT_SEQ).expand(GPT_BATCH, GPT_SEQ).contiguous().to(DEVICE)
    weights = torch.randn(GPT_BATCH, GPT_SEQ - 1, dtype=torch.float64, generator=gen).to(DEVICE)
    batch = microbatch(ids, positions)
    with model_parallel(2), vendored_nemo_rl() as nemo_rl:
        from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

        params = TrainingSamplingParams(temperature=GPT_TEMPERATURE)
        nemo_rl.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=5)
        model = build_gpt_model(
            num_layers=GPT_LAYERS, hidden_size=GPT_HIDDEN, num_attention_heads=GPT_HEADS, vocab_size=GPT_VOCAB,
            max_sequence_length=GPT_SEQ, sequence_parallel=sp, params_dtype=torch.float64, seed=seed,
            transformer_layer_spec=local_gpt_spec(attention="sdpa"), device=DEVICE, position_embedding_type="rope",
        )  # fmt: skip
        logits_path = _step(nemo_rl, model, batch, weights, params, fused=False)
        nemo_rl_switch.enable()
        try:
            mine = _step(nemo_rl, model, batch, weights, params, fused=True)
        finally:
            nemo_rl_switch.disable()
    assert logits_path[0].shape == mine[0].shape == (GPT_BATCH, GPT_SEQ)
    torch.testing.assert_close(mine[0], logits_path[0], **GPT_FP32)
    torch.testing.assert_close(mine[1], logits_path[1], **GPT_FP32)
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
