"""A bad argument on ONE tensor-parallel rank raises on every rank, on every entry point.

The table of ``mcore_ppo_testing.bad_inputs`` (every argument of the function, ``[..., k]``
labels, the head module, verl's ``linear_cross_entropy``, the teacher's ``fused_topk`` and
NeMo-RL's adapter), each bad on the last TP rank only, at TP 2 and TP 4: that rank raises its
own TypeError/ValueError naming the argument, every other rank a ValueError saying a peer refused
its inputs; no rank is left waiting in a collective (a hang fails the test through the runner's
watchdog). After every refusal the same call with good arguments runs on every rank and matches
the single-rank result.
"""

import pytest
import torch
from conftest import DEVICE, shared_seed, tp_cp_groups

from mcore_ppo.verdict import PEER_REFUSED
from mcore_ppo_testing.bad_inputs import ENTRY_POINTS, cases_for, make_case

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

TP_SIZES = (2, 4)


def _first(result) -> torch.Tensor:
    """The entry point's first per-token output (top-k: the log-probs)."""
    if hasattr(result, "log_probs"):
        return result.log_probs
    return result if isinstance(result, torch.Tensor) else result[0]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_one_bad_rank_raises_on_every_rank(tp, check):
    layout = tp_cp_groups(tp)
    if layout.tp_group is None:  # this rank is not in the layout's groups
        check.done()
        return
    seed = shared_seed()
    case = make_case(seed, tp=tp, tp_rank=layout.tp_rank, tp_group=layout.tp_group, device=DEVICE)
    single = make_case(seed, tp=tp, tp_rank=None)
    bad_rank = tp - 1
    for entry, call in ENTRY_POINTS.items():
        if DEVICE.type != "cpu" and entry == "nemo_rl":
            continue  # its CPU-side label handling is the same on every device
        expected = _first(call(single))
        for bad in cases_for(entry):
            check.case(f"tp={tp} {entry}: {bad.name} on rank {bad_rank}")
            mine = bad.overrides(case, entry) if layout.tp_rank == bad_rank else {}
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
            # Every rank is still in step: the good call runs and matches one rank's result.
            got = _first(call(case))
            check.close(f"{entry} after a refusal", got.cpu(), expected, tol=1e-5, kind=f"tp{tp} {entry}")
    check.done()
