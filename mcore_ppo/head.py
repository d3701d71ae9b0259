"""``VocabParallelFusedPPOHead``: a drop-in Megatron ``output_layer`` with a fused PPO path."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo.api import compute_log_probs_and_entropy
from mcore_ppo.validation import check_buffer_budget_bytes, check_temperature


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
        temperature: default sampling temperature of the fused path.
        ignore_index: label value of tokens to skip (prompt tokens, padding).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"liger"``.
        buffer_budget_bytes: per-rank memory budget of the ``triton`` backend's probability
            buffer, used on every fused forward: when a gradient will be needed and ``n·V/tp``
            values of the input dtype plus fp32 tile maxima fit in it, the forward keeps the
            buffer and the backward skips recomputing the logits (three GEMMs instead of four).
            None: the environment variable ``MCORE_PPO_BUFFER_BUDGET_BYTES``, else the backend
            default (1 GiB); 0: off. Other backends ignore it. See
            :func:`mcore_ppo.fused_log_probs_and_entropy`. The attribute of the same name may
            be changed between calls.
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
        backend: str = "auto",
        buffer_budget_bytes: int | None = None,
        **kwargs,
    ) -> None:
        if bias:
            raise ValueError("VocabParallelFusedPPOHead has no bias (bias must be False): output layers have none")
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=False, **kwargs)
        self.temperature = check_temperature(temperature)
        self.ignore_index = ignore_index
        self.backend = backend
        self.buffer_budget_bytes = check_buffer_budget_bytes(buffer_budget_bytes)

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
        return compute_log_probs_and_entropy(
            input_,
            weight,
            labels,
            temperature=self.temperature if temperature is None else temperature,
            tp_group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
            ignore_index=self.ignore_index,
            backend=self.backend,
            accumulate_into_main_grad=self.gradient_accumulation_fusion,
            buffer_budget_bytes=self.buffer_budget_bytes,
        )
