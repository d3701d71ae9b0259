"""A call whose signature the head has met skips its checks and reuses that call's decisions
(:class:`mcore_ppo.execution.Prepared`), and gives what the checked call gives.

- Later calls of one signature (the dtypes, dims, weight shape, options, layout, group, a
  number for a temperature; any token count) run without :func:`~mcore_ppo.head_call.check_call`
  and give bitwise the outputs and gradients of a call that takes the checks, in every layout:
  Megatron's ``[n]``, ``[s, b]`` and packed labels, verl's flat order, ``k`` ids per token and
  ``k = 1``, Σπ², a 16-bit hidden with an fp32 weight.
- Nothing that must be checked on every call is skipped: each bad argument of the entry points'
  table is still refused after good calls of the same signature; so is a dual tensor of forward
  AD. Label and temperature values the checks read (``validate`` on CPU tensors) are read on
  every call, and a temperature tensor is checked on every call.
- Property (hypothesis, seeded with ``MCORE_PPO_TEST_SEED``): any drawn sequence of good and
  flawed calls over signatures one field apart gives, call by call, the outputs and gradients or
  the exception and message of the same calls through the checks. Dropping the token-count
  check, or the labels' dtype, the weight's shape, the temperature, the hidden's dtype or the
  options from the signature's key, fails it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.autograd import forward_ad

import mcore_ppo
from mcore_ppo import execution, head_call
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from mcore_ppo.options import call_options, replaced
from mcore_ppo_testing.bad_inputs import BAD_ARGUMENTS, ENTRY_POINTS, IDS, make_case, with_model
from mcore_ppo_testing.seeds import generator, next_seed
from mcore_ppo_testing.stub_launch import cuda_like_checks

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN = 37, 16
# The entry points of the bad-input table that run the head through run_head (its checks).
RUN_HEAD_ENTRIES = ("api", "ids", "verl", "nemo_rl")


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """A fresh table of prepared calls; the list grows by one per :func:`check_call`."""
    monkeypatch.setattr(execution, "_PREPARED", {})
    seen: list[int] = []
    check_call = head_call.check_call

    def counted(*args, **kwargs):
        seen.append(1)
        return check_call(*args, **kwargs)

    monkeypatch.setattr(head_call, "check_call", counted)
    return seen


def _inputs(layout: str, tokens: int, gen: torch.Generator, dtype=torch.float32, weight_dtype=None, vocab=VOCAB):
    """hidden (requires grad), weight (requires grad) and labels of ``layout`` with ``tokens`` tokens."""
    batch = 2
    lead, label_shape = {
        "2d": ((tokens,), (tokens,)),
        "3d": ((tokens // batch, batch), (batch, tokens // batch)),
        "packed": ((tokens, 1), (1, tokens)),
        "flat": ((tokens // batch, batch), (tokens // batch, batch)),  # verl's: hidden's memory order
        "ids": ((tokens // batch, batch), (batch, tokens // batch, 3)),
        "one_id": ((tokens,), (tokens, 1)),
    }[layout]
    hidden = torch.randn(*lead, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64) / 4).to(weight_dtype or dtype)
    labels = torch.randint(0, vocab, label_shape, generator=gen)
    labels.view(-1)[::5] = -100
    labels.view(-1)[1], labels.view(-1)[2] = 0, vocab - 1
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _call(layout: str, hidden, weight, labels, **options):
    if layout == "flat":
        out = linear_cross_entropy(hidden, weight, labels, 0.7, "none", None, backend="torch", **options)
    elif layout in ("ids", "one_id"):
        out = mcore_ppo.fused_log_probs_at(hidden, weight, labels, temperature=0.7, backend="torch", **options)
    else:
        out = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch", **options)
    outputs = [value for value in out if value is not None]
    gen = generator(7)
    grads = [torch.randn(value.shape, generator=gen) for value in outputs[:2]]
    d_hidden, d_weight = torch.autograd.grad(outputs[:2], (hidden, weight), grads)
    return [value.detach() for value in outputs] + [d_hidden, d_weight]


CASES = {
    "2d": {},
    "3d": {"validate": False, "return_sum_pi_squared": True},
    "packed": {"return_entropy": False},
    "flat": {},
    "ids": {"return_sum_pi_squared": True},
    "one_id": {},
}


@pytest.mark.parametrize("layout", sorted(CASES))
def test_later_calls_of_a_signature_skip_the_checks_and_match_checked_calls(layout, checks, monkeypatch):
    options = dict(CASES[layout])
    gen = generator(next_seed())
    with cuda_like_checks():  # label values unread, as on CUDA: the checks' verdict is the signature's
        first = _call(layout, *_inputs(layout, 24, gen), **options)
        assert len(checks) == 1
        later = [_inputs(layout, tokens, gen) for tokens in (24, 40, 8)]
        prepared = [_call(layout, *case, **options) for case in later]
        assert len(checks) == 1, "a later call of the signature took the checks"
        monkeypatch.setattr(execution, "prepared_key", lambda *args: None)
        checked = [_call(layout, *case, **options) for case in later]
        assert len(checks) == 4
    assert len(first) == len(prepared[0])
    for fast, slow in zip(prepared, checked, strict=True):
        for a, b in zip(fast, slow, strict=True):
            assert a.shape == b.shape and torch.equal(a, b)


def test_a_16_bit_hidden_with_an_fp32_weight(checks, monkeypatch):
    gen = generator(next_seed())
    cases = [_inputs("2d", tokens, gen, torch.bfloat16, torch.float32) for tokens in (12, 20)]
    with cuda_like_checks():
        fast = [_call("2d", *case, precision="ieee") for case in cases]
        assert len(checks) == 1
        monkeypatch.setattr(execution, "prepared_key", lambda *args: None)
        slow = [_call("2d", *case, precision="ieee") for case in cases]
    for fast_call, slow_call in zip(fast, slow, strict=True):
        for a, b in zip(fast_call, slow_call, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast[0][2].dtype == torch.bfloat16  # d_hidden in the hidden's dtype


@pytest.mark.parametrize("override", [False, True], ids=["options", "per-call-override"])
@pytest.mark.parametrize("entry", [*RUN_HEAD_ENTRIES, "head", "model"])
def test_every_entry_point_prepares_its_later_calls(entry, override, checks, request):
    """The function, ``[..., k]`` labels, the head module, verl's and NeMo-RL's entries and a
    Megatron GPT through ``gpt_log_probs_and_entropy``: repeated calls (the head module rebuilt
    each time, as its options are), with or without a per-call ``return_entropy`` beside the
    options, take the checks once."""
    case = make_case(next_seed())
    if entry == "model":
        request.getfixturevalue("megatron_tp1")
        case = with_model(case)
    keywords = {"temperature": 0.7, **({"return_entropy": False} if override else {})}
    with cuda_like_checks():
        for _ in range(3):
            ENTRY_POINTS[entry](case, **keywords)
    assert len(checks) == 1


def test_an_override_on_every_call_keeps_one_options_object():
    """:func:`mcore_ppo.options.replaced`: one object per options object and change, the
    options themselves for a value they hold, a bad value refused on every call."""
    base = mcore_ppo.HeadOptions(backend="torch")
    first = replaced(base, return_entropy=False)
    assert first.return_entropy is False and first.backend == "torch"
    assert replaced(base, return_entropy=False) is first
    assert replaced(base, return_entropy=True) is base
    keywords = {"ignore_index": None, "backend": None, "validate": None}
    assert call_options(base, return_entropy=False, **keywords) is first
    for _ in range(2):  # True == 1, but an int is not a bool: refused each time, never kept
        with pytest.raises(TypeError, match="return_entropy"):
            replaced(base, return_entropy=1)


# --- what is never skipped -------------------------------------------------------------------------

# The table's bad values: with their values unread (as on CUDA) they give NaN, not an exception
# (test_entry_points_contract.py checks that, prepared or not: the values are never part of it).
VALUES = {"labels out of the vocab", "temperature tensor with a zero"}
PAIRS = [
    pytest.param(entry, bad, id=f"{entry}-{bad.name.replace(' ', '_')}")
    for bad in BAD_ARGUMENTS
    for entry in RUN_HEAD_ENTRIES
    if entry in bad.entries and bad.name not in VALUES
]


@pytest.mark.parametrize(("entry", "bad"), PAIRS)
def test_a_bad_argument_is_refused_after_good_calls_of_its_signature(entry, bad, checks):
    case = make_case(next_seed())
    good = {"temperature": 0.7, "validate": False}
    with cuda_like_checks():
        for _ in range(2):
            ENTRY_POINTS[entry](case, **good)
        assert len(checks) == 1  # the second call was prepared
        with pytest.raises(bad.error) as info:
            ENTRY_POINTS[entry](case, **{**good, **bad.overrides(case, entry)})
    message = str(info.value)
    assert type(info.value) is bad.error, f"{type(info.value).__name__}: {message}"
    assert any(name in message for name in bad.names), f"the message names none of {bad.names}: {message}"


@pytest.mark.parametrize("entry", RUN_HEAD_ENTRIES)
def test_values_read_by_the_checks_are_read_on_every_call(entry, checks):
    """On CPU tensors ``validate`` reads the labels: never prepared, a bad label always refused."""
    case = make_case(next_seed())
    for _ in range(2):
        ENTRY_POINTS[entry](case, temperature=0.7)
    labels = (case.ids if entry in IDS else case.labels).clone()
    labels[1, 3] = case.vocab
    with pytest.raises(ValueError, match="labels"):
        ENTRY_POINTS[entry](case, temperature=0.7, labels=labels.t() if entry == "verl" else labels)
    assert len(checks) == 3 and not execution._PREPARED


@pytest.mark.parametrize("entry", ("api", "ids", "verl"))
def test_a_temperature_tensor_is_checked_on_every_call(entry, checks):
    case = make_case(next_seed())
    with cuda_like_checks():
        for _ in range(2):
            ENTRY_POINTS[entry](case, validate=False)
    assert len(checks) == 2 and not execution._PREPARED


def test_what_a_signature_is(checks):
    """A new options object, dtype, temperature or hidden size is a new signature; a token count is not."""
    gen = generator(next_seed())
    hidden, weight, labels = _inputs("2d", 12, gen)
    call = mcore_ppo.fused_log_probs_and_entropy
    with cuda_like_checks():
        call(hidden, weight, labels, temperature=0.7, backend="torch")
        call(hidden[:5], weight, labels[:5], temperature=0.7, backend="torch")
        assert len(checks) == 1
        call(hidden, weight, labels, temperature=0.5, backend="torch")
        call(hidden, weight, labels, temperature=0.7, options=mcore_ppo.HeadOptions(backend="torch"))
        call(hidden.double(), weight.double(), labels, temperature=0.7, backend="torch")
        call(hidden[:, :8], weight[:, :8], labels, temperature=0.7, backend="torch")
        call(hidden, weight, labels.int(), temperature=0.7, backend="torch")
        assert len(checks) == 6


def test_a_dual_tensor_is_refused_after_prepared_calls(checks):
    gen = generator(next_seed())
    hidden, weight, labels = _inputs("2d", 12, gen)
    with cuda_like_checks():
        for _ in range(2):
            mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch")
        with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
            dual = forward_ad.make_dual(hidden.detach(), torch.ones_like(hidden))
            mcore_ppo.fused_log_probs_and_entropy(dual, weight, labels, temperature=0.7, backend="torch")


def test_the_table_is_bounded(checks, monkeypatch):
    monkeypatch.setattr(execution, "PREPARED_CALLS", 2)
    gen = generator(next_seed())
    hidden, weight, labels = _inputs("2d", 12, gen)
    with cuda_like_checks():
        for temperature in (0.5, 0.6, 0.7):
            mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, backend="torch")
            assert len(execution._PREPARED) <= 2


# --- any sequence of calls: prepared or checked, the same outcome ---------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mcore_ppo_testing.seeds import base_seed  # noqa: E402

OPTION_SETS = ({}, {"return_entropy": False}, {"return_sum_pi_squared": True}, {"ignore_index": -1})
FLAWS = (
    None, None, None, None, "one token short", "float labels", "weight dtype", "hidden dtype", "temperature zero",
    "hidden size", "label past the vocab",
)  # fmt: skip


# What a drawn signature is made of: the layout, and these fields' values.
FIELDS = {
    "dtype": (torch.float32, torch.bfloat16),
    "label_dtype": (torch.int64, torch.int32),
    "temperature": (0.7, 1, 1.5),
    "vocab": (VOCAB, 29),
    "options": OPTION_SETS,
}


def _choices(field: str, layout: str) -> tuple:
    return OPTION_SETS[:2] if field == "options" and layout == "flat" else FIELDS[field]


@st.composite
def call_sequences(draw) -> list[dict]:
    """Calls of up to three signatures, each but the first one field away from the first (so most
    calls meet an earlier call's signature or one that differs from it in one field), each call
    with its own token count and data, some with one flawed argument."""
    layout = draw(st.sampled_from(["2d", "3d", "packed", "flat", "ids", "one_id"]))
    base = {"layout": layout, **{name: draw(st.sampled_from(_choices(name, layout))) for name in FIELDS}}
    pool = [base]
    for _ in range(draw(st.integers(0, 2))):
        field = draw(st.sampled_from(sorted(FIELDS)))
        pool.append({**base, field: draw(st.sampled_from([v for v in _choices(field, layout) if v != base[field]]))})
    return [
        {
            **draw(st.sampled_from(pool)),
            "tokens": draw(st.sampled_from([4, 6, 10])),
            "flaw": draw(st.sampled_from(FLAWS)),
            "seed": draw(st.integers(0, 2**31 - 1)),
        }
        for _ in range(draw(st.integers(2, 8)))
    ]


def _outcome(spec: dict) -> tuple:
    """``("ok", outputs and gradients)`` or ``("raised", type, message)`` of one drawn call."""
    gen = generator(spec["seed"])
    hidden, weight, labels = _inputs(spec["layout"], spec["tokens"], gen, spec["dtype"], vocab=spec["vocab"])
    labels = labels.to(spec["label_dtype"])
    temperature, flaw = spec["temperature"], spec["flaw"]
    if flaw == "one token short":
        hidden = hidden.detach()[:-1].requires_grad_()
    elif flaw == "float labels":
        labels = labels.float()
    elif flaw == "weight dtype":
        weight = weight.detach().double().requires_grad_()
    elif flaw == "temperature zero":
        temperature = 0.0
    elif flaw == "hidden size":
        weight = weight.detach()[:, :-1].requires_grad_()
    elif flaw == "hidden dtype":
        other = torch.bfloat16 if hidden.dtype == torch.float32 else torch.float32
        hidden = hidden.detach().to(other).requires_grad_()
    elif flaw == "label past the vocab":  # not read (as on CUDA): NaN for its token
        labels = labels.clone()
        labels.view(-1)[-1] = spec["vocab"]
    layout, options = spec["layout"], spec["options"]
    try:
        if layout == "flat":
            out = linear_cross_entropy(hidden, weight, labels, temperature, "none", None, backend="torch", **options)
        elif layout in ("ids", "one_id"):
            out = mcore_ppo.fused_log_probs_at(
                hidden, weight, labels, temperature=temperature, backend="torch", **options
            )
        else:
            out = mcore_ppo.fused_log_probs_and_entropy(
                hidden, weight, labels, temperature=temperature, backend="torch", **options
            )
    except (TypeError, ValueError) as err:
        return ("raised", type(err), str(err))
    outputs = [value for value in out if value is not None]
    d_hidden, d_weight = torch.autograd.grad(outputs[0].sum() + outputs[-1].sum(), (hidden, weight))
    return ("ok", [value.detach() for value in outputs], d_hidden, d_weight)


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "raised":
        return a[1:] == b[1:]
    left = [*a[1], *a[2:]]
    right = [*b[1], *b[2:]]
    return len(left) == len(right) and all(_bitwise(x, y) for x, y in zip(left, right, strict=True))


def _bitwise(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN where the other has NaN: a label outside the vocab)."""
    nan = torch.isnan(x)
    return (
        x.shape == y.shape
        and x.dtype == y.dtype
        and torch.equal(nan, torch.isnan(y))
        and torch.equal(x.masked_fill(nan, 0), y.masked_fill(nan, 0))
    )


@seed(base_seed())
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=call_sequences())
def test_any_sequence_of_calls_gives_what_checked_calls_give(calls):
    """Drawn sequences of good and flawed calls: with the table of prepared calls filling up as
    they run, each call's outputs and gradients, or its exception and message, are those of the
    same call through the checks."""
    with cuda_like_checks(), mock.patch.object(execution, "_PREPARED", {}):
        prepared = [_outcome(spec) for spec in calls]
        with mock.patch.object(execution, "prepared_key", lambda *args: None):
            checked = [_outcome(spec) for spec in calls]
    for index, (a, b) in enumerate(zip(prepared, checked, strict=True)):
        assert _same(a, b), f"call {index} of {calls}: {a[:3]} against {b[:3]}"
