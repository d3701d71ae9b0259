"""One contract for bad input on every entry point (one rank; the multi-rank side is
``tests/distributed/test_entry_points_bad_inputs.py``).

The table of ``mcore_ppo_testing.bad_inputs`` on the function, ``[..., k]`` labels, the head
module, verl's ``linear_cross_entropy``, the teacher's ``fused_topk``, NeMo-RL's adapter,
``run_head`` given ``given_statistics`` and a Megatron GPT through ``gpt_log_probs_and_entropy``:

- every bad argument raises ``TypeError`` or ``ValueError`` naming it (never another exception
  from deeper inside), before any backend work;
- with ``validate=False`` a bad label or temperature value gives NaN for its token, never a
  plausible number, and leaves the other tokens' outputs as with good inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from head_checks import forbid_vocab_passes

from mcore_ppo.verdict import values_readable
from mcore_ppo_testing.bad_inputs import BAD_ARGUMENTS, ENTRY_POINTS, IDS, IGNORE, make_case, with_model
from mcore_ppo_testing.seeds import next_seed

pytestmark = pytest.mark.usefixtures("one_thread")

# The table's bad values (as against types, shapes and options): refused where they are read for
# free (CPU tensors), NaN elsewhere (docs/design.md §5).
VALUES = {"labels out of the vocab", "temperature tensor with a zero"}

PAIRS = [
    pytest.param(entry, bad, id=f"{entry}-{bad.name.replace(' ', '_')}")
    for bad in BAD_ARGUMENTS
    for entry in sorted(ENTRY_POINTS)
    if entry in bad.entries
]


@pytest.fixture
def case_for(request):
    """``case_for(entry)``: a fresh case; the model's entry gets its GPT (Megatron's TP 1 state
    and, on the CPU, the shims: tests/conftest.py's ``megatron_tp1``), on CUDA where there is
    one (Megatron's GPTModel does not run on CPU tensors there: the shims refuse CUDA)."""

    def build(entry: str):
        if entry != "model":
            return make_case(next_seed())
        request.getfixturevalue("megatron_tp1")
        return with_model(make_case(next_seed(), device="cuda" if torch.cuda.is_available() else "cpu"))

    return build


@pytest.fixture
def no_compute(monkeypatch):
    """The backend must not run: every refusal comes before any compute."""
    forbid_vocab_passes(monkeypatch, "the backend ran before the checks refused the input")


@pytest.mark.parametrize(("entry", "bad"), PAIRS)
def test_bad_argument_is_refused_naming_it(entry, bad, case_for, no_compute):
    case = case_for(entry)
    if bad.name in VALUES and not values_readable(case.hidden):
        pytest.skip("no value is read back on CUDA (a host sync): the NaN rule, test_unchecked_bad_label_gives_nan")
    with pytest.raises(bad.error) as info:
        ENTRY_POINTS[entry](case, **bad.overrides(case, entry))
    message = str(info.value)
    assert type(info.value) is bad.error, f"{type(info.value).__name__}: {message}"
    assert any(name in message for name in bad.names), f"the message names none of {bad.names}: {message}"


def test_every_entry_point_meets_the_table():
    """Each entry point takes most of the table: a new entry point cannot slip past it."""
    for entry in ENTRY_POINTS:
        assert sum(entry in bad.entries for bad in BAD_ARGUMENTS) >= 10, entry


# --- validate=False: NaN for the bad token --------------------------------------------------------

# The token [1, 3] (batch row 1, position 3) gets the bad value.
ROW, POS = 1, 3


def _token(values: torch.Tensor, entry: str) -> torch.Tensor:
    """The outputs of token (ROW, POS) (verl's are flat in hidden's [s, b] order)."""
    if entry == "verl":
        return values.view(-1, 2)[POS, ROW]
    return values[ROW, POS]


def _outputs(entry: str, result) -> list[torch.Tensor]:
    if entry == "topk":
        return [result.log_probs, result.tail_log_mass]
    if entry == "nemo_rl":
        return [result]
    return [out for out in result if out is not None]


@pytest.mark.parametrize("entry", sorted(set(ENTRY_POINTS) - {"topk"}))
def test_unchecked_bad_label_gives_nan(entry, case_for):
    case = case_for(entry)
    good = _outputs(entry, ENTRY_POINTS[entry](case, validate=False))
    labels = (case.ids if entry in IDS else case.labels).clone()
    # NeMo-RL's target is rolled by one inside the adapter: its token (ROW, POS) reads POS + 1.
    labels[ROW, POS + (entry == "nemo_rl")] = case.vocab + 5
    overrides = {"labels": labels.t() if entry == "verl" else labels, "validate": False}
    bad = _outputs(entry, ENTRY_POINTS[entry](case, **overrides))
    log_prob = _token(bad[0], entry)
    assert torch.isnan(log_prob).any(), f"{entry}: a label outside the vocab gave {log_prob}"
    others = torch.ones_like(bad[0], dtype=torch.bool)
    if entry == "verl":
        others.view(-1, 2)[POS, ROW] = False
    else:
        others[ROW, POS] = False
    torch.testing.assert_close(bad[0][others], good[0][others], rtol=0, atol=0)


@pytest.mark.parametrize("entry", sorted(set(ENTRY_POINTS) - {"nemo_rl"}))
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_unchecked_bad_temperature_gives_nan(entry, value, case_for):
    case = case_for(entry)
    temperature = case.temperature.clone()
    good = _outputs(entry, ENTRY_POINTS[entry](case, validate=False))
    temperature[ROW, POS] = value
    overrides = {"temperature": temperature.t() if entry == "verl" else temperature, "validate": False}
    bad = _outputs(entry, ENTRY_POINTS[entry](case, **overrides))
    ignored = (case.ids if entry in IDS else case.labels)[ROW, POS]
    assert not (ignored == IGNORE).all()
    for out_bad, out_good in zip(bad, good, strict=True):
        assert torch.isnan(_token(out_bad, entry)).all(), f"{entry}: temperature {value} gave {_token(out_bad, entry)}"
        others = torch.ones(out_bad.shape[:2] if entry != "verl" else out_bad.shape, dtype=torch.bool)
        if entry == "verl":
            others.view(-1, 2)[POS, ROW] = False
        else:
            others[ROW, POS] = False
        torch.testing.assert_close(out_bad[others], out_good[others], rtol=0, atol=0)
