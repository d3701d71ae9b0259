"""A statistic the product does not define, for tests of the description of the statistics pass
(:mod:`mcore_ppo.statistics`): with only its :class:`~mcore_ppo.statistics.Term` written, the torch
path reduces it, merges it over vocab chunks and combines it over TP ranks."""

from __future__ import annotations

from mcore_ppo.statistics import Term

#: ``Σ_v π_v³`` per token: the cube of each probability summed, a power-3 rescale, detached,
#: in ``[1/V², 1]``. No kernel constexprs: the triton kernels refuse it.
SUM_PI_CUBED = Term(
    "sum_pi_cubed", 3, False,
    of_chunk=lambda e, d: (e * e * e).sum(dim=1),
    finish=lambda c, s, log_s: c / (s * s * s),
    bounds=lambda vocab_size: (1.0 / vocab_size**2, 1.0),
    detached=True,
)  # fmt: skip
