"""The top-k selection's tie rule (:func:`mcore_ppo.parallel.topk.select_topk`): fp32 values go
through one int64 order key per entry and ``torch.topk``, other dtypes through two sorts. Both
must keep the same entries in the same order (larger value first, equal values by smaller id),
and drop the same values, on rows full of ties, signed zeros, infinities and subnormals."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_ppo.parallel.topk import fold_into_statistics, select_topk
from mcore_ppo_testing.seeds import generator, next_seed


def _rows(n: int, c: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values drawn from a few levels (many exact ties), with -0/+0, ±inf and subnormals
    mixed in, and distinct ids per row spread over a 2^31 vocabulary's range."""
    levels = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 1.5, -2.5, 3e38, -3e38, 1e-45, -1e-45, 1e-40, math.inf, -math.inf, 7.25, -7.25]
    )
    values = levels[torch.randint(0, len(levels), (n, c), generator=gen)]
    noisy = torch.rand(n, c, generator=gen) < 0.3
    values = torch.where(noisy, torch.randn(n, c, generator=gen) * 10, values).float()
    stride = ((1 << 31) - 1) // (4 * c)  # ids up to 2^31: the key's low half must hold them
    ids = torch.stack([torch.randperm(4 * c, generator=gen)[:c] * stride for _ in range(n)])
    return values, ids + torch.randint(0, stride, (n, 1), generator=gen)


@pytest.mark.parametrize("n,c,k", [(64, 16, 5), (32, 64, 63), (16, 1024, 128), (8, 200, 1), (4, 12, 12), (4, 12, 40)])
def test_fp32_keys_keep_the_sorts_entries(n, c, k):
    seed = next_seed()
    values, ids = _rows(n, c, generator(seed))
    top_values, top_ids, dropped = select_topk(values, ids, k)
    ref_values, ref_ids, ref_dropped = select_topk(values.double(), ids, k)  # the two sorts
    kept = min(k, c)
    assert top_values.dtype == torch.float32 and top_ids.dtype == ids.dtype, seed
    assert top_values.shape == top_ids.shape == (n, kept), seed
    assert torch.equal(top_ids, ref_ids), f"seed {seed}: ids differ from the sorts'"
    assert torch.equal(top_values.double(), ref_values), f"seed {seed}: values differ"
    if kept < c:  # -0 and +0 are one value for the tie rule; the key path returns +0
        assert not torch.signbit(top_values[top_values == 0]).any(), seed
    # The dropped values are the same multiset (fp32: -inf where an entry was kept).
    finite_drop = dropped[dropped > -math.inf].double().sort().values
    assert torch.equal(finite_drop, ref_dropped[ref_dropped > -math.inf].sort().values), seed
    # So a log-sum-exp or a fold over them gives the same bits.
    m0, s0 = torch.full((n,), -math.inf, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    finite = torch.isfinite(values).all(dim=1)
    if finite.any():
        got = fold_into_statistics(m0[finite], s0[finite], dropped[finite].double())
        want = fold_into_statistics(m0[finite], s0[finite], ref_dropped[finite])
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0, msg=f"seed {seed}")


def test_kth_entry_ties_are_broken_by_id():
    """Six equal values around the cut: the smaller ids are kept, whatever their positions."""
    values = torch.tensor([[2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]])
    ids = torch.tensor([[10, 95, 12, 4, 3, 50, 11, 7]])
    top_values, top_ids, dropped = select_topk(values, ids, 4)
    assert top_ids.tolist() == [[4, 10, 3, 7]] and top_values.tolist() == [[3.0, 2.0, 1.0, 1.0]]
    assert sorted(v for v in dropped[0].tolist() if v > -math.inf) == [1.0] * 4
