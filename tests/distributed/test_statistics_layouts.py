"""The description of the statistics pass over real TP groups: a term the product does not define
(a test's own Σπ³, a power-3 detached statistic) beside the entropy and Σπ², through the head's
generic forward (:func:`mcore_ppo.shard.forward`, the torch backend in small chunks), under TP 2
and 4 with SP off and on, against the single-rank result of the same dtype and, for fp32, against
fp64 from the full softmax.

Nothing between the description and the collectives knows the term: the TP combine packs it in
the same all-reduce SUM, rescaled by the cube of ``e^(m_r − M)``, so a rank's wrong factor shows
at every token whose shard maxima differ. Labels cover every shard's first and last id.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, shared_seed, tp_cp_groups
from head_cases import IGNORE, TOL_FP32_VS_FP64, TOL_SAME_DTYPE, VOCAB, draw_ids, small_chunks_backend

from mcore_ppo import shard
from mcore_ppo.options import HiddenGrad
from mcore_ppo.statistics import ENTROPY, SUM_PI_SQUARED, Statistics
from mcore_ppo_testing.extra_terms import SUM_PI_CUBED

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")

TOKENS, HIDDEN, TEMPERATURE = 32, 16, 0.7


def _forward(hidden, weight, labels, statistics, *, tp_group, hidden_grad, vocab_start) -> dict:
    result, _ = shard.forward(
        hidden, weight, labels, TEMPERATURE, None, backend=small_chunks_backend("torch"), tp_group=tp_group,
        hidden_grad=hidden_grad, ignore_index=IGNORE, vocab_start=vocab_start, vocab_size=VOCAB,
        statistics=statistics, labels_in_range=True, grad_needed=False,
    )  # fmt: skip
    out = {"log_prob": result.log_prob}
    if result.entropy is not None:
        out["entropy"] = result.entropy
    for term in statistics.detached:
        out[term.name] = result.detached[statistics.detached_names.index(term.name)]
    return out


def _fp64(hidden, weight, labels) -> dict:
    z = (hidden.double() @ weight.double().T) / TEMPERATURE
    p = torch.softmax(z, dim=1)
    valid = labels != IGNORE
    zero = torch.zeros((), dtype=torch.float64)
    log_p = torch.log_softmax(z, dim=1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return {
        "log_prob": torch.where(valid, log_p, zero),
        "entropy": torch.where(valid, -(p * torch.log_softmax(z, dim=1)).sum(1), zero),
        "sum_pi_squared": torch.where(valid, (p**2).sum(1), zero),
        "sum_pi_cubed": torch.where(valid, (p**3).sum(1), zero),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_a_new_term_combines_over_tp_as_on_one_rank(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    for dtype in (torch.float64, torch.float32):
        for entropy in (True, False):
            statistics = Statistics((*((ENTROPY,) if entropy else ()), SUM_PI_SQUARED, SUM_PI_CUBED))
            hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.float64).to(dtype).to(DEVICE)
            # Rows of different scales: the shards' maxima differ per token.
            weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64) * torch.rand(VOCAB, 1, dtype=torch.float64) * 2
            weight = weight.to(dtype).to(DEVICE)
            labels = draw_ids(TOKENS).to(DEVICE)
            single = _forward(
                hidden, weight, labels, statistics, tp_group=None, hidden_grad=HiddenGrad.PARTIAL, vocab_start=0
            )
            if layout.tp_group is None:
                continue
            rows = VOCAB // tp
            shard_weight = weight[layout.tp_rank * rows : (layout.tp_rank + 1) * rows]
            for sp in (False, True):
                check.case(f"tp={tp} sp={sp} entropy={entropy} {dtype}")
                tokens = hidden.chunk(tp, dim=0)[layout.tp_rank] if sp else hidden
                out = _forward(
                    tokens, shard_weight, labels, statistics, tp_group=layout.tp_group,
                    hidden_grad=HiddenGrad.SEQUENCE_PARALLEL if sp else HiddenGrad.PARTIAL,
                    vocab_start=layout.tp_rank * rows,
                )  # fmt: skip
                if set(out) != set(single):
                    check.fail(f"outputs {sorted(out)} != {sorted(single)}")
                for name, value in single.items():
                    check.close(name, out[name], value, tol=TOL_SAME_DTYPE[dtype], kind=f"TP{tp} statistics vs TP1")
                if dtype == torch.float32:
                    want = _fp64(hidden, weight, labels)
                    for name in out:
                        kind = f"TP{tp} statistics vs fp64"
                        check.close(name, out[name], want[name], tol=TOL_FP32_VS_FP64, kind=kind)
    check.done()
