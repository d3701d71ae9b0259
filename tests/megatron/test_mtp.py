"""Multi-token prediction (MTP) with the fused head (TP 1; CPU with the shims, or CUDA).

Megatron (>= 0.18) runs the MTP loss (``process_mtp_loss``) before the ``output_processor``, with
the labels and loss mask the model was called with; its vocab-parallel cross entropy has no
ignore index. The reference is Megatron's own forward with labels: its language-model loss and
its MTP losses, with the ignored tokens given label 0 and loss mask 0. The fused path must give
the same gradient for every parameter (the MTP layers' ones come only from the MTP loss) when
called with labels of -100, and ``log_prob = -loss`` where tokens count, with Σπ² on (the
head's option, or the call's switch): the main tokens' Σπ² comes back third, equal to fp64
from the hidden states the processor got.

On megatron-core < 0.18 the hook path is emulated (``mcore_ppo_testing.hooked_gpt``, with its
``process_mtp_loss``); the fallback path refuses MTP.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from mcore_ppo import gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import pop_parameter_grads, synthetic_batch
from mcore_ppo_testing.hooked_gpt import forward_path
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.megatron_tracker import clear_mtp_tracker
from mcore_ppo_testing.reference import sum_pi_squared_reference

VOCAB, HIDDEN, HEADS, SEQ, DEPTHS = 64, 16, 2, 12, 2
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# Megatron's vocab-parallel cross entropy (the reference, and the MTP depths' loss on the logits
# route) casts the logits to fp32 (tensor_parallel/cross_entropy.py): fp32 rounding, not fp64.
TOL = {"rtol": 1e-5, "atol": 1e-7}

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _mtp_model(tied: bool):
    try:
        return _build_mtp_model(tied)
    except TypeError as err:
        if "isinstance() arg 2" not in str(err):
            raise
        import megatron.core

        pytest.skip(
            f"megatron-core {megatron.core.__version__} cannot build an MTP layer without TransformerEngine: "
            f"its is_inference_column_parallel_linear checks isinstance against TE placeholders ({err})"
        )


def _build_mtp_model(tied: bool):
    return build_gpt_model(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        tie_embeddings=tied,
        params_dtype=torch.float64,
        seed=77,
        transformer_layer_spec=local_gpt_spec(),
        mtp_block_spec=lambda config, spec: get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=0.3,
        device=DEVICE,
    )


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return synthetic_batch("padded", vocab_size=VOCAB, seq_length=SEQ, generator=generator, device=DEVICE)


def _reference(model, batch, grad_log_prob):
    """Megatron's own forward with labels: loss [b, s] (-log p at T = 1), MTP losses attached."""
    ignored = batch.labels == -100
    keep = (~ignored).to(torch.float64)
    loss = model(batch.input_ids, batch.position_ids, None, labels=batch.labels.masked_fill(ignored, 0), loss_mask=keep)
    log_probs = -loss * keep
    (log_probs * grad_log_prob).sum().backward()
    return log_probs.detach(), pop_parameter_grads(model)


def _depths_can_use_a_fused_loss(model) -> bool:
    """The MTP loss that will run can take each depth's loss from the output layer's fused loss:
    the emulated one (megatron-core < 0.18), or Megatron's own where it has that branch."""
    import inspect

    from megatron.core.transformer import multi_token_prediction

    from mcore_ppo import model as model_module

    if not model_module.supports_output_processor(model_module.unwrap_gpt_model(model)):
        return True
    process_mtp_loss = getattr(multi_token_prediction, "process_mtp_loss", None)
    return process_mtp_loss is not None and "output_cross_entropy_loss" in inspect.getsource(process_mtp_loss)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("depth_loss", ["logits", "fused"])
def test_mtp_loss_ignores_what_the_head_ignores(tied: bool, depth_loss: str, test_seed: int):
    model = _mtp_model(tied)
    if depth_loss == "fused" and not _depths_can_use_a_fused_loss(model):
        pytest.skip(
            "this megatron-core's process_mtp_loss always takes logits from the output layer (no fused-loss "
            "branch; Megatron's dev branch has one, emulated on < 0.18)"
        )
    batch = _batch(test_seed)
    assert (batch.labels == -100).any() and (batch.labels != -100).any()
    grad_log_prob = torch.randn(batch.labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_log_prob = grad_log_prob.to(DEVICE)
    ref_log_probs, ref_grads = _reference(model, batch, grad_log_prob)
    assert any(name.startswith("mtp.") and g.abs().sum() > 0 for name, g in ref_grads.items())

    # Σπ² on, tied by the head's option, untied by the call's switch; the MTP depths' calls of the head
    # are unchanged by it.
    head = install_fused_head(model, temperature=1.0, backend="torch", return_sum_pi_squared=tied)
    main_calls = []  # (hidden states, weight) of the head's calls with labels: the main tokens'

    def record(_, args, kwargs):
        if len(args) > 1 and args[1] is not None and not kwargs.get("output_cross_entropy_loss"):
            main_calls.append((args[0].detach(), kwargs["weight"]))

    capture = head.register_forward_pre_hook(record, with_kwargs=True)
    # Megatron's dev branch (cross_entropy_fusion_impl="linear") sets this on GPTModel; its MTP
    # depths then call the output layer's fused loss instead of building logits.
    model.fuse_linear_cross_entropy = depth_loss == "fused"
    logits_calls = []
    original = ColumnParallelLinear.forward

    def spy(self, *args, **kwargs):
        logits_calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    with forward_path(model, "hook"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(ColumnParallelLinear, "forward", spy)
        log_probs, entropy, sum_pi_squared = gpt_log_probs_and_entropy(
            model, batch.input_ids, batch.position_ids, None, batch.labels, return_sum_pi_squared=None if tied else True
        )
        heads_logits = [name for name in logits_calls if name == type(head).__name__]
        (log_probs * grad_log_prob).sum().backward()
    capture.remove()
    torch.testing.assert_close(log_probs, ref_log_probs, **TOL)
    assert torch.all(entropy[batch.labels == -100] == 0)
    # fp64 from the main tokens' hidden states as the processor got them and the output weight
    assert len(main_calls) == 1
    hidden, weight = main_calls[0]
    expected = sum_pi_squared_reference(hidden, head.weight if weight is None else weight, batch.labels, 1.0)
    torch.testing.assert_close(sum_pi_squared, expected, rtol=1e-9, atol=1e-12)
    grads = pop_parameter_grads(model)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # The main tokens never take the logits path; the MTP depths do only without the fused loss.
    assert len(heads_logits) == (DEPTHS if depth_loss == "logits" else 0)


def test_mtp_labels_of_minus_100_would_count_without_the_mask(test_seed: int):
    """The defect the mask fixes: Megatron's MTP loss on raw labels of -100 differs (it counts them)."""
    model = _mtp_model(False)
    batch = _batch(test_seed)
    _, ref_grads = _reference(model, batch, torch.ones(batch.labels.shape, dtype=torch.float64, device=DEVICE))
    # No loss mask: every position counts in the MTP loss (the main loss is masked as before).
    raw_loss = model(batch.input_ids, batch.position_ids, None, labels=batch.labels.clamp(min=0))
    (-(raw_loss * (batch.labels != -100))).sum().backward()
    raw = pop_parameter_grads(model)
    assert any(not torch.allclose(raw[name], ref_grads[name]) for name in raw if name.startswith("mtp."))


def test_mtp_on_the_fallback_path_is_refused():
    model = _mtp_model(False)
    install_fused_head(model)
    batch = _batch(3)
    with forward_path(model, "fallback"), pytest.raises(NotImplementedError, match="multi-token prediction"):
        gpt_log_probs_and_entropy(model, batch.input_ids, batch.position_ids, None, batch.labels)


def test_a_deeper_mtp_model_after_a_shallower_one_finds_a_fresh_tracker():
    """Megatron's MTP tracker is sized by the first model's depth; the suite's fixture empties it
    before each test, so an xdist worker's later, deeper model does not index past it."""
    assert MTPLossLoggingHelper.tracker == {}  # the fixture ran before this test
    MTPLossLoggingHelper.tracker["loss_values"] = torch.zeros(1)  # what a one-layer MTP model leaves
    clear_mtp_tracker()
    assert MTPLossLoggingHelper.tracker == {}
