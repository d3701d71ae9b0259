"""The description of the statistics pass (:mod:`mcore_ppo.statistics`) against fp64.

Its merge is checked over random partitions of the vocabulary, taken in random order, empty
parts included, at logit scales from 1e-3 to 1e4; its finish against the fp64 softmax; its
plane layout against the kernels' constexprs; and a term the product does not define (a test's
own) runs through the head's generic forward with nothing in between knowing it.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo import shard
from mcore_ppo.backends.torch_backend import TorchBackend, TorchConfig
from mcore_ppo.options import HiddenGrad
from mcore_ppo.statistics import DEFAULT, ENTROPY, SUM_EXP, SUM_PI_SQUARED, TERMS, Statistics
from mcore_ppo_testing.extra_terms import SUM_PI_CUBED
from mcore_ppo_testing.seeds import generator, next_seed

ALL = Statistics.named(["entropy", "sum_pi_squared"])


def _fp64_values(z: torch.Tensor) -> dict[str, torch.Tensor]:
    z = z.double()
    lse = z.logsumexp(dim=1)
    p = torch.softmax(z, dim=1)
    return {"lse": lse, "entropy": -(p * (z - lse[:, None])).sum(dim=1), "sum_pi_squared": (p * p).sum(dim=1)}


def _partition(v: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random disjoint column sets covering ``range(v)`` (some empty), in random order."""
    parts = int(torch.randint(1, 7, (1,), generator=gen))
    owner = torch.randint(0, parts + 1, (v,), generator=gen)  # part `parts` stays empty unless drawn
    order = torch.randperm(parts + 1, generator=gen).tolist()
    return [torch.nonzero(owner == k).flatten() for k in order]


def _part(statistics: Statistics, z: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cols.numel() == 0:  # an empty part: (-inf, 0)
        n = z.shape[0]
        return torch.full((n,), -math.inf), torch.zeros(len(statistics.sums), n)
    return statistics.chunk(z[:, cols])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e4])
@pytest.mark.parametrize("names", [[], ["entropy"], ["sum_pi_squared"], ["sum_pi_squared", "entropy"]])
def test_merge_of_any_partition_matches_fp64(scale, names):
    """Parts merged in any order give the whole vocabulary's ``lse``, entropy and Σπ² to fp32
    rounding (relative to ``lse``'s size for the log-normaliser)."""
    statistics = Statistics.named(names)
    for _ in range(4):
        gen = generator(next_seed())
        n, v = 9, int(torch.randint(1, 300, (1,), generator=gen))
        z = torch.randn(n, v, generator=gen) * scale
        z[0] = 0.5  # equal logits everywhere
        running = None
        for cols in _partition(v, gen):
            part = _part(statistics, z, cols)
            running = part if running is None else statistics.merge(running, part)
        lse, values = statistics.finish(*running)
        want = _fp64_values(z)
        assert set(values) == set(names)
        torch.testing.assert_close(lse.double(), want["lse"], rtol=2e-6, atol=2e-6)
        for name in names:
            torch.testing.assert_close(values[name].double(), want[name], rtol=2e-5, atol=2e-6, msg=name)


def test_rescale_of_an_empty_part_is_zero_and_never_nan():
    """A part with no entries (``m = -inf``, ``S = 0``) contributes exact zeros, even against a
    global max of ``-inf`` (where the shift is NaN)."""
    m = torch.tensor([-math.inf, -math.inf, 2.0])
    sums = torch.tensor([[0.0, 0.0, 3.0], [0.0, 0.0, -1.0], [0.0, 0.0, 2.0]])
    new_max = torch.tensor([-math.inf, 5.0, 4.0])
    got = ALL.rescale(m, sums, new_max)
    assert not got.isnan().any()
    assert torch.equal(got[:, :2], torch.zeros(3, 2))
    f = math.exp(-2.0)
    torch.testing.assert_close(got[:, 2], torch.tensor([3 * f, (-1 + 3 * -2.0) * f, 2 * f * f]))


def test_combine_on_one_rank_is_the_identity():
    gen = generator(next_seed())
    m, sums, y = torch.randn(5, generator=gen), torch.rand(3, 5, generator=gen), torch.randn(5, generator=gen)
    out = ALL.combine(m, sums, y, None)
    assert out[0] is m and out[1] is sums and out[2] is y


def test_names_keys_and_planes():
    """One object per set of names whatever their order; the key round-trips; the planes (and so
    the kernels' constexprs and the detached rows) follow :data:`TERMS` order."""
    assert Statistics.named(["sum_pi_squared", "entropy"]) is ALL
    assert Statistics.from_key(ALL.key) is ALL and ALL.key == "entropy,sum_pi_squared"
    assert Statistics() == DEFAULT and DEFAULT.entropy and DEFAULT.detached == ()
    assert ALL.sums == (SUM_EXP, ENTROPY, SUM_PI_SQUARED) and ALL.n_planes == 4
    assert ALL.kernel_options() == {"U_PLANE": 2, "Q_PLANE": 3}
    assert DEFAULT.kernel_options() == {"U_PLANE": 2, "Q_PLANE": 0}
    only_q = Statistics.named(["sum_pi_squared"])
    assert only_q.kernel_options() == {"U_PLANE": 0, "Q_PLANE": 2} and not only_q.entropy
    assert only_q.output_options() == {"Q_OUT": 0} and only_q.detached == (SUM_PI_SQUARED,)
    assert Statistics.named([]).n_planes == 2 and Statistics.named([]).key == ""
    assert list(TERMS) == ["entropy", "sum_pi_squared"]
    for bad in (["entropy", "nope"], ["sum_exp"]):
        with pytest.raises(ValueError, match="unknown term"):
            Statistics.named(bad)
    with pytest.raises(ValueError, match="unknown term"):
        Statistics.from_key("entropy,sum_pi_squared,cube")


def test_detached_outputs_clamp_to_the_exact_range_and_zero_ignored_tokens():
    values = {"entropy": torch.zeros(4), "sum_pi_squared": torch.tensor([1.0 + 1e-6, 1e-9, math.nan, 0.5])}
    valid = torch.tensor([True, True, True, False])
    out = ALL.detached_outputs(values, valid, vocab_size=100)
    assert out.shape == (1, 4)
    assert out[0, 0] == 1.0 and out[0, 1] == pytest.approx(0.01) and out[0, 2].isnan() and out[0, 3] == 0.0
    assert ALL.detached_names == ("sum_pi_squared",)
    assert DEFAULT.detached_outputs(values, valid, 100) is None


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
def test_a_new_term_runs_through_the_generic_forward(entropy):
    """The test's own Σπ³ beside Σπ² (and the entropy or not), over two vocab shards merged as
    the TP combine merges them and over the whole vocabulary in small chunks, against fp64."""
    statistics = Statistics((*((ENTROPY,) if entropy else ()), SUM_PI_SQUARED, SUM_PI_CUBED))
    gen = generator(next_seed())
    n, h, v = 23, 16, 97
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) * 0.7
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = -100
    backend = TorchBackend(TorchConfig(token_chunk=8, vocab_chunk=13))
    result, _ = shard.forward(
        hidden, weight, labels, 0.8, None, backend=backend, tp_group=None, hidden_grad=HiddenGrad.PARTIAL,
        ignore_index=-100, vocab_start=0, vocab_size=v, statistics=statistics, labels_in_range=True,
        grad_needed=False,
    )  # fmt: skip
    valid = labels != -100
    z = (hidden.double() @ weight.double().T) / 0.8
    p = torch.softmax(z, dim=1)
    want = {"sum_pi_squared": (p**2).sum(1), "sum_pi_cubed": (p**3).sum(1)}
    assert result.detached.shape == (2, n)
    for name, expected in want.items():
        got = result.detached[statistics.detached_names.index(name)].double()
        torch.testing.assert_close(got[valid], expected[valid], rtol=2e-5, atol=1e-7, msg=name)
        assert (got[~valid] == 0).all()
    assert (result.entropy is not None) == entropy
    # Two shards, each one rank's statistics, merged by the combine's rule.
    split = 41
    local = torch.full((n,), -1)
    halves = [backend.shard_statistics(hidden, w, local, valid, 0.8, grad_needed=False, statistics=statistics)
              for w in (weight[:split], weight[split:])]  # fmt: skip
    merged = statistics.merge(*((half.m, half.sums) for half in halves))
    _, values = statistics.finish(*merged)
    for name, expected in want.items():
        torch.testing.assert_close(values[name].double()[valid], expected[valid], rtol=2e-5, atol=1e-7, msg=name)


def test_the_triton_kernels_refuse_a_term_they_do_not_reduce():
    """A term without kernel constexprs never reaches the triton kernels' plan (its plane would
    never be written): a ValueError naming it, before any launch."""
    from mcore_ppo.backends.triton_config import TritonConfig
    from mcore_ppo.backends.triton_host import GemmConfig
    from mcore_ppo.backends.triton_plan import LaunchPlan

    statistics = Statistics((ENTROPY, SUM_PI_CUBED))
    with pytest.raises(ValueError, match="sum_pi_cubed"):
        statistics.kernel_options()
    hidden, weight = torch.zeros(4, 8), torch.zeros(10, 8)
    with pytest.raises(ValueError, match="sum_pi_cubed"):
        LaunchPlan.build(TritonConfig(), GemmConfig(), hidden, weight, False, statistics, False)
    assert ALL.kernel_options() and LaunchPlan.build(TritonConfig(), GemmConfig(), hidden, weight, False, ALL, False)
