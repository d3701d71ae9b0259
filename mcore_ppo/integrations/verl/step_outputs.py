"""The micro-batch outputs verl's logits path has and its fused path does not: Σπ² and top-k distillation.

verl's ``MegatronEngineWithLMHead.forward_step`` reads three flags from the micro-batch that only
its logits path serves (``_lm_head_logits_processor``): ``calculate_sum_pi_squared`` (its fused
path raises ``NotImplementedError``), ``distillation_use_topk`` (its fused path drops it) and
``distillation_only`` (no ``log_probs``). With the plugin they are served on the fused path, the
head computing them from the hidden states:

1. :func:`engine_step` (the ``forward_step`` wrapper): reads the flags and verl's loss function
   (``logits_processor_func``); with ``calculate_sum_pi_squared`` it hands verl's
   ``forward_step`` the batch with that flag off for the call (verl's refusal, lifted, with a
   WARNING once) and back on after.
2. :func:`collect` (the ``fused_forward_model_engine`` wrapper): the call's outputs are gathered
   while verl's fused forward runs, and :meth:`Collector.finish` adds them to verl's output dict,
   each ``[1, t]`` tensor laid out by verl's own ``postprocess_thd_engine`` with the arguments
   verl's fused path gives it for ``log_probs`` (so: same keys, nested ``[b, j]``, CP-gathered as
   the logits path's); ``distillation_only`` drops ``log_probs`` as the logits path does.
3. :meth:`Collector.run_head` (the plugin's ``linear_cross_entropy``): one head pass for verl's
   labels (log-probs, entropy, Σπ² in the logits' dtype, as ``vocab_parallel_sum_pi_squared``
   returns it) and, with top-k distillation, the teacher's ``k`` ids with it
   (:mod:`mcore_ppo.integrations.verl.distill_topk`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo.head_call import run_head
from mcore_ppo.integrations.verl import distill_topk
from mcore_ppo.logs import log_once
from mcore_ppo.options import HeadOptions, HiddenGrad, Layout, TokenOrder, call_options, replaced

__all__ = ["Collector", "StepRequest", "collect", "current_collector", "engine_step", "thd_packing"]

_SUM_PI_SQUARED, _TOPK, _ONLY = "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"
_FLAGS = (_SUM_PI_SQUARED, _TOPK, _ONLY)


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """What one ``forward_step`` asks beyond log-probs and entropy (verl's micro-batch flags)."""

    sum_pi_squared: bool
    distillation_use_topk: bool
    distillation_only: bool
    logits_processor_func: Callable[..., Any] | None
    batch: Any


_REQUEST: ContextVar[StepRequest | None] = ContextVar("mcore_ppo_verl_step_request", default=None)
_COLLECTOR: ContextVar[Collector | None] = ContextVar("mcore_ppo_verl_collector", default=None)


@contextlib.contextmanager
def engine_step(batch: Any, logits_processor_func: Callable[..., Any] | None) -> Iterator[None]:
    """One fused ``forward_step`` on ``batch``: its request set for the call (module doc, 1)."""
    from verl.utils import tensordict_utils as tu

    flags = {key: bool(tu.get_non_tensor_data(batch, key=key, default=False)) for key in _FLAGS}
    if not any(flags.values()):
        yield
        return
    if flags[_TOPK] and not callable(logits_processor_func):
        raise TypeError(
            "mcore_ppo verl plugin: distillation_use_topk needs verl's loss function as forward_step's "
            f"logits_processor_func, got {type(logits_processor_func).__name__}"
        )
    if flags[_SUM_PI_SQUARED]:
        log_once(
            logging.WARNING,
            ("verl-sum-pi-squared-lift",),
            "mcore_ppo verl plugin: calculate_sum_pi_squared=True on verl's fused path (verl refuses it there): "
            "sum_pi_squared is computed by the head, no logits",
        )
    if flags[_TOPK]:
        log_once(
            logging.INFO,
            ("verl-topk-distillation",),
            "mcore_ppo verl plugin: top-k distillation (distillation_use_topk%s) on verl's fused path: the student's "
            "log-probs at the teacher's ids and its own top-k from the head, no logits",
            ", distillation_only" if flags[_ONLY] else "",
        )
    request = StepRequest(flags[_SUM_PI_SQUARED], flags[_TOPK], flags[_ONLY], logits_processor_func, batch)
    token = _REQUEST.set(request)
    if flags[_SUM_PI_SQUARED]:  # verl's forward_step refuses it with use_fused_kernels: it is ours here
        tu.assign_non_tensor(batch, **{_SUM_PI_SQUARED: False})
    try:
        yield
    finally:
        _REQUEST.reset(token)
        if flags[_SUM_PI_SQUARED]:
            tu.assign_non_tensor(batch, **{_SUM_PI_SQUARED: True})


def thd_packing(arguments: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fused_forward_model_engine`` gives ``preprocess_thd_engine`` (and,
    for the layout ones, ``postprocess_thd_engine``), from that call's bound ``arguments``."""
    from verl.utils.megatron_utils import unwrap_model

    config = unwrap_model(arguments["model"]).config
    dsv4 = getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid"
    return dict(
        use_fp8_padding=getattr(config, "fp8", None) in ("e4m3", "hybrid"),
        min_local_rows=config.csa_window_size if dsv4 else None,
        pad_to_length_bucket=arguments.get("pad_to_length_bucket"),
        cp_layout=arguments.get("cp_layout", "zigzag"),
        local_cp_size=arguments.get("local_cp_size"),
    )


class Collector:
    """The extra outputs of one ``fused_forward_model_engine`` call (module doc, 2 and 3)."""

    def __init__(self, request: StepRequest, arguments: dict[str, Any]) -> None:
        self.request = request
        self.arguments = arguments
        self.results: dict[str, torch.Tensor] = {}

    @property
    def wants_head_outputs(self) -> bool:
        """Whether the head's call must compute more than log-probs and entropy."""
        return self.request.sum_pi_squared or self.request.distillation_use_topk

    def run_head(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float | torch.Tensor,
        tp_group: Any,
        *,
        reduce_hidden_grad: bool,
        return_entropy: bool,
        backend: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """verl's ``linear_cross_entropy(hidden, weight, labels, T, "none", tp_group)`` outputs
        (``[N]`` each, verl's flattening), the extra ones kept in :attr:`results` as ``[1, N]``."""
        hidden_rows = hidden.reshape(-1, hidden.shape[-1])
        label_rows = labels.reshape(-1)
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.reshape(-1)
        options = _options(backend, return_entropy, self.request.sum_pi_squared)
        layout = Layout(TokenOrder.MEGATRON, HiddenGrad.REDUCED if reduce_hidden_grad else HiddenGrad.PARTIAL)
        n = label_rows.shape[0]
        if self.request.distillation_use_topk:
            student = distill_topk.Student(
                hidden_rows, weight, label_rows, temperature, tp_group, layout, options,
                topk_impl="torch" if backend == "torch" else "auto",
                placeholder=torch.empty((1, n, 0), dtype=hidden.dtype, device=hidden.device).as_subclass(
                    distill_topk.StudentLogits
                ),
            )  # fmt: skip
            self.results.update(
                distill_topk.compute_on_head(self.request.logits_processor_func, self.request.batch, student)
            )
            assert student.main is not None  # compute_on_head raised otherwise
            log_probs, entropy, sum_pi_squared = student.main
        else:
            log_probs, entropy, *rest = run_head(
                hidden_rows, weight, label_rows, temperature, options, tp_group=tp_group, layout=layout, ids=False
            )
            sum_pi_squared = rest[0] if rest else None
            # verl's kernel contract: fp32 log-probs and entropy (the head gives fp64 for fp64 inputs).
            log_probs, entropy = log_probs.float(), None if entropy is None else entropy.float()
        if self.request.sum_pi_squared:
            if sum_pi_squared is None:
                raise RuntimeError("mcore_ppo verl plugin: the head returned no sum_pi_squared")
            # verl's vocab_parallel_sum_pi_squared runs on the logits: their dtype (the hidden's).
            self.results["sum_pi_squared"] = sum_pi_squared.detach().to(hidden.dtype).reshape(1, n)
        return log_probs, entropy

    def finish(self, output: Any) -> Any:
        """verl's fused output dict with the extra outputs added (module doc, 2); anything else
        (a pipeline stage before the last returns hidden states) as it is."""
        if not isinstance(output, dict):
            return output
        if self.wants_head_outputs and not self.results:
            raise RuntimeError(
                "mcore_ppo verl plugin: verl's fused forward returned without running the head's call site, so "
                "sum_pi_squared / the top-k distillation outputs it asked for were not computed"
            )
        if self.results:
            from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine

            packing = thd_packing(self.arguments)
            input_ids = self.arguments["input_ids"]
            _, packed_seq_params, _ = preprocess_thd_engine(input_ids, pre_process=False, **packing)
            for key, value in self.results.items():
                output[key] = postprocess_thd_engine(
                    value, packed_seq_params, input_ids, input_ids.shape[0], post_process=True,
                    local_cp_size=packing["local_cp_size"], cp_layout=packing["cp_layout"],
                )  # fmt: skip
        if self.request.distillation_only:
            output.pop("log_probs", None)  # verl's logits path computes none
        return output


def _options(backend: str, return_entropy: bool, sum_pi_squared: bool) -> HeadOptions:
    options = call_options(None, ignore_index=None, backend=backend, return_entropy=return_entropy, validate=None)
    if not sum_pi_squared:
        return options
    if "return_sum_pi_squared" not in {field.name for field in dataclasses.fields(HeadOptions)}:
        raise NotImplementedError(
            "mcore_ppo verl plugin: calculate_sum_pi_squared=True needs a head with "
            "HeadOptions.return_sum_pi_squared (this mcore_ppo has none)"
        )
    return replaced(options, return_sum_pi_squared=True)


class _Nothing:
    """The collector of a call that asks for nothing more."""

    request = None

    def finish(self, output: Any) -> Any:
        return output


@contextlib.contextmanager
def collect(arguments: dict[str, Any]) -> Iterator[Collector | _Nothing]:
    """Inside verl's ``fused_forward_model_engine`` (bound ``arguments``): its extra outputs
    collected (module doc, 2); call ``finish`` on verl's output."""
    request = _REQUEST.get()
    if request is None:
        yield _Nothing()
        return
    collector = Collector(request, arguments)
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


def current_collector() -> Collector | None:
    """The collector of the ``fused_forward_model_engine`` call in progress, or None."""
    return _COLLECTOR.get()
