"""What :func:`mcore_ppo.integrations.nemo_rl.enable` binds in NeMo-RL's modules, and why the temperature needs two.

NeMo-RL's fused path (NVIDIA-NeMo/RL at 7ea279ab; the same in v0.7.0):

- ``nemo_rl/models/megatron/train.py``, ``model_forward``: with ``use_fused_linear_logprobs``
  the model gets ``labels=input_ids_cp_sharded`` and ``return_logprobs_for_linear_ce_fusion=True``;
  NeMo-RL's patched ``GPTModel.forward`` (``model_utils._gpt_forward_with_linear_ce_fusion``)
  calls ``from_parallel_hidden_states_to_logprobs(hidden_states, output_weight, runtime_gather_output,
  labels, vocab_start_index=, vocab_end_index=, inference_only=, tp_group=, cp_group=,
  chunk_size=)``, which returns fp32 ``log softmax(hidden @ W.T)[next token]``, ``[b, s - 1]``:
  no temperature.
- ``train.py``, ``forward_with_post_processing_fn``: then, for every post-processor (loss,
  log-probs, top-k), ``apply_temperature_scaling(output_tensor, sampling_params)``, i.e.
  ``output_tensor.div_(T)`` when ``sampling_params.temperature != 1.0``. On the logits path that
  divides the *logits*; on the fused path it divides the *log-probs*: NeMo-RL's fused result is
  ``log p_1 / T``, not the logits path's ``log p_T = log softmax(z / T)``.

So the temperature must be known where the log-probs are made, and the value handed back must
survive that division. :func:`with_step_temperature` wraps ``forward_with_post_processing_fn``
to record ``T`` (exactly when train.py will divide by it) for the duration of the step;
:func:`fused_hidden_states_to_logprobs` computes ``log p_T`` on the head and returns
``T · log p_T``, which train.py's division turns into ``log p_T``: the logits path's value and
gradient, the temperature applied once. Called outside such a step (nothing recorded) it
returns ``log p_1``, as NeMo-RL's function does.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from mcore_ppo.integrations.import_hook import head_backend_from_environment
from mcore_ppo.integrations.nemo_rl import ENV_BACKEND, ENV_PRECISION
from mcore_ppo.integrations.nemo_rl.adapter import from_parallel_hidden_states_to_logprobs
from mcore_ppo.logs import log_once
from mcore_ppo.parallel.ranks import ProcessGroup, group_size

__all__ = ["fused_hidden_states_to_logprobs", "step_temperature", "with_step_temperature"]

# The divisor train.py applies to this step's model output (1.0: none, or outside a step).
_STEP_TEMPERATURE: contextvars.ContextVar[float] = contextvars.ContextVar("mcore_ppo_nemo_rl_temperature", default=1.0)


def step_temperature() -> float:
    """The temperature the running NeMo-RL step will divide the model output by (1.0: none)."""
    return _STEP_TEMPERATURE.get()


def _divisor(sampling_params: Any) -> float:
    """train.py's ``apply_temperature_scaling`` condition: divides iff params given and T != 1."""
    if sampling_params is None:
        return 1.0
    temperature = sampling_params.temperature
    return 1.0 if temperature == 1.0 else float(temperature)


def with_step_temperature(original: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_with_post_processing_fn`` that records its ``sampling_params``' temperature while it runs."""
    signature = inspect.signature(original)

    def forward_with_post_processing_fn(*args: Any, **kwargs: Any) -> Any:
        try:
            params = signature.bind_partial(*args, **kwargs).arguments.get("sampling_params")
        except TypeError:  # NeMo-RL's own function will say what is wrong with the call
            params = None
        token = _STEP_TEMPERATURE.set(_divisor(params))
        try:
            return original(*args, **kwargs)
        finally:
            _STEP_TEMPERATURE.reset(token)

    functools.update_wrapper(forward_with_post_processing_fn, original, assigned=("__doc__",))
    forward_with_post_processing_fn.__qualname__ = f"{__name__}.with_step_temperature(...)"
    return forward_with_post_processing_fn


def fused_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool | None,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: ProcessGroup | None,
    inference_only: bool = False,
    cp_group: ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` (its signature and call) on the head.

    Returns fp32 ``T · log softmax(hidden @ W.T / T)[next token]``, ``[b, s - 1]``, with ``T``
    the running step's :func:`step_temperature` (module doc: train.py divides it out). The
    hidden states are sequence-parallel when this rank holds ``s / tp`` of the ``s`` target
    positions, not when it holds all ``s`` (NeMo-RL's own function assumes SP whenever TP > 1);
    ``d_hidden`` is reduced over TP once either way.

    Raises:
        ValueError: context parallelism (NeMo-RL passes the CP-split ids as ``target`` here,
            while each position's label is its successor in the whole sequence), or hidden
            states that hold neither ``s`` nor ``s / tp`` positions.
    """
    if group_size(cp_group) > 1:
        raise ValueError(
            "NeMo-RL's fused forward passes the CP-split input_ids as target, so the labels at chunk boundaries are "
            "unknown here; use context_parallel_size=1 with use_fused_linear_logprobs (NeMo-RL's setup asserts it), "
            "or call mcore_ppo.integrations.nemo_rl.from_parallel_hidden_states_to_logprobs with the whole input_ids"
        )
    tp = group_size(tp_group)
    local, total = tensor_parallel_hidden_states.shape[0], target.shape[-1]
    if tp > 1 and local * tp == total:
        sequence_parallel = True
    elif local == total:
        sequence_parallel = False
    else:
        raise ValueError(
            f"hidden states hold {local} positions and target {total}: expected {total} (no sequence parallelism) "
            f"or {total} / tp={tp} (sequence parallelism)"
        )
    temperature = step_temperature()
    backend = head_backend_from_environment(ENV_BACKEND, ENV_PRECISION, output_weight_layer)
    log_once(
        logging.INFO,
        ("nemo-rl-fused", tp, sequence_parallel, temperature),
        "mcore_ppo NeMo-RL integration: fused log-probs on the head (tp=%d, sequence_parallel=%s, T=%g%s)",
        tp,
        sequence_parallel,
        temperature,
        ", scaled by T for train.py's division" if temperature != 1.0 else "",
    )
    log_probs = from_parallel_hidden_states_to_logprobs(
        tensor_parallel_hidden_states,
        output_weight_layer,
        runtime_gather_output,
        target,
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        None,
        chunk_size,
        temperature=temperature,
        sequence_parallel=sequence_parallel,
        backend=backend,
    )
    log_probs = log_probs.float()  # NeMo-RL's contract (the head gives fp64 for fp64 inputs)
    return log_probs * temperature if temperature != 1.0 else log_probs
