"""What megatron-core 0.20 (main) and its dev branch hand the output layer, on the installed version.

- main passes ``output_dtype=`` (``GPTModel(logit_dtype=...)``) to ``ColumnParallelLinear``;
- dev's output layer is ``LinearCrossEntropyModule`` (``megatron/core/transformer/
  linear_cross_entropy.py`` at d48bd6be): a ``ColumnParallelLinear`` subclass whose forward takes
  ``output_cross_entropy_loss=True, labels=, reduction=, ignore_index=`` and returns the fused
  per-token cross entropy ``[b, s]``. It is reproduced below with that forward (its fused loss
  computed from logits here, as the reference).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo import VocabParallelFusedPPOHead, install_fused_head
from mcore_ppo import head as head_module
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.layer_specs import local_gpt_spec

VOCAB, HIDDEN = 64, 16
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.usefixtures("megatron_tp1")


class LinearCrossEntropyModule(ColumnParallelLinear):
    """Megatron dev's output layer: ColumnParallelLinear plus a fused-loss forward (module doc)."""

    def forward(
        self,
        input_,
        weight=None,
        runtime_gather_output=None,
        output_cross_entropy_loss=False,
        labels=None,
        reduction="none",
        ignore_index=-100,
    ):
        if not output_cross_entropy_loss:
            return super().forward(input_, weight, runtime_gather_output)
        logits, _ = super().forward(input_, weight, runtime_gather_output)
        valid = labels != ignore_index
        # TP 1 here: the cross entropy of the whole vocab, in fp64 (Megatron's own casts to fp32).
        log_softmax = torch.log_softmax(logits.double(), dim=-1).transpose(0, 1)  # [b, s, V]
        loss = -log_softmax.gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1) * valid
        return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / valid.sum().clamp(min=1)}[reduction]


@pytest.fixture
def dev_module_name(monkeypatch):
    """Give the class above the module dev's lives in (what install_fused_head checks)."""
    module = types.ModuleType("megatron.core.transformer.linear_cross_entropy")
    module.LinearCrossEntropyModule = LinearCrossEntropyModule
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(LinearCrossEntropyModule, "__module__", module.__name__)
    return module.__name__


def _model(tied: bool = False):
    return build_gpt_model(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_sequence_length=8,
        tie_embeddings=tied,
        params_dtype=torch.float64,
        transformer_layer_spec=local_gpt_spec(),
        device=DEVICE,
    )


def _as_dev_output_layer(model) -> LinearCrossEntropyModule:
    old = model.output_layer
    layer = LinearCrossEntropyModule(
        old.input_size, old.output_size, config=old.config, init_method=lambda w: None, bias=False,
        skip_weight_param_allocation=old.weight is None, tp_group=old.tp_group,
    )  # fmt: skip
    if old.weight is not None:
        layer.weight = old.weight
    model.output_layer = layer
    return layer


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_install_takes_over_linear_cross_entropy_module(dev_module_name, tied):
    model = _model(tied)
    dev = _as_dev_output_layer(model)
    head = install_fused_head(model, backend="torch", temperature=0.5)
    assert isinstance(head, VocabParallelFusedPPOHead) and model.output_layer is head
    assert head.weight is dev.weight  # the same Parameter (None when tied)
    weight = model.shared_embedding_or_output_weight()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 2, HIDDEN, dtype=torch.float64, generator=gen).to(DEVICE)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen).to(DEVICE)
    labels[0, :2] = -100
    for reduction in ("none", "sum", "mean"):
        # The keywords dev's GPTModel._postprocess and process_mtp_loss pass.
        kwargs = dict(weight=weight if tied else None, runtime_gather_output=None, labels=labels, reduction=reduction)
        mine = head(input_=hidden, output_cross_entropy_loss=True, **kwargs)
        theirs = dev(hidden, output_cross_entropy_loss=True, **kwargs)
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)  # temperature 1, not the head's 0.5
    logits, _ = head(hidden, weight=weight if tied else None)  # labels=None: the plain layer
    assert logits.shape == (6, 2, VOCAB)


def test_other_output_layer_subclasses_are_refused(dev_module_name):
    model = _model()

    class TELMHeadColumnParallelLinear(ColumnParallelLinear):  # TransformerEngine's MXFP8 head, by name
        pass

    old = model.output_layer
    model.output_layer = TELMHeadColumnParallelLinear(
        old.input_size, old.output_size, config=old.config, init_method=lambda w: None, bias=False
    )
    with pytest.raises(TypeError, match="fp8_output_proj=False"):
        install_fused_head(model)


def test_output_dtype_accepted():
    model = _model()
    config = model.output_layer.config
    head = VocabParallelFusedPPOHead(
        HIDDEN, VOCAB, config=config, init_method=lambda w: None, output_dtype=None, skip_weight_param_allocation=True
    )
    assert head.output_dtype is None
    same = VocabParallelFusedPPOHead(
        HIDDEN, VOCAB, config=config, init_method=lambda w: None, output_dtype=config.params_dtype,
        skip_weight_param_allocation=True,
    )  # fmt: skip
    assert same.output_dtype == config.params_dtype
    other = torch.float32 if config.params_dtype != torch.float32 else torch.bfloat16
    if head_module._CPL_TAKES_OUTPUT_DTYPE:  # megatron-core >= 0.20: ColumnParallelLinear keeps it
        assert VocabParallelFusedPPOHead(
            HIDDEN, VOCAB, config=config, init_method=lambda w: None, output_dtype=other,
            skip_weight_param_allocation=True,
        ).output_dtype == other  # fmt: skip
    else:
        with pytest.raises(ValueError, match=r"megatron-core >= 0\.20"):
            VocabParallelFusedPPOHead(
                HIDDEN, VOCAB, config=config, init_method=lambda w: None, output_dtype=other,
                skip_weight_param_allocation=True,
            )  # fmt: skip
    with pytest.raises(TypeError, match="output_dtype"):
        VocabParallelFusedPPOHead(HIDDEN, VOCAB, config=config, init_method=lambda w: None, output_dtype="bf16")


def test_install_forwards_the_output_layers_output_dtype():
    model = _model()
    model.output_layer.output_dtype = model.output_layer.config.params_dtype  # as main's layer carries it
    head = install_fused_head(model)
    assert head.output_dtype == model.output_layer.config.params_dtype
