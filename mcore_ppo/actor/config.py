"""The actor's options: :class:`PPOActorConfig` (names as in verl's actor config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_ppo.actor.ppo_loss import check_loss_agg_mode

__all__ = ["PPOActorConfig"]


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

    def __post_init__(self) -> None:
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

    @property
    def low(self) -> float:
        """Effective lower clip."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
