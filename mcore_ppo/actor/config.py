"""The actor's options: :class:`PPOActorConfig` (names as in verl's actor config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LOSS_AGG_MODES", "TOPK_KL_MODES", "PPOActorConfig", "check_loss_agg_mode"]

# The option values are defined here, not beside the losses that use them (ppo_loss, distill_loss
# import them from here), so that the config imports without torch: scripts/launch.sh checks a
# demo config before torchrun, and a refusal should not cost a torch import.
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
TOPK_KL_MODES: tuple[str, ...] = ("tail_bucket", "renormalized")

# mcore_ppo.distill.MAX_TOPK, repeated so that the config imports without the kernels (the demo
# launcher checks configs before torchrun); tests/actor checks that the two agree.
_MAX_TOPK = 128


def check_loss_agg_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`LOSS_AGG_MODES`; TypeError for a non-str, else ValueError."""
    if not isinstance(mode, str):
        raise TypeError(f"loss_agg_mode must be a str, one of {LOSS_AGG_MODES}, got {type(mode).__name__}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    return mode


def _check_number(name: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a finite int or float (a bool is not), or None where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_int(name: str, value: object, *, least: int | None = None, optional: bool = False) -> None:
    """``value`` is an int (a bool is not) of at least ``least``, or None where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")


@dataclass
class PPOActorConfig:
    """Options of :class:`~mcore_ppo.actor.MegatronPPOActor` (names as in verl's actor config).

    Attributes:
        clip_ratio: PPO clip ``ε`` (both sides unless overridden below).
        clip_ratio_low, clip_ratio_high: asymmetric clip (ratio in ``[1 - low, 1 + high]``);
            None = ``clip_ratio``.
        clip_ratio_c: dual-clip constant (> 1) bounding the loss of negative-advantage tokens;
            None = off.
        entropy_coeff: weight of the entropy bonus (``loss = pg_loss - entropy_coeff · entropy``).
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-sum"`` or ``"seq-mean-token-mean"``.
        max_grad_norm: clip the global gradient norm to this (None = no clipping; the norm is
            still reported).
        temperature: sampling temperature the log-probs are taken at.
        micro_batch_size: sequences per micro-batch (exclusive with ``max_tokens_per_micro_batch``).
        max_tokens_per_micro_batch: padded-token budget per micro-batch (dynamic batch size).
        ignore_index: label value of positions not trained on.
        pad_token_id: token id used to pad sequences to the packing alignment.
        distill_coeff: weight of the distillation loss, the forward ``KL(teacher ‖ student)``
            over the teacher's top-k ids per response token
            (:func:`~mcore_ppo.actor.distill_loss.topk_forward_kl`), aggregated by
            ``loss_agg_mode``: ``loss = pg_loss - entropy_coeff · entropy + distill_coeff · kl``.
            0 (default): off. When > 0, ``update_policy`` needs the teacher's top-k
            (``teacher=``; :meth:`~mcore_ppo.actor.MegatronPPOActor.compute_teacher_topk`
            computes it from a teacher model).
        distill_topk: ``k``, the teacher's ids per token that ``compute_teacher_topk`` keeps
            (``1 <= k <= 128``, ``mcore_ppo.distill.MAX_TOPK``).
        distill_kl_mode: ``"tail_bucket"`` (default: the top-k plus one bucket for the rest)
            or ``"renormalized"`` (both distributions renormalised on the top-k).
        policy_loss: False drops the PPO terms (pure distillation: the rollout then needs no
            ``advantages`` or ``old_log_probs``); needs ``distill_coeff > 0``.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    micro_batch_size: int | None = 4
    max_tokens_per_micro_batch: int | None = None
    ignore_index: int = -100
    pad_token_id: int = 0
    distill_coeff: float = 0.0
    distill_topk: int = 64
    distill_kl_mode: str = "tail_bucket"
    policy_loss: bool = True

    def __post_init__(self) -> None:
        # Types first (a string from a config file would otherwise fail inside a comparison or,
        # for a coefficient, only in the loss), then each option's range.
        for name in ("clip_ratio", "entropy_coeff", "temperature", "distill_coeff"):
            _check_number(name, getattr(self, name))
        for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "max_grad_norm"):
            _check_number(name, getattr(self, name), optional=True)
        _check_int("micro_batch_size", self.micro_batch_size, least=1, optional=True)
        _check_int("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, least=1, optional=True)
        _check_int("ignore_index", self.ignore_index)
        _check_int("pad_token_id", self.pad_token_id, least=0)
        check_loss_agg_mode(self.loss_agg_mode)
        if not 0.0 <= self.low < 1.0 or self.high < 0.0:
            raise ValueError(
                f"clip ratios must satisfy 0 <= low < 1 and high >= 0, got low={self.low}, high={self.high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 or None, got {self.clip_ratio_c}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if self.max_tokens_per_micro_batch is not None:
            self.micro_batch_size = None
        if (self.micro_batch_size is None) == (self.max_tokens_per_micro_batch is None):
            raise ValueError("give exactly one of micro_batch_size and max_tokens_per_micro_batch")
        if not (math.isfinite(self.distill_coeff) and self.distill_coeff >= 0):
            raise ValueError(f"distill_coeff must be finite and >= 0, got {self.distill_coeff}")
        _check_int("distill_topk", self.distill_topk)
        if not 1 <= self.distill_topk <= _MAX_TOPK:
            raise ValueError(f"distill_topk must be in [1, {_MAX_TOPK}], got {self.distill_topk}")
        if self.distill_kl_mode not in TOPK_KL_MODES:
            raise ValueError(f"distill_kl_mode must be one of {TOPK_KL_MODES}, got {self.distill_kl_mode!r}")
        if not isinstance(self.policy_loss, bool):
            raise TypeError(f"policy_loss must be a bool, got {type(self.policy_loss).__name__}")
        if not self.policy_loss and self.distill_coeff == 0:
            raise ValueError("policy_loss=False trains on the distillation loss alone: it needs distill_coeff > 0")

    @property
    def distill(self) -> bool:
        """Whether the distillation loss is on (``distill_coeff > 0``)."""
        return self.distill_coeff > 0

    @property
    def low(self) -> float:
        """Effective lower clip."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
