"""verl's top-k distillation (``loss_mode="forward_kl_topk"``) on the fused head: no ``[tokens, V/tp]`` logits.

On its logits path verl's Megatron engine hands the student's vocab-parallel logits to its loss
function (``logits_processor_func(student_logits=..., data=batch, data_format=...)``, i.e.
``verl.trainer.distillation.distillation_ppo_loss``), which lays the teacher's top-k out like the
tokens (``preprocess_thd_engine``), reads ``log_prob_min_clamp`` from its config and calls
``verl.trainer.distillation.megatron.losses._VocabParallelKLDivergence.apply(student_logits,
teacher_logprobs, teacher_ids, log_prob_min_clamp)``, then checks the shapes and returns the
per-token tensors. verl's fused path never calls it (it drops ``distillation_use_topk``).

With the plugin, at the head's call site (:func:`compute_on_head`) verl's own loss function runs
as on the logits path, given a stand-in for the logits (:class:`StudentLogits`: the logits'
``[1, t]`` token shape with an empty vocab dim; any other use of it raises), and the plugin's
replacement of ``_VocabParallelKLDivergence`` (rebound by the import hook; real logits still go
to verl's) computes what verl's computes from:

- the student's ``log q`` at the teacher's ``k`` ids, with gradients: one head pass together
  with verl's own label (``[n, 1 + k]`` ids: log-prob, entropy and the ``k`` values at once);
- the student's own global top-``k`` ids (:func:`mcore_ppo.fused_topk`, no gradient).

verl's forward, per token, with ``c`` = ``log_prob_min_clamp`` (None: no clamp)::

    log p_i  = clamp_min(teacher_logprobs_i, c)            p_i = exp(log p_i)
    log q~_i = clamp_min(log q_i, c)   (no gradient where log q_i <= c)
    distillation_losses     = sum_i p_i (log p_i - log q~_i)
    student_mass            = sum_i exp(log q~_i)
    teacher_mass            = sum_i p_i
    overlap_count           = #{i : teacher_ids_i in the student's top-k ids}
    overlap_token_advantage = -sum_{i overlapping} p_i (log p_i - log q~_i) / overlap_count  (0 if none)

and its backward ``dL/dz_j = m_A q_j - p_j [j in A]`` (``A`` the unclamped ids, ``m_A`` their
teacher mass) is autograd's through the head's ``log q_i``. Outputs are fp32 (``overlap_count``
int64) ``[1, t]``, as verl's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo import validation
from mcore_ppo.distill.topk import MAX_TOPK, topk_and_statistics
from mcore_ppo.head_call import attempt, run_head, statistics_of
from mcore_ppo.options import HeadOptions, Layout
from mcore_ppo.parallel.ranks import ProcessGroup, group_size
from mcore_ppo.verdict import values_readable

__all__ = ["Student", "StudentLogits", "compute_on_head", "forward_kl_topk", "wrap_kl_divergence"]


class StudentLogits(torch.Tensor):
    """What verl's loss function gets for ``student_logits`` on the fused path: an empty
    ``[1, t, 0]`` tensor whose shape says the tokens; every other use raises (there are no logits)."""

    _ALLOWED = frozenset(
        {
            torch.Tensor.size,
            torch.Tensor.dim,
            torch.Tensor.__repr__,
            torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
            torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
            torch.Tensor.device.__get__,  # type: ignore[attr-defined]
            torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
            torch.Tensor.is_nested.__get__,  # type: ignore[attr-defined]
        }
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func not in cls._ALLOWED:
            raise RuntimeError(
                f"mcore_ppo verl plugin: verl's fused path has no student logits ({getattr(func, '__name__', func)} "
                "was called on them): the plugin runs top-k distillation only through verl's "
                "_VocabParallelKLDivergence (loss_mode='forward_kl_topk'). Set "
                "actor_rollout_ref.model.use_fused_kernels=False for a loss that needs the logits"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class Student:
    """The head's inputs at verl's call site (hidden ``[n, h]``, labels ``[n]``, a float or ``[n]``
    temperature) and, once the KL ran, its main outputs ``(log_probs, entropy, sum_pi_squared)``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    temperature: float | torch.Tensor
    tp_group: ProcessGroup | None
    layout: Layout
    options: HeadOptions
    topk_impl: str
    placeholder: StudentLogits
    main: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None


_STUDENT: ContextVar[Student | None] = ContextVar("mcore_ppo_verl_student", default=None)


def compute_on_head(
    logits_processor_func: Callable[..., Any], batch: Any, student: Student, data_format: str = "thd"
) -> dict[str, torch.Tensor]:
    """verl's ``logits_processor_func(student_logits=..., data=batch, data_format=...)`` with the
    logits replaced by the head (module doc): its dict of ``[1, t]`` tensors; ``student.main``
    then holds the head's outputs at verl's labels.

    Raises:
        RuntimeError: verl's function did not reach ``_VocabParallelKLDivergence`` (another
            loss, or a verl this plugin does not know): nothing is made up for it.
    """
    token = _STUDENT.set(student)
    try:
        out = logits_processor_func(student_logits=student.placeholder, data=batch, data_format=data_format)
    finally:
        _STUDENT.reset(token)
    if student.main is None:
        raise RuntimeError(
            "mcore_ppo verl plugin: distillation_use_topk is set, but verl's loss function did not compute the top-k "
            "KL through verl.trainer.distillation.megatron.losses._VocabParallelKLDivergence (the only top-k loss the "
            "plugin runs without logits); set actor_rollout_ref.model.use_fused_kernels=False"
        )
    if not isinstance(out, dict):
        raise TypeError(f"verl's logits_processor_func returned {validation.type_name(out)}, not a dict of tensors")
    return out


def wrap_kl_divergence(original: Any) -> Any:
    """The replacement of ``_VocabParallelKLDivergence``: ``apply`` on :class:`StudentLogits`
    runs on the head, on real logits it is verl's."""
    return _KLDivergenceOnHead(original)


class _KLDivergenceOnHead:
    def __init__(self, original: Any) -> None:
        self._original = original

    def apply(self, vp_logits: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(vp_logits, StudentLogits):
            return self._original.apply(vp_logits, *args, **kwargs)
        student = _STUDENT.get()
        if student is None or vp_logits is not student.placeholder:
            raise RuntimeError("mcore_ppo verl plugin: student logits stand-in used outside its head call")
        return forward_kl_topk(student, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The KL on the head
# ---------------------------------------------------------------------------------------------


def forward_kl_topk(
    student: Student,
    target_topk_logps: torch.Tensor,
    target_topk_indices: torch.Tensor,
    log_prob_min_clamp: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_VocabParallelKLDivergence.forward``'s five outputs (module doc) from the head; sets
    ``student.main``. Every argument error is shared over the TP group, before any collective.

    Raises:
        TypeError: teacher ids not integer, teacher log-probs not floating point, a clamp that is
            not a real number.
        ValueError: teacher tensors not ``[1, t, k]`` for the call's ``t`` tokens, their ``k``
            unequal or outside ``[1, MAX_TOPK]`` / above the vocab size, teacher ids outside
            ``[0, V)`` (read where that is free, CPU tensors with ``validate`` on; elsewhere such
            an id's slot gets a NaN ``log q`` and its token NaN outputs, whatever the head's
            ``ignore_index``), a non-finite clamp, an ``ignore_index`` inside ``[0, V)`` (a
            teacher id equal to it could not be told from an ignored slot).
    """
    n = student.labels.shape[0]
    vocab = student.weight.shape[0] * group_size(student.tp_group)
    checked, error = attempt(
        functools.partial(
            _checked_teacher, target_topk_logps, target_topk_indices, log_prob_min_clamp, n, vocab, student
        ),
        None,
    )
    # The student's own top-k first: its pass over the logits also reduces the head's statistics
    # of each token (lse, and the entropy and Σπ² when asked for), which the head's ids pass then
    # takes instead of a statistics pass of its own: one pass over the vocab in the forward, not
    # two. A refused teacher argument is shared at that pass's verdict, before any of its
    # collectives, so every TP rank raises there (the refused rank's k of 1 is never used).
    k = 1 if checked is None else checked[1].shape[1]
    top, given_statistics = topk_and_statistics(
        student.hidden, student.weight, k, statistics=statistics_of(student.options),
        temperature=student.temperature, tp_group=student.tp_group, impl=student.topk_impl,
        validate=student.options.validate, prior_error=error,
    )  # fmt: skip
    if checked is None:  # not reached: the shared verdict raised this rank's refusal
        raise error if error is not None else RuntimeError("teacher inputs refused")
    teacher_logps, teacher_ids, clamp = checked
    ids = torch.cat([student.labels[:, None], teacher_ids], dim=1)
    outputs = run_head(
        student.hidden, student.weight, ids, student.temperature, student.options, tp_group=student.tp_group,
        layout=student.layout, ids=True, given_statistics=given_statistics,
    )  # fmt: skip
    log_probs, entropy, *rest = outputs
    # verl's kernel contract: fp32 log-probs and entropy (the k-ids pass gives fp64 for fp64 inputs).
    student.main = (log_probs[:, 0].float(), None if entropy is None else entropy.float(), rest[0] if rest else None)
    student_logps, bad_ids = log_probs[:, 1:], None
    if not _ids_read(student, teacher_ids):
        # A teacher id is a vocab id or a bad one, never "ignored": one equal to the head's
        # ignore_index would otherwise come back as log q = 0, a plausible number.
        bad_ids = (teacher_ids < 0) | (teacher_ids >= vocab)
        student_logps = student_logps.masked_fill(bad_ids, math.nan)
    out = _kl_outputs(student_logps, teacher_logps, teacher_ids, top.ids, clamp)
    if bad_ids is not None:
        # The advantage sums the overlapping ids only, which a bad id never is.
        out = (*out[:4], out[4].masked_fill(bad_ids.any(dim=1), math.nan))
    return tuple(x.reshape(1, n) for x in out)  # type: ignore[return-value]


def _checked_teacher(
    logps: object, ids: object, clamp: object, n: int, vocab: int, student: Student
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """The teacher's ``([n, k] log-probs, [n, k] int64 ids, clamp)`` on the hidden's device, checked."""
    ids = validation.check_tensor("teacher_ids", ids)
    logps = validation.check_tensor("teacher_logprobs", logps)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"teacher_ids must be an integer tensor, got {ids.dtype}")
    if not logps.dtype.is_floating_point:
        raise TypeError(f"teacher_logprobs must be a floating-point tensor, got {logps.dtype}")
    if ids.dim() != 3 or ids.shape[:2] != (1, n):
        raise ValueError(
            f"teacher_ids must be [1, {n}, k] on this rank (the call's {n} tokens, laid out like them), got "
            f"{list(ids.shape)}"
        )
    if logps.shape != ids.shape:
        raise ValueError(
            f"teacher_logprobs {list(logps.shape)} and teacher_ids {list(ids.shape)} must have the same shape "
            "(the same k per token)"
        )
    k = ids.shape[-1]
    if 0 <= student.options.ignore_index < vocab:
        raise ValueError(
            f"ignore_index={student.options.ignore_index} is a vocab id: top-k distillation needs one outside "
            f"[0, {vocab}), so that no teacher id is taken for an ignored slot"
        )
    if not 1 <= k <= min(MAX_TOPK, vocab):
        raise ValueError(f"teacher_ids: k must be in [1, {min(MAX_TOPK, vocab)}] (MAX_TOPK, vocab size), got {k}")
    if clamp is not None:
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
            raise TypeError(f"log_prob_min_clamp must be a float or None, got {validation.type_name(clamp)}")
        if not math.isfinite(clamp):
            raise ValueError(f"log_prob_min_clamp must be finite, got {clamp}")
        clamp = float(clamp)
    device = student.hidden.device
    ids = ids.reshape(n, k).to(device=device, dtype=torch.int64)
    logps = logps.reshape(n, k).to(device=device)
    if n and _ids_read(student, ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"teacher_ids must be in [0, {vocab}) (the vocab size), got values in [{low}, {high}]")
    return logps, ids, clamp


def _ids_read(student: Student, ids: torch.Tensor) -> bool:
    """Whether the teacher ids' values are read (and a bad one refused): ``validate`` on, where
    reading costs no host sync (docs/design.md §5)."""
    return student.options.validate and values_readable(ids)


def _kl_outputs(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_top_ids: torch.Tensor,
    clamp: float | None,
) -> tuple[torch.Tensor, ...]:
    """verl's per-token outputs (module doc) from ``[n, k]`` student/teacher log-probs at the
    teacher's ids and the student's ``[n, k]`` top ids."""
    dtype = student_logps.dtype
    teacher = teacher_logps
    if clamp is not None:
        teacher = teacher.clamp_min(clamp)  # in the teacher's dtype, then fp32: verl's order
        # No gradient where the student's log-prob is clamped (verl's active mask: log q > c).
        student_logps = torch.where(student_logps > clamp, student_logps, student_logps.new_full((), clamp))
    teacher = teacher.float().to(dtype)
    p = teacher.exp()
    per_id = p * (teacher - student_logps)
    loss = per_id.sum(dim=-1)
    student_mass = student_logps.detach().exp().sum(dim=-1)
    teacher_mass = p.sum(dim=-1)
    # Membership of each teacher id in the student's top ids: a search in the sorted row ([n, k]
    # memory, not the [n, k, k] of an all-pairs comparison).
    top_sorted = student_top_ids.sort(dim=-1).values.contiguous()
    where = torch.searchsorted(top_sorted, teacher_ids.contiguous()).clamp_(max=top_sorted.shape[-1] - 1)
    overlap = top_sorted.gather(-1, where) == teacher_ids
    overlap_count = overlap.sum(dim=-1)
    advantage = (-per_id.detach() * overlap).sum(dim=-1) / overlap_count.clamp_min(1)
    advantage = torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage))
    return loss.float(), student_mass.float(), teacher_mass.float(), overlap_count, advantage.float()
