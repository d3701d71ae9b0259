"""No bad value on the distillation routes gives a finite number where NaN or an error is due.

- ``run_head(given_statistics=...)`` (verl's top-k distillation route): an lse of ±inf or NaN
  gives its token NaN log-probs, with value checks on and off, on both backends; every other
  token is as with the good normaliser, which matches fp64.
- The teacher's ids on that route (``distill_topk.forward_kl_topk``): −100 (the head's
  ``ignore_index``), −1 and V are a ValueError naming ``teacher_ids`` with value checks on, and
  NaN outputs for their token with them off (never the ``log q = 0`` of an ignored slot);
  an ``ignore_index`` inside the vocab is refused.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mcore_ppo.backends import import_optional
from mcore_ppo.distill.topk import topk_and_statistics
from mcore_ppo.head_call import run_head, statistics_of
from mcore_ppo.integrations.verl import distill_topk
from mcore_ppo.options import HiddenGrad, Layout, TokenOrder, call_options
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")

TRITON_ON_CPU = pytest.mark.skipif(
    import_optional("triton") is None or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the triton backend runs CPU tensors only in the interpreter (TRITON_INTERPRET=1)",
)
BACKENDS = ["torch", pytest.param("triton", marks=TRITON_ON_CPU)]
IGNORE = -100
TOKENS, HIDDEN, VOCAB, K = 12, 16, 40, 4
BAD_TOKEN = 5
LAYOUT = Layout(TokenOrder.MEGATRON, HiddenGrad.PARTIAL)


def _inputs(seed: int) -> dict:
    gen = generator(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / 2
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[0] = IGNORE
    teacher_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:K] for _ in range(TOKENS)])
    teacher_logps = torch.log_softmax(torch.randn(TOKENS, K, generator=gen), dim=-1) - 0.5
    temperature = 0.5 + torch.rand(TOKENS, generator=gen)
    return {"hidden": hidden, "weight": weight, "labels": labels, "ids": teacher_ids, "logps": teacher_logps,
            "temperature": temperature}  # fmt: skip


def _log_q_fp64(inputs: dict) -> torch.Tensor:
    logits = inputs["hidden"].double() @ inputs["weight"].double().t() / inputs["temperature"].double()[:, None]
    return torch.log_softmax(logits, dim=-1).gather(1, inputs["ids"])


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan], ids=["-inf", "+inf", "nan"])
def test_non_finite_given_statistics_gives_nan(value, backend, validate):
    inputs = _inputs(next_seed())
    options = call_options(None, ignore_index=IGNORE, backend=backend, return_entropy=False, validate=validate)
    _, lse = topk_and_statistics(inputs["hidden"], inputs["weight"], 1, statistics=statistics_of(options),
                                 temperature=inputs["temperature"], impl="torch")  # fmt: skip

    def log_q(normalizer: torch.Tensor) -> torch.Tensor:
        hidden = inputs["hidden"].clone().requires_grad_(True)
        out, _ = run_head(
            hidden, inputs["weight"], inputs["ids"], inputs["temperature"], options, tp_group=None, layout=LAYOUT,
            ids=True, given_statistics=normalizer,
        )  # fmt: skip
        out.sum().backward()
        return out.detach(), hidden.grad

    good, good_grad = log_q(lse)
    torch.testing.assert_close(good.double(), _log_q_fp64(inputs), rtol=1e-5, atol=1e-5)
    bad_lse = lse.clone()
    bad_lse[0, BAD_TOKEN] = value
    bad, bad_grad = log_q(bad_lse)
    assert torch.isnan(bad[BAD_TOKEN]).all(), f"given_statistics {value} gave {bad[BAD_TOKEN]}"
    others = torch.arange(TOKENS) != BAD_TOKEN
    torch.testing.assert_close(bad[others], good[others], rtol=0, atol=0)
    assert not torch.isfinite(bad_grad[BAD_TOKEN]).all()
    torch.testing.assert_close(bad_grad[others], good_grad[others], rtol=0, atol=0)


def _kl(inputs: dict, teacher_ids: torch.Tensor, *, validate: bool, ignore_index: int = IGNORE):
    """``forward_kl_topk``'s five outputs ``[1, n]`` (verl's order) for the teacher's ids."""
    options = call_options(None, ignore_index=ignore_index, backend="torch", return_entropy=False, validate=validate)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    student = distill_topk.Student(
        hidden, inputs["weight"], inputs["labels"], inputs["temperature"], None, LAYOUT, options, "torch", None
    )
    out = distill_topk.forward_kl_topk(student, inputs["logps"][None], teacher_ids[None], None)
    out[0].nan_to_num(0.0).sum().backward()
    return [x[0].detach() for x in out], hidden.grad


@pytest.mark.parametrize("bad_id", [IGNORE, -1, VOCAB], ids=["ignore_index", "minus-one", "vocab-size"])
def test_a_bad_teacher_id_is_refused_or_nan(bad_id):
    inputs = _inputs(next_seed())
    teacher_ids = inputs["ids"].clone()
    teacher_ids[BAD_TOKEN, 1] = bad_id
    with pytest.raises(ValueError, match="teacher_ids must be in"):
        _kl(inputs, teacher_ids, validate=True)

    good, good_grad = _kl(inputs, inputs["ids"], validate=False)
    # The good route against fp64: verl's loss sum_i p_i (log p_i - log q_i), student_mass sum_i q_i.
    log_q = _log_q_fp64(inputs)
    p = inputs["logps"].double().exp()
    torch.testing.assert_close(good[0].double(), (p * (inputs["logps"].double() - log_q)).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(good[1].double(), log_q.exp().sum(-1), rtol=1e-5, atol=1e-6)

    bad, bad_grad = _kl(inputs, teacher_ids, validate=False)
    loss, student_mass, teacher_mass, _, advantage = bad
    for name, values in (("distillation_losses", loss), ("student_mass", student_mass), ("advantage", advantage)):
        assert torch.isnan(values[BAD_TOKEN]), f"teacher id {bad_id}: {name} {values[BAD_TOKEN]}"
    others = torch.arange(TOKENS) != BAD_TOKEN
    for got, want in zip(bad, good, strict=True):
        torch.testing.assert_close(got[others], want[others], rtol=0, atol=0)
    torch.testing.assert_close(teacher_mass, good[2], rtol=0, atol=0)
    torch.testing.assert_close(bad_grad[others], good_grad[others], rtol=0, atol=0)


def test_an_ignore_index_inside_the_vocab_is_refused():
    inputs = _inputs(next_seed())
    with pytest.raises(ValueError, match="ignore_index=3 is a vocab id"):
        _kl(inputs, inputs["ids"], validate=False, ignore_index=3)
