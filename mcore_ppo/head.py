"""``VocabParallelFusedPPOHead``: a drop-in Megatron ``output_layer`` with a fused PPO path."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_ppo import validation
from mcore_ppo.backends.base import Backend
from mcore_ppo.head_call import attempt, run_head
from mcore_ppo.options import HeadOptions, call_options, megatron_layout, replaced

# megatron-core >= 0.20 gives ColumnParallelLinear an ``output_dtype`` (the logits GEMM's output
# dtype, GPTModel's ``logit_dtype``) and passes it to the output layer; older versions have none.
_CPL_TAKES_OUTPUT_DTYPE = "output_dtype" in inspect.signature(ColumnParallelLinear.__init__).parameters
# LinearCrossEntropyModule's reductions; its "mean" is over the tokens that count (not ignored).
_LOSS_REDUCTIONS = ("none", "sum", "mean")
# Attributes of the head that are fields of its one HeadOptions (read and set through it).
_OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(HeadOptions))


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
        temperature: the default temperature of the fused path, a number (a call may
            override it, also with a per-token tensor); checked when set.
        ignore_index, backend, return_entropy, validate, return_sum_pi_squared, precision: the fused path's
            options (:class:`mcore_ppo.options.HeadOptions`; ``return_entropy=False`` makes the
            fused path return ``(log_probs, None)``, ``return_sum_pi_squared=True`` makes it
            return ``(log_probs, entropy, sum_pi_squared)``; ``validate`` None takes the default; a backend
            object such as ``TritonBackend(TritonConfig(...))`` carries its own settings), or
            ``options``, a ``HeadOptions`` whose fields these keywords replace when given. The
            head keeps them as one :class:`HeadOptions` (:attr:`options`), built here and
            rebuilt, and so validated, only when one of the attributes of the same names is set
            between calls; a forward reuses it as it is.
        output_dtype: the dtype of the logits on the ``labels=None`` path, which megatron-core
            >= 0.20 passes to its output layer (``GPTModel(logit_dtype=...)``) and
            ``ColumnParallelLinear`` honours there. The fused path does not need it: it forms
            the logits' statistics in fp32 and returns fp32 whatever it is. On older
            megatron-core, whose ``ColumnParallelLinear`` has no such argument, only None or
            ``config.params_dtype`` (a no-op) is accepted.
        **kwargs: passed to ``ColumnParallelLinear`` (``skip_weight_param_allocation`` for
            tied embeddings, ``tp_group``, ``gather_output``, ...). ``bias`` must be False.

    It also keeps the forward contract of megatron-core's ``LinearCrossEntropyModule`` (the
    output layer on Megatron's dev branch, a ``ColumnParallelLinear`` subclass), so it can take
    that module's place: ``output_cross_entropy_loss=True`` returns the per-token cross entropy
    ``-log p(label)`` at temperature 1 from the fused path, without logits (Megatron's language
    model loss and its MTP depths call it so).
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
        options: HeadOptions | None = None,
        ignore_index: int | None = None,
        backend: str | Backend | None = None,
        output_dtype: torch.dtype | None = None,
        return_entropy: bool | None = None,
        validate: bool | None = None,
        return_sum_pi_squared: bool | None = None,
        precision: str | None = None,
        **kwargs,
    ) -> None:
        if bias:
            raise ValueError("VocabParallelFusedPPOHead has no bias (bias must be False): output layers have none")
        options = call_options(
            options, ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate,
            return_sum_pi_squared=return_sum_pi_squared, precision=precision,
        )  # fmt: skip
        temperature = validation.check_temperature(temperature)
        if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
            raise TypeError(f"output_dtype must be a torch.dtype or None, got {type(output_dtype).__name__}")
        if _CPL_TAKES_OUTPUT_DTYPE:
            kwargs["output_dtype"] = output_dtype
        elif output_dtype not in (None, getattr(config, "params_dtype", None)):
            raise ValueError(
                f"output_dtype={output_dtype} needs megatron-core >= 0.20 (its ColumnParallelLinear computes "
                "the logits in that dtype); this version's has no such argument: pass None"
            )
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=False, **kwargs)
        self.output_dtype = output_dtype
        self.options = options
        self.temperature = temperature

    def __setattr__(self, name: str, value) -> None:
        if name in _OPTION_NAMES:
            # Rebuilt (and so validated) now, not at the next forward.
            value = replaced(self.options, **{name: value})
            name = "options"
        elif name == "options" and not isinstance(value, HeadOptions):
            raise TypeError(f"options must be a HeadOptions, got {validation.type_name(value)}")
        elif name == "temperature":
            value = validation.check_temperature(value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in _OPTION_NAMES:
            return getattr(self.options, name)
        return super().__getattr__(name)

    def forward(  # type: ignore[override]
        self,
        input_: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
        temperature: float | torch.Tensor | None = None,
        output_cross_entropy_loss: bool = False,
        reduction: str = "none",
        ignore_index: int | None = None,
        return_entropy: bool | None = None,
        return_sum_pi_squared: bool | None = None,
    ):
        """``(log_probs, entropy)`` for ``labels`` (``(log_probs, entropy, sum_pi_squared)`` with
        ``return_sum_pi_squared``), or ``(logits, None)`` when ``labels`` is None.

        Args:
            input_: hidden states ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism),
                ``[t, 1, h]`` packed, or ``[n, h]``.
            labels: global vocab ids ``[b, s]`` / ``[1, t]`` / ``[n]`` (already rolled, and
                split for CP with :func:`mcore_ppo.parallel.roll_and_split_labels`), or None. With a
                trailing ``k`` dim (``[b, s, k]``, ...): ``k`` ids per token, log-probs
                ``[..., k]`` (:func:`mcore_ppo.fused_log_probs_at`).
            weight: the weight to use instead of ``self.weight`` (tied embeddings: the
                embedding's shard, as Megatron's ``GPTModel`` passes it).
            runtime_gather_output: as for ``ColumnParallelLinear`` (logits path only).
            temperature: overrides the head's default temperature for this call: a float, or a
                per-token floating-point tensor shaped like ``labels`` or broadcastable to them
                (``[b, 1]`` per sequence; under CP this rank's part, split like the labels with
                :func:`mcore_ppo.parallel.split_temperature_for_cp`). The tensor gets no gradient.
            output_cross_entropy_loss, reduction, ignore_index: ``LinearCrossEntropyModule``'s
                contract (class doc): with ``output_cross_entropy_loss`` the result is the
                cross entropy at temperature 1, ``[b, s]`` for ``reduction="none"``, else its
                sum or its mean over the tokens not equal to ``ignore_index`` (default: the
                head's), as a 0-d tensor.
            return_entropy: overrides the head's ``return_entropy`` for this call (None: keep it);
                False returns ``(log_probs, None)``.
            return_sum_pi_squared: overrides the head's ``return_sum_pi_squared`` for this call
                (None: keep it); True adds Σπ² per token as a third output (fp32, no gradient).
        """
        if output_cross_entropy_loss:
            if labels is None:
                raise ValueError("labels cannot be None when output_cross_entropy_loss=True")
            return self._cross_entropy(input_, labels, weight, reduction, ignore_index)
        if labels is None:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        options, error = self.options, None
        changes = {}
        if return_entropy is not None and return_entropy is not options.return_entropy:
            changes["return_entropy"] = return_entropy
        if return_sum_pi_squared is not None and return_sum_pi_squared is not options.return_sum_pi_squared:
            changes["return_sum_pi_squared"] = return_sum_pi_squared
        if changes:
            options, error = attempt(lambda: replaced(self.options, **changes), options)
        # A number or a tensor here overrides the stored temperature for this call.
        temperature = self.temperature if temperature is None else temperature
        return self._run(input_, self._weight(weight), labels, options, temperature, error)

    def _cross_entropy(
        self,
        input_: torch.Tensor,
        labels: torch.Tensor,
        weight: torch.Tensor | None,
        reduction: str,
        ignore_index: int | None,
    ) -> torch.Tensor:
        """``LinearCrossEntropyModule``'s fused loss: ``-log p(label)`` at temperature 1, no logits."""
        ignore = self.ignore_index if ignore_index is None else ignore_index

        def loss_options() -> HeadOptions:
            if reduction not in _LOSS_REDUCTIONS:
                raise ValueError(f"reduction must be one of {_LOSS_REDUCTIONS}, got {reduction!r}")
            return replaced(self.options, ignore_index=ignore, return_entropy=False, return_sum_pi_squared=False)

        options, error = attempt(loss_options, self.options)
        # The language-model loss has no sampling temperature: T = 1 whatever the head's default.
        log_probs, _ = self._run(input_, self._weight(weight), labels, options, 1.0, error)
        loss = -log_probs
        if reduction == "sum":
            return loss.sum()
        if reduction == "mean":  # over the tokens that count, as Megatron's fused linear cross entropy
            return loss.sum() / (labels != ignore).sum().clamp(min=1)
        return loss

    def _weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            weight = self.weight
        if weight is None:
            raise ValueError(
                "weight must be passed to forward when the head was built with "
                "skip_weight_param_allocation=True (tied embeddings)"
            )
        return weight

    def _run(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        options: HeadOptions,
        temperature: float | torch.Tensor,
        error: Exception | None,
    ) -> tuple[torch.Tensor, ...]:
        # Labels with a trailing k dim are k ids per token (distillation's student side).
        layout = megatron_layout(self.sequence_parallel, self.gradient_accumulation_fusion)
        return run_head(
            input_, weight, labels, temperature, options, tp_group=self.tp_group, layout=layout, prior_error=error
        )
