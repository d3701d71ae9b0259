"""What the head's statistics pass reduces per token: one description, its merge and its combine.

Per token, over one part of the vocab (a kernel's vocab split, a torch chunk, a TP shard) with
tempered logits ``z``, the pass keeps the part's max ``m`` and a list of sums relative to it, its
:class:`Term` s. Every part's sums have the same form, so one rule merges two parts and the TP
combine is the same rule over ranks (``M`` the larger max):

=================  ============================  ==========  ===============================
term               sum relative to ``m``          rescale     value from ``(X, S)`` at ``M``
=================  ============================  ==========  ===============================
``sum_exp``        ``S = Σ e^(z-m)``              ``·f``      ``lse = M + log S``
``entropy``        ``U = Σ e^(z-m)·(z-m)``        ``(U + S·(m-M))·f``  ``H = log S - U/S``
``sum_pi_squared`` ``Q = Σ e^(2(z-m))``           ``·f²``     ``Σπ² = Q / S²`` (detached)
=================  ============================  ==========  ===============================

with ``f = e^(m-M)`` (0 for an empty part, ``S = 0``). ``U`` is kept relative to the part's
own max: for logits near 1e4 the absolute ``Σ e^(z-m)·z`` makes ``H`` a difference of two
numbers near 1e4 and loses three digits. ``Q ≥ 1`` and ``S ≥ 1`` at the global max (the
argmax contributes 1 to each), so nothing under- or overflows.

A :class:`Statistics` is the ordered set of terms one call asks for (``sum_exp`` always; the
others by name, :data:`TERMS`). Everything between the head's options and the kernels carries
that one object (the ops carry its :attr:`Statistics.key`): the planes of the packed buffers, the
Triton kernels' plane constexprs (:meth:`Statistics.kernel_options`), the torch reference's
sums (:meth:`Statistics.chunk`), the merge, the TP combine's packing and the finish come from
it. A new statistic is a :class:`Term` here and its lines in the Triton kernels
(:mod:`mcore_ppo.kernels.forward`), nothing in between.

Packed layout, shared by the torch path and the kernels: ``[planes, n]`` fp32, plane 0 the max
(a backend's partials) or the label logit (the TP combine's SUM), then one plane per term in
:attr:`Statistics.sums` order, so ``sum_exp`` is plane 1. Detached outputs come back as
``[len(detached), n]`` in :attr:`Statistics.detached` order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from mcore_ppo.parallel.combine import reduce_shard_statistics, rescale_factor
from mcore_ppo.parallel.ranks import ProcessGroup, group_size


@dataclass(frozen=True)
class Term:
    """One per-token sum of the statistics pass, relative to its part's max ``m``.

    Attributes:
        name: the option's name (:data:`TERMS`), and the key in :meth:`Statistics.finish`.
        power: re-expressed relative to ``M ≥ m`` the sum scales by ``e^(power·(m - M))``.
        shifted: a sum of ``e^(z-m)·(z-m)``: relative to ``M`` it first gains ``S·(m - M)``.
        of_chunk: the torch reference's sum over a block of logits, from ``e = e^(z-m)`` and
            ``z - m`` (both ``[rows, cols]``) to ``[rows]``.
        finish: its value from the sum ``X`` and ``S`` (both at the global max) and ``log S``.
        bounds: a detached output's exact range for a vocabulary of ``V`` (its clamp: rounding
            can step a hair outside). The entropy is the head's own output, clamped with it.
        detached: the head outputs its value without gradient (a weight or a diagnostic,
            never a loss), in :meth:`Statistics.detached_outputs`.
        kernel_plane: the Triton kernels' constexpr that holds its plane (0: not reduced); None
            for ``sum_exp``, which is always plane 1.
        kernel_output: the finish kernels' constexpr that holds its row among the detached
            outputs.
    """

    name: str
    power: int
    shifted: bool
    of_chunk: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    finish: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
    bounds: Callable[[int], tuple[float, float]] | None = None
    detached: bool = False
    kernel_plane: str | None = None
    kernel_output: str | None = None


SUM_EXP = Term("sum_exp", 1, False, lambda e, d: e.sum(dim=1), None)
ENTROPY = Term(
    "entropy", 1, True,
    of_chunk=lambda e, d: (e * d).sum(dim=1),
    # H = -Σ p (z - lse) = lse - E[z] = log S - U / S   (U relative to the global max)
    finish=lambda u, s, log_s: log_s - u / s,
    kernel_plane="U_PLANE",
)  # fmt: skip
SUM_PI_SQUARED = Term(
    "sum_pi_squared", 2, False,
    of_chunk=lambda e, d: (e * e).sum(dim=1),
    # Σ π² = Σ e^(2(z - M)) / S² = Q / S²   (Q and S relative to the global max)
    finish=lambda q, s, log_s: q / (s * s),
    bounds=lambda vocab_size: (1.0 / vocab_size, 1.0),
    detached=True,
    kernel_plane="Q_PLANE",
    kernel_output="Q_OUT",
)  # fmt: skip

#: The terms a call may ask for, by name, in their canonical plane order.
TERMS: dict[str, Term] = {term.name: term for term in (ENTROPY, SUM_PI_SQUARED)}


@dataclass(frozen=True)
class Statistics:
    """The terms one statistics pass reduces: ``sum_exp`` and ``optional`` (in :data:`TERMS`
    order). Frozen and hashable: part of plan keys. Build it with :meth:`named`.

    Attributes:
        optional: the terms beyond ``sum_exp``, in plane order.
        key: their names joined by commas (what the ops carry).
        sums: every term in plane order, ``sum_exp`` first.
        n_planes: planes of a packed buffer: the max (or the label logit), then one per term.
        entropy: the entropy term is reduced (the head outputs it and differentiates it).
        detached: the detached terms, in the order of their output rows.
        detached_names: their names, in that order (``detached_names.index(name)`` is a term's
            row among the detached outputs).
    """

    optional: tuple[Term, ...] = (ENTROPY,)
    # Derived once here, not as cached properties: a compiled region reads them as constants
    # (functools.cached_property takes a lock that dynamo cannot enter).
    # Attributes rather than properties too: a head call reads them without a Python frame here.
    key: str = field(init=False, compare=False, repr=False)
    sums: tuple[Term, ...] = field(init=False, compare=False, repr=False)
    n_planes: int = field(init=False, compare=False, repr=False)
    entropy: bool = field(init=False, compare=False, repr=False)
    detached: tuple[Term, ...] = field(init=False, compare=False, repr=False)
    detached_names: tuple[str, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        detached = tuple(term for term in self.optional if term.detached)
        object.__setattr__(self, "key", ",".join(term.name for term in self.optional))
        object.__setattr__(self, "sums", (SUM_EXP, *self.optional))
        object.__setattr__(self, "n_planes", 2 + len(self.optional))
        object.__setattr__(self, "entropy", ENTROPY in self.optional)
        object.__setattr__(self, "detached", detached)
        object.__setattr__(self, "detached_names", tuple(term.name for term in detached))

    @staticmethod
    def named(names: Iterable[str]) -> Statistics:
        """The statistics of the terms ``names`` (any order; ``sum_exp`` is always there)."""
        return Statistics.from_key(",".join(sorted(set(names), key=_canonical_order)))

    @staticmethod
    @functools.cache
    def from_key(key: str) -> Statistics:
        """The statistics of :attr:`key` (the ops' string argument)."""
        names = [name for name in key.split(",") if name]
        unknown = [name for name in names if name not in TERMS]
        if unknown:
            raise ValueError(f"statistics: unknown term(s) {unknown}; known: {sorted(TERMS)}")
        return Statistics(tuple(TERMS[name] for name in names))

    def kernel_options(self) -> dict[str, int]:
        """Every known term's plane constexpr: its plane, or 0 where it is not asked for.
        ValueError for a term the kernels do not reduce (no ``kernel_plane``, or a detached one
        without ``kernel_output``): its plane would never be written."""
        missing = [
            term.name for term in self.optional
            if term.kernel_plane is None or (term.detached and term.kernel_output is None)
        ]  # fmt: skip
        if missing:
            raise ValueError(
                f"statistics: the triton kernels reduce no term {missing}: a term they reduce names its "
                "kernel_plane (and, when detached, its kernel_output); use the torch backend for it"
            )
        planes = {term: 1 + index for index, term in enumerate(self.sums)}
        return {term.kernel_plane: planes.get(term, 0) for term in TERMS.values() if term.kernel_plane}

    def output_options(self) -> dict[str, int]:
        """The finish kernels' output-row constexprs of the detached terms (0 for one not asked for)."""
        rows = {term: row for row, term in enumerate(self.detached)}
        return {term.kernel_output: rows.get(term, 0) for term in TERMS.values() if term.kernel_output}

    def chunk(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m [rows], sums [terms, rows])`` of a block of tempered logits ``z [rows, cols]``
        (the torch reference's pass)."""
        m = z.amax(dim=1)
        shifted = z - m[:, None]
        e = torch.exp(shifted)
        return m, torch.stack([term.of_chunk(e, shifted) for term in self.sums])

    def rescale(self, m: torch.Tensor, sums: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
        """``sums [terms, n]`` taken relative to ``m`` re-expressed relative to ``new_max ≥ m``.
        A part with no entries (``m = -inf``, ``S = 0``) contributes exactly zero."""
        scale = rescale_factor(m, sums[0], new_max)
        rows = []
        for term, total in zip(self.sums, sums, strict=True):
            if term.shifted:
                # m - new_max is <= 0, or NaN where both are -inf (an empty part: masked).
                total = total + sums[0] * (m - new_max).masked_fill(sums[0] == 0, 0.0)
            factor = scale
            for _ in range(term.power - 1):
                factor = factor * scale
            rows.append(total * factor)
        return torch.stack(rows)

    def merge(
        self, a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two parts' ``(m, sums)`` over disjoint vocab merged into one (online softmax)."""
        new_max = torch.maximum(a[0], b[0])
        return new_max, self.rescale(*a, new_max) + self.rescale(*b, new_max)

    def combine(
        self, m: torch.Tensor, sums: torch.Tensor, label_logit: torch.Tensor, tp_group: ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(M, sums at M, label_logit)`` over the TP group: the all-reduce MAX of ``m``, then
        one all-reduce SUM of ``[label_logit, *sums]`` rescaled to ``M`` (each rank holds its
        label logit or 0). One rank: its statistics as they are."""
        if group_size(tp_group) == 1:
            # Rescaling to its own max is the identity (~10 small kernels per call); nothing to reduce.
            return m, sums, label_logit

        def packed_relative_to(global_max: torch.Tensor) -> torch.Tensor:
            return torch.cat([label_logit[None], self.rescale(m, sums, global_max)])

        global_max, packed = reduce_shard_statistics(m.clone(), packed_relative_to, tp_group)
        return global_max, packed[1:], packed[0]

    def finish(self, global_max: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(lse, {name: value})`` of the optional terms, from their sums at the global max
        (unclamped: :meth:`detached_outputs` clamps the detached ones)."""
        sum_exp = sums[0]
        log_sum_exp = torch.log(sum_exp)
        values = {
            term.name: term.finish(total, sum_exp, log_sum_exp)
            for term, total in zip(self.optional, sums[1:], strict=True)
        }
        return global_max + log_sum_exp, values

    def finished(self, lse: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """:meth:`finish`'s result as one tensor ``[1 + len(optional), n]``: ``lse``, then each
        optional term's value in plane order (what another pass over the same logits hands
        the head, :meth:`from_finished`)."""
        return torch.stack([lse, *(values[term.name] for term in self.optional)])

    def from_finished(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(lse, {name: value})`` back from :meth:`finished`'s rows."""
        return rows[0], {term.name: row for term, row in zip(self.optional, rows[1:], strict=True)}

    def detached_outputs(
        self, values: dict[str, torch.Tensor], valid: torch.Tensor, vocab_size: int
    ) -> torch.Tensor | None:
        """The detached terms' outputs ``[len(detached), n]``, each clamped to its exact range
        (NaN stays NaN) and 0 for ignored tokens; None when there are none."""
        if not self.detached:
            return None
        rows = []
        for term in self.detached:
            low, high = term.bounds(vocab_size)
            rows.append(torch.where(valid, values[term.name].clamp(min=low, max=high), 0.0))
        return torch.stack(rows)


def _canonical_order(name: str) -> int:
    if name not in TERMS:
        raise ValueError(f"statistics: unknown term {name!r}; known: {sorted(TERMS)}")
    return list(TERMS).index(name)


#: The default pass: ``sum_exp`` and the entropy.
DEFAULT = Statistics.named(["entropy"])
