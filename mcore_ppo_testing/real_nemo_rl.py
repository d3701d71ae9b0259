"""NeMo-RL's real source, vendored unmodified (``vendor/nemo_rl/``), imported without NeMo-RL's dependency tree.

PyPI has no NeMo-RL (``nemo-rl`` there is an empty 0.0.0 placeholder), so the files the tests
drive are vendored from NVIDIA-NeMo/RL at 7ea279ab and run as they are:

- ``nemo_rl/distributed/model_utils.py``: the logits path (``from_parallel_logits_to_logprobs``,
  ``get_next_token_logprobs_from_logits``), NeMo-RL's fused function and its patched
  ``GPTModel.forward``;
- ``nemo_rl/algorithms/logits_sampling_utils.py``: the one NeMo-RL module model_utils imports;
- ``nemo_rl/models/megatron/train.py``: ``model_forward``, ``forward_with_post_processing_fn``
  (temperature scaling), ``LossPostProcessor`` and ``LogprobsPostProcessor``;
- ``nemo_rl/models/megatron/draft/hidden_capture.py``: ``get_capture_context``, which train.py calls.

train.py also imports names from eight NeMo-RL modules whose own imports reach megatron-bridge,
Ray, wandb, PIL, zmq, mlflow and more (NeMo-RL's whole dependency set). Those eight are stood
in (:data:`STAND_INS`): the classes train.py names in annotations and ``isinstance`` checks,
and functions that raise when called. The tests' paths never call them: the log-prob
post-processor computes everything itself, and the loss post-processor only wraps them in
``partial`` objects that the tests do not call. NeMo-RL's ``nemo_rl/__init__.py`` (logging
setup, environment defaults, a container check) is not vendored: the folders are namespace
packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import UserDict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

VENDOR = Path(__file__).resolve().parent / "vendor" / "nemo_rl"
COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"  # vendor/nemo_rl/README.md


class BatchedDataDict(UserDict):
    """Stand-in for ``nemo_rl.distributed.batched_data_dict.BatchedDataDict``: a dict of the
    micro-batch's tensors with no multimodal entries (train.py asks for those)."""

    def get_multimodal_dict(self, as_tensors: bool = False, device: Any = None) -> dict[str, Any]:
        return {}


@dataclasses.dataclass
class ProcessedMicrobatch:
    """Stand-in for ``nemo_rl.models.megatron.data.ProcessedMicrobatch``: the same fields."""

    data_dict: BatchedDataDict
    input_ids: torch.Tensor
    input_ids_cp_sharded: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    packed_seq_params: Any
    cu_seqlens_padded: torch.Tensor | None
    mtp_loss_mask: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    routed_experts_cp_sharded: torch.Tensor | None = None
    media_token_validity_mask: torch.Tensor | None = None


class _StoodIn:
    """A class name train.py only uses in annotations."""


def _raises(module: str, name: str) -> Any:
    def stood_in(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{module}.{name} is not vendored (mcore_ppo_testing.real_nemo_rl)")

    stood_in.__qualname__ = name
    return stood_in


def _stand_ins() -> dict[str, dict[str, Any]]:
    loss = "nemo_rl.algorithms.loss"
    loss_names = (
        "DraftLossWrapper",
        "SequencePackingFusionLossWrapper",
        "SequencePackingLossWrapper",
        "prepare_loss_input",
        "prepare_packed_loss_input",
        "wrap_loss_fn_with_input_preparation",
    )
    replay = "nemo_rl.models.megatron.router_replay"
    return {
        loss: {name: _raises(loss, name) for name in loss_names},
        f"{loss}.interfaces": {"LossFunction": _StoodIn},
        "nemo_rl.algorithms.utils": {
            "mask_out_neg_inf_logprobs": _raises("nemo_rl.algorithms.utils", "mask_out_neg_inf_logprobs")
        },
        "nemo_rl.distributed.batched_data_dict": {"BatchedDataDict": BatchedDataDict},
        "nemo_rl.models.megatron.config": {"MegatronModule": _StoodIn},
        "nemo_rl.models.megatron.data": {"ProcessedMicrobatch": ProcessedMicrobatch},
        replay: {
            name: _raises(replay, name)
            for name in ("clear_router_replay", "set_router_replay_backward", "set_router_replay_forward")
        },
        "nemo_rl.models.policy": {"PolicyConfig": dict},
    }


STAND_INS = tuple(_stand_ins())


def _nemo_rl_modules() -> list[str]:
    return [name for name in sys.modules if name == "nemo_rl" or name.startswith("nemo_rl.")]


@contextlib.contextmanager
def vendored_nemo_rl() -> Iterator[SimpleNamespace]:
    """NeMo-RL's vendored ``model_utils`` and ``train`` modules, imported for the block.

    On exit every ``nemo_rl`` module leaves ``sys.modules``, the vendor folder leaves
    ``sys.path``, and Megatron's ``GPTModel.forward`` is restored if NeMo-RL patched it.

    Raises:
        RuntimeError: a ``nemo_rl`` package is already imported (this would mix the two).
    """
    from megatron.core.models.gpt import GPTModel

    if _nemo_rl_modules():
        raise RuntimeError(f"nemo_rl is already imported ({_nemo_rl_modules()[:3]}...); refusing to mix sources")
    forward = GPTModel.forward
    sys.path.insert(0, str(VENDOR))
    try:
        for name, names in _stand_ins().items():
            module = ModuleType(name)
            module.__dict__.update(names)
            sys.modules[name] = module
        import nemo_rl.distributed.model_utils as model_utils
        import nemo_rl.models.megatron.train as train

        for path in (model_utils.__file__, train.__file__):
            if not Path(path).resolve().is_relative_to(VENDOR):
                raise RuntimeError(f"imported {path}, not the vendored source under {VENDOR}")
        yield SimpleNamespace(model_utils=model_utils, train=train)
    finally:
        GPTModel.forward = forward
        for attribute in (
            "_original_forward_for_linear_ce_fusion",
            "_linear_ce_fusion_chunk_size",
            "_linear_ce_fusion_forward_patched",
        ):
            if attribute in GPTModel.__dict__:
                delattr(GPTModel, attribute)
        for name in _nemo_rl_modules():
            del sys.modules[name]
        sys.path.remove(str(VENDOR))


# ---------------------------------------------------------------------------------------------
# Driving NeMo-RL's Megatron train loop (train.megatron_forward_backward) on a model
# ---------------------------------------------------------------------------------------------

# The policy config keys train.py's post-processors read on the padded path.
POLICY_CFG = {"sequence_packing": {"enabled": False}, "logprob_chunk_size": None}


def microbatch(input_ids: torch.Tensor, position_ids: torch.Tensor) -> ProcessedMicrobatch:
    """A padded ``[b, s]`` micro-batch as ``make_processed_microbatch_iterator`` yields it at CP 1
    (the model's ids are the whole ids; causal attention, so no mask)."""
    data = BatchedDataDict(input_ids=input_ids)
    return ProcessedMicrobatch(data, input_ids, input_ids, None, position_ids, None, None)


def log_prob_pass(
    nemo_rl: SimpleNamespace,
    model: torch.nn.Module,
    batch: ProcessedMicrobatch,
    sampling_params: Any,
    fused: bool,
) -> torch.Tensor:
    """NeMo-RL's log-prob pass (the policy worker's ``get_logprobs``): ``megatron_forward_backward``
    with ``forward_only`` and ``LogprobsPostProcessor``; its ``[b, s]`` log-probs (0 first)."""
    train = nemo_rl.train
    processor = train.LogprobsPostProcessor(POLICY_CFG, sampling_params, use_fused_linear_logprobs=fused)
    with torch.no_grad():
        out = train.megatron_forward_backward(
            model, iter([batch]), 1, batch.input_ids.shape[1], batch.input_ids.shape[0], processor,
            forward_only=True, sampling_params=sampling_params, use_fused_linear_logprobs=fused,
        )  # fmt: skip
    return out[0]["logprobs"]


def train_pass(
    nemo_rl: SimpleNamespace,
    model: torch.nn.Module,
    batch: ProcessedMicrobatch,
    sampling_params: Any,
    fused: bool,
    weights: torch.Tensor,
) -> torch.Tensor:
    """NeMo-RL's training step (``megatron_forward_backward``, forward and backward) with the
    loss ``Σ weights · log_probs``; returns the ``[b, s - 1]`` log-probs the loss saw (the
    parameters' ``.grad`` hold the gradient).

    The loss post-processor is NeMo-RL's ``LossPostProcessor`` with ``__call__`` replaced by
    the two branches of NeMo-RL's ``prepare_loss_input`` (``nemo_rl/algorithms/loss/utils.py``,
    not vendored) for a log-prob loss: the fused output as it is, ``[:, : s - 1]``, in fp32; or
    ``get_next_token_logprobs_from_logits`` (vendored model_utils) on the logits.
    """
    from megatron.core import parallel_state as ps

    train, model_utils = nemo_rl.train, nemo_rl.model_utils
    seen: list[torch.Tensor] = []

    class LogProbLoss(train.LossPostProcessor):
        def __call__(self, data_dict: Any, **_: Any) -> Any:
            input_ids = data_dict["input_ids"]

            def loss_fn(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                if fused:
                    log_probs = output_tensor.to(torch.float32)[:, : input_ids.shape[1] - 1]
                else:
                    log_probs = model_utils.get_next_token_logprobs_from_logits(
                        input_ids=input_ids,
                        next_token_logits=output_tensor,
                        vocab_parallel_rank=ps.get_tensor_model_parallel_rank(),
                        vocab_parallel_group=ps.get_tensor_model_parallel_group(),
                        context_parallel_group=ps.get_context_parallel_group(),
                        sampling_params=self.sampling_params,
                    )
                seen.append(log_probs.detach())
                return (log_probs * weights).sum(), {}

            return loss_fn

    processor = LogProbLoss(None, POLICY_CFG, sampling_params=sampling_params)
    train.megatron_forward_backward(
        model, iter([batch]), 1, batch.input_ids.shape[1], batch.input_ids.shape[0], processor,
        forward_only=False, sampling_params=sampling_params, use_fused_linear_logprobs=fused,
    )  # fmt: skip
    return seen[0]
