"""A bad argument on ONE tensor-parallel rank raises on every rank, on every entry point.

The table of ``mcore_ppo_testing.bad_inputs`` (every argument of the function, ``[..., k]``
labels, the head module, verl's ``linear_cross_entropy``, the teacher's ``fused_topk``,
NeMo-RL's adapter, ``run_head`` given ``given_statistics`` and a Megatron GPT through
``gpt_log_probs_and_entropy``), each bad on the last TP rank only, at TP 2 and TP 4: that rank
raises its own TypeError/ValueError naming the argument, every other rank a ValueError saying a
peer refused its inputs; no rank is left waiting in a collective (a hang fails the test through
the runner's watchdog, which these tests set to a short time). After every refusal the same call
with good arguments runs on every rank and matches the single-rank result (the model's: its own
logits path in fp64).
"""

import pytest
import torch
from conftest import DEVICE, model_parallel, shared_seed, tp_cp_groups

from mcore_ppo.verdict import PEER_REFUSED
from mcore_ppo_testing.bad_inputs import ENTRY_POINTS, cases_for, make_case, model_reference, with_model

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

TP_SIZES = (2, 4)
# Each call of a case takes well under a second; a rank left in a collective is caught long
# before the default watchdog would.
WATCHDOG_S = 120


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """Megatron's GPTModel on the CPU for the model's entry."""
    yield


def _first(result) -> torch.Tensor:
    """The entry point's first per-token output (top-k: the log-probs)."""
    if hasattr(result, "log_probs"):
        return result.log_probs
    return result if isinstance(result, torch.Tensor) else result[0]


def _refusals(check, tp: int, tp_rank: int, entry: str, case, expected: torch.Tensor) -> None:
    """Every bad argument of ``entry``'s table, bad on the last TP rank only."""
    call = ENTRY_POINTS[entry]
    bad_rank = tp - 1
    for bad in cases_for(entry):
        check.case(f"tp={tp} {entry}: {bad.name} on rank {bad_rank}")
        mine = bad.overrides(case, entry) if tp_rank == bad_rank else {}
        if mine:
            error, names = bad.error, bad.names
        else:
            error, names = ValueError, (PEER_REFUSED,)
        try:
            call(case, **mine)
        except error as err:
            if not any(name in str(err) for name in names):
                check.fail(f"{type(err).__name__} names none of {names}: {err}")
        except Exception as err:  # any other exception is this check's failure, not the run's
            check.fail(f"expected {error.__name__} naming {names}, got {type(err).__name__}: {err}")
        else:
            check.fail(f"expected {error.__name__} naming {names}, nothing was raised")
        # Every rank is still in step: the good call runs and matches the reference.
        got = _first(call(case))
        check.close(f"{entry} after a refusal", got.cpu(), expected.cpu(), tol=1e-5, kind=f"tp{tp} {entry}")


@pytest.mark.watchdog(WATCHDOG_S)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_one_bad_rank_raises_on_every_rank(tp, check):
    layout = tp_cp_groups(tp)
    if layout.tp_group is None:  # this rank is not in the layout's groups
        check.done()
        return
    seed = shared_seed()
    case = make_case(seed, tp=tp, tp_rank=layout.tp_rank, tp_group=layout.tp_group, device=DEVICE)
    single = make_case(seed, tp=tp, tp_rank=None)
    for entry, call in ENTRY_POINTS.items():
        if entry == "model" or (DEVICE.type != "cpu" and entry == "nemo_rl"):
            continue  # the model's entry: the test below; NeMo-RL's CPU-side labels are the same on every device
        _refusals(check, tp, layout.tp_rank, entry, case, _first(call(single)))
    check.done()


@pytest.mark.watchdog(WATCHDOG_S)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_one_bad_rank_raises_on_every_rank_through_the_model(tp, check):
    """``gpt_log_probs_and_entropy``: its own arguments are refused on every rank before the
    model's first TP collective, the head's at the head's verdict (every TP group of the world)."""
    with model_parallel(tp):
        from megatron.core import parallel_state

        case = with_model(make_case(shared_seed(), tp=tp, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                    device=DEVICE))  # fmt: skip
        _refusals(check, tp, case.tp_rank, "model", case, model_reference(case))
    check.done()
