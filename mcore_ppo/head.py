"""``VocabParallelFusedPPOHead``: a drop-in Megatron ``output_layer`` with a fused PPO path."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo.backends.base import Backend
from mcore_ppo.pipeline import HeadOptions, run_head


class VocabParallelFusedPPOHead(ColumnParallelLinear):
    """A ``ColumnParallelLinear`` output layer that returns ``(log_probs, entropy)`` given labels.

    It owns the same ``weight`` (``[V/tp, h]``, Megatron's init and sharding) as the
    ``ColumnParallelLinear`` it replaces, so checkpoints load unchanged, and it is called as a
    module, so Megatron DDP's forward pre-hooks (parameter all-gather) and gradient hooks
    fire as usual. With ``labels=None`` it *is* that ``ColumnParallelLinear``: it returns
    ``(logits, bias)``.

    Args:
        input_size: hidden size ``h``.
        output_size: global (padded) vocab size ``V``; must divide by the TP size.
        config: Megatron ``ModelParallelConfig`` (``sequence_parallel``,
            ``gradient_accumulation_fusion``, ``params_dtype``, ... are honoured).
        init_method: weight initialiser, as for ``ColumnParallelLinear``.
        temperature, ignore_index, backend, buffer_budget_bytes: the fused path's options
            (:class:`mcore_ppo.pipeline.HeadOptions`; ``temperature`` is the default that a
            call may override). Kept as attributes of the same names, which may be changed
            between calls: every fused forward validates them again.
        **kwargs: passed to ``ColumnParallelLinear`` (``skip_weight_param_allocation`` for
            tied embeddings, ``tp_group``, ``gather_output``, ...). ``bias`` must be False.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool = False,
        temperature: float = 1.0,
        ignore_index: int = -100,
        backend: str | Backend = "auto",
        buffer_budget_bytes: int | None = None,
        **kwargs,
    ) -> None:
        if bias:
            raise ValueError("VocabParallelFusedPPOHead has no bias (bias must be False): output layers have none")
        options = HeadOptions(temperature, ignore_index, backend, buffer_budget_bytes)
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=False, **kwargs)
        self.temperature = options.temperature
        self.ignore_index = options.ignore_index
        self.backend = options.backend
        self.buffer_budget_bytes = options.buffer_budget_bytes

    def forward(  # type: ignore[override]
        self,
        input_: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
        temperature: float | None = None,
    ):
        """``(log_probs, entropy)`` for ``labels``, or ``(logits, None)`` when ``labels`` is None.

        Args:
            input_: hidden states ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism),
                ``[t, 1, h]`` packed, or ``[n, h]``.
            labels: global vocab ids ``[b, s]`` / ``[1, t]`` / ``[n]`` (already rolled, and
                split for CP with :func:`parallel.roll_and_split_labels`), or None.
            weight: the weight to use instead of ``self.weight`` (tied embeddings: the
                embedding's shard, as Megatron's ``GPTModel`` passes it).
            runtime_gather_output: as for ``ColumnParallelLinear`` (logits path only).
            temperature: overrides the head's default temperature for this call.
        """
        if labels is None:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if weight is None:
            weight = self.weight
        if weight is None:
            raise ValueError(
                "weight must be passed to forward when the head was built with "
                "skip_weight_param_allocation=True (tied embeddings)"
            )
        options = HeadOptions(
            self.temperature if temperature is None else temperature,
            self.ignore_index,
            self.backend,
            self.buffer_budget_bytes,
        )
        return run_head(
            input_,
            weight,
            labels,
            options,
            tp_group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
            accumulate_into_main_grad=self.gradient_accumulation_fusion,
        )
