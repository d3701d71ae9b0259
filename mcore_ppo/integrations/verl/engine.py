"""verl's fused-path call sites, wrapped so the plugin's kernel knows what verl's kernel is not told.

verl calls ``linear_cross_entropy(hidden, weight, labels, temperature, "none", tp_group)``: the
call says nothing of Megatron's sequence parallelism, of ``calculate_entropy`` or of
per-sample temperatures. The functions that make that call receive the model or its config,
so the plugin wraps them (module attributes rebound by the import hook in
:mod:`mcore_ppo.integrations.verl`, verl's files unedited) and each wrapper sets a context
variable, :class:`CallSite`, for the duration of the call; the plugin's kernel reads it.

Wrapped, in ``verl.models.mcore.model_forward_fused`` (verl 0.9.1 and verl-project/verl at
1dda039b; both read):

- ``fused_output_processor`` (megatron-core >= 0.18's ``output_processor`` hook): receives
  ``config``: ``config.sequence_parallel``;
- ``_fused_GPTModel_forward`` (the patched ``GPTModel.forward`` of older megatron-core; verl binds
  it to the model in ``patch_fused_forward``, after the wrapper is in place): ``model.config``;
- ``fused_forward_model_engine`` (the engine's entry; also rebound in ``verl.models.mcore.registry``,
  which imports it by name): ``calculate_entropy`` (False: the head skips the entropy) and a
  per-sample temperature, spread over the tokens as verl's non-fused path spreads it
  (``expand_as_nested`` then ``preprocess_thd_engine``: packed, aligned, CP-split like the labels).

And in ``verl.workers.engine.megatron.transformer_impl``:

- ``_resolve_fused_temperature``: verl refuses non-uniform temperatures on the fused path
  (its kernel takes one float); with the plugin the per-sample tensor goes through;
- ``MegatronEngine._maybe_enable_fused_kernels``: records whether the fused path was asked for
  before verl turns it off (MTP, value models, no remove-padding); with ``MCORE_PPO_VERL_MTP=1``
  it keeps the path on with MTP (:mod:`mcore_ppo.integrations.verl.mtp`;
  :mod:`mcore_ppo.integrations.verl.mtp_postprocess` wraps verl's MTP ``_postprocess`` in
  ``verl.models.mcore.mtp_patch``);
- ``MegatronEngineWithLMHead.forward_step`` / ``MegatronEngineWithValueHead.forward_step``: at an
  engine's first forward, a WARNING naming the verl setting to change when the engine runs its
  non-fused logits path (where the plugin does nothing); INFO for a value model, which computes
  no log-probs; on the fused path, the micro-batch's MTP state (its loss mask) for
  the MTP postprocess, and its Σπ² / top-k distillation request
  (:mod:`mcore_ppo.integrations.verl.step_outputs`: verl's refusal of Σπ² lifted, the extra
  outputs added to ``fused_forward_model_engine``'s).

And in ``verl.trainer.distillation.megatron.losses``: ``_VocabParallelKLDivergence``, whose
``apply`` on the plugin's stand-in for the student's logits runs on the head
(:mod:`mcore_ppo.integrations.verl.distill_topk`); real logits still go to verl's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from mcore_ppo.integrations.verl import distill_topk, mtp, mtp_postprocess, mtp_step, step_outputs
from mcore_ppo.logs import log_once

__all__ = ["WRAPPERS", "CallSite", "call_site", "current_call_site", "fused_path_off_reason"]


@dataclasses.dataclass(frozen=True)
class CallSite:
    """What verl's call site knows and its ``linear_cross_entropy`` call does not say.

    Attributes:
        where: the wrapped verl function(s), outermost first (for messages).
        sequence_parallel: the model's ``config.sequence_parallel`` (None: not known here).
        temperature: a per-token temperature in the labels' layout, or None (the call's float).
        return_entropy: verl's ``calculate_entropy``.
    """

    where: str = ""
    sequence_parallel: bool | None = None
    temperature: torch.Tensor | None = None
    return_entropy: bool = True


_CALL_SITE: ContextVar[CallSite | None] = ContextVar("mcore_ppo_verl_call_site", default=None)


def current_call_site() -> CallSite | None:
    """The innermost wrapped verl call in progress, or None outside all of them."""
    return _CALL_SITE.get()


@contextlib.contextmanager
def call_site(where: str, **known: Any) -> Iterator[CallSite]:
    """Enter a wrapped verl call: what it knows is added to what the enclosing calls knew."""
    outer = _CALL_SITE.get()
    site = dataclasses.replace(outer or CallSite(), where=f"{outer.where} > {where}" if outer else where, **known)
    token = _CALL_SITE.set(site)
    try:
        yield site
    finally:
        _CALL_SITE.reset(token)


def _sequence_parallel(config: Any, where: str) -> bool:
    value = getattr(config, "sequence_parallel", None)
    if not isinstance(value, bool):
        raise TypeError(
            f"mcore_ppo verl plugin: {where} got a model config without a bool sequence_parallel "
            f"({type(config).__name__}.sequence_parallel = {value!r}); cannot tell whether verl's SP gather "
            "reduces d_hidden over TP"
        )
    return value


# ---------------------------------------------------------------------------------------------
# verl.models.mcore.model_forward_fused
# ---------------------------------------------------------------------------------------------


def wrap_fused_output_processor(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core calls the hook with keywords only, ``config`` among them."""

    @functools.wraps(original)
    def fused_output_processor(*args: Any, **kwargs: Any) -> Any:
        sp = _sequence_parallel(kwargs.get("config"), "fused_output_processor")
        with call_site("fused_output_processor", sequence_parallel=sp):
            return original(*args, **kwargs)

    return fused_output_processor


def wrap_fused_gpt_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl binds it as the model's ``forward``: ``model`` is the first argument."""

    @functools.wraps(original)
    def _fused_GPTModel_forward(model: Any, *args: Any, **kwargs: Any) -> Any:
        sp = _sequence_parallel(getattr(model, "config", None), "_fused_GPTModel_forward")
        with call_site("_fused_GPTModel_forward", sequence_parallel=sp):
            if mtp_postprocess.reroutes_legacy_forward(model):
                # MTP trains: Megatron's forward and verl's MTP postprocess, the head as its processor.
                return mtp_postprocess.legacy_forward_through_postprocess(model, original, *args, **kwargs)
            return original(model, *args, **kwargs)

    return _fused_GPTModel_forward


def wrap_fused_forward_model_engine(original: Callable[..., Any]) -> Callable[..., Any]:
    """``fused_forward_model_engine(vision_model)`` returns the forward; the forward is wrapped."""

    @functools.wraps(original)
    def fused_forward_model_engine(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        inner = original(*args, **kwargs)
        signature = inspect.signature(inner)

        @functools.wraps(inner)
        def fused_forward_model_engine_inner(*call_args: Any, **call_kwargs: Any) -> Any:
            bound = signature.bind(*call_args, **call_kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            temperature = arguments.get("temperature", 1.0)
            per_token = None
            if isinstance(temperature, torch.Tensor):
                # Only _resolve_fused_temperature's wrapper lets a tensor through (non-uniform).
                per_token = _per_token_temperature(temperature, arguments)
                arguments["temperature"] = 1.0  # verl's own code sees a float; the head reads per_token
            known = {"return_entropy": bool(arguments.get("calculate_entropy", True)), "temperature": per_token}
            with (
                call_site("fused_forward_model_engine", **known),
                mtp_step.fused_engine_inputs(arguments),
                step_outputs.collect(arguments) as collected,
            ):
                output = inner(*bound.args, **bound.kwargs)
            return collected.finish(output)  # Σπ², top-k distillation: step_outputs

        return fused_forward_model_engine_inner

    return fused_forward_model_engine


def _per_token_temperature(temperature: torch.Tensor, arguments: dict[str, Any]) -> torch.Tensor:
    """verl's per-sample temperature ``[b]`` on this rank's packed tokens ``[1, t]``, laid out as
    ``fused_forward_model_engine`` lays out the labels (the non-fused path does the same)."""
    import verl.utils.torch_functional as verl_F
    from verl.models.mcore.util import preprocess_thd_engine

    input_ids = arguments["input_ids"]
    per_sample = temperature.detach().to(device=input_ids.device, dtype=torch.float32).reshape(-1)
    if per_sample.numel() != input_ids.shape[0]:
        raise ValueError(
            f"temperature has {per_sample.numel()} values for a micro-batch of {input_ids.shape[0]} sequences"
        )
    per_token, _, _ = preprocess_thd_engine(
        verl_F.expand_as_nested(per_sample, input_ids), pre_process=True, need_roll=False,
        **step_outputs.thd_packing(arguments),
    )  # fmt: skip
    # Alignment padding carries 0 (its outputs are dropped by verl's postprocess): any valid value.
    return torch.where(per_token > 0, per_token, torch.ones_like(per_token)).contiguous()


# ---------------------------------------------------------------------------------------------
# verl.workers.engine.megatron.transformer_impl
# ---------------------------------------------------------------------------------------------

# verl's own floor for non-positive temperatures (its non-fused path and its scalar resolver).
_VERL_MIN_TEMPERATURE = 1e-8


def wrap_resolve_fused_temperature(original: Callable[..., Any]) -> Callable[..., Any]:
    """Uniform temperatures: verl's own answer (a float). Non-uniform: the per-sample tensor.
    Temperatures on an accelerator are not read (a host sync): several are passed on as the
    per-sample tensor, which the head takes as it is (bad values give NaN, docs/design.md §5)."""

    @functools.wraps(original)
    def _resolve_fused_temperature(temperature: Any) -> Any:
        values = torch.as_tensor(temperature).detach().flatten()
        if values.numel() > 1 and values.device.type != "cpu":
            return values.to(torch.float32).clamp_min(_VERL_MIN_TEMPERATURE)
        if values.numel() > 1 and torch.isfinite(values).all().item() and not torch.all(values == values[0]).item():
            return values.to(torch.float32).clamp_min(_VERL_MIN_TEMPERATURE)
        return original(temperature)

    return _resolve_fused_temperature


# Engines whose fused setting was asked for before verl's _maybe_enable_fused_kernels ran, and
# engines already checked at their first forward.
_ASKED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def wrap_maybe_enable_fused_kernels(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_enable_fused_kernels(self: Any, *args: Any, **kwargs: Any) -> Any:
        _ASKED[self] = bool(self.engine_config.use_fused_kernels)
        if mtp.lift_applies(self):  # MCORE_PPO_VERL_MTP=1: only verl's MTP condition is lifted
            return mtp.enable_fused_with_mtp(self)
        return original(self, *args, **kwargs)

    return _maybe_enable_fused_kernels


def fused_path_off_reason(engine: Any) -> tuple[str, str] | None:
    """Why ``engine`` runs verl's non-fused logits path, and the verl setting that changes it;
    None when it runs the fused path."""
    config = engine.engine_config
    if bool(config.use_fused_kernels):
        return None
    if getattr(engine, "is_value_model", False):
        return "a value model (critic) computes no log-probs", "nothing: expected for a critic"
    if not _ASKED.get(engine, False):
        return (
            "use_fused_kernels is False (verl's default)",
            "actor_rollout_ref.model.use_fused_kernels=True",
        )
    if not getattr(config, "use_remove_padding", True):
        return (
            "verl turned use_fused_kernels off: its fused path needs remove-padding",
            "actor_rollout_ref.model.use_remove_padding=True",
        )
    mtp_config = getattr(getattr(engine, "model_config", None), "mtp", None)
    if getattr(mtp_config, "enable", False):
        return (
            "verl turned use_fused_kernels off: its fused path does not run with MTP",
            f"{mtp.ENV_MTP}=1 in the workers' environment (the plugin then keeps verl's fused path with MTP), or "
            "actor_rollout_ref.model.mtp.enable=False (or keep MTP and verl's non-fused path)",
        )
    return "verl turned use_fused_kernels off", "actor_rollout_ref.model.use_fused_kernels=True"


def _check_first_forward(engine: Any) -> None:
    if engine in _CHECKED:
        return
    _CHECKED.add(engine)
    reason = fused_path_off_reason(engine)
    if reason is None:
        return
    why, setting = reason
    if getattr(engine, "is_value_model", False):
        log_once(
            logging.INFO,
            ("verl-value-model",),
            "mcore_ppo verl plugin: %s engine: %s; the plugin has nothing to do there",
            type(engine).__name__,
            why,
        )
        return
    log_once(
        logging.WARNING,
        ("verl-fused-off", why),
        "mcore_ppo verl plugin is switched on but does nothing: verl's Megatron engine (%s) runs its non-fused "
        "logits path because %s. To run log-probs and entropy on the fused head set %s",
        type(engine).__name__,
        why,
        setting,
    )


def wrap_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check_first_forward(self)
        if getattr(self, "is_value_model", False) or not bool(self.engine_config.use_fused_kernels):
            return original(self, *args, **kwargs)
        # The fused path with MTP needs the micro-batch's loss mask, which verl hands only to its
        # non-fused path: the batch is read here and handed on unchanged.
        args = list(args)
        batch_iter = args[0] if args else kwargs["batch_iter"]
        batch = next(batch_iter)
        replay = itertools.chain([batch], batch_iter)
        if args:
            args[0] = replay
        else:
            kwargs["batch_iter"] = replay
        bound = signature.bind(self, *args, **kwargs).arguments
        with mtp_step.engine_step(self, batch), step_outputs.engine_step(batch, bound.get("logits_processor_func")):
            return original(self, *args, **kwargs)

    return forward_step


# Module -> (attribute path, wrapper factory). The import hook applies these right after the
# module executes; ``uninstall`` puts the originals back.
WRAPPERS: dict[str, tuple[tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...]] = {
    "verl.models.mcore.model_forward_fused": (
        ("fused_output_processor", wrap_fused_output_processor),
        ("_fused_GPTModel_forward", wrap_fused_gpt_model_forward),
        ("fused_forward_model_engine", wrap_fused_forward_model_engine),
    ),
    "verl.models.mcore.registry": (("fused_forward_model_engine", wrap_fused_forward_model_engine),),
    "verl.models.mcore.mtp_patch": (("_megatron_gptmodel_postprocess", mtp_postprocess.wrap_mtp_postprocess),),
    "verl.trainer.distillation.megatron.losses": (("_VocabParallelKLDivergence", distill_topk.wrap_kl_divergence),),
    "verl.workers.engine.megatron.transformer_impl": (
        ("_resolve_fused_temperature", wrap_resolve_fused_temperature),
        ("MegatronEngine._maybe_enable_fused_kernels", wrap_maybe_enable_fused_kernels),
        ("MegatronEngineWithLMHead.forward_step", wrap_forward_step),
        ("MegatronEngineWithValueHead.forward_step", wrap_forward_step),
    ),
}
