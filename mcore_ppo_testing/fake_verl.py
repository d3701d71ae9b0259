"""A stand-in ``verl`` package tree for testing :mod:`mcore_ppo.integrations.verl` on CPU.

verl itself needs Ray, tensordict, transformers and more to import, so the tests write this
small tree instead. It keeps what the plugin depends on, read from verl-project/verl at
1dda039b (2026-08-22) and the verl 0.9.1 wheel:

- ``verl/__init__.py``: ``VERL_USE_EXTERNAL_MODULES`` (comma-separated modules imported), then
  every entry point of the ``verl.plugins`` group loaded (``VERL_USE_EXTERNAL_PLUGINS``: ``auto``,
  ``none`` or names), a failing one logged at DEBUG and skipped — in that order.
- ``verl/utils/kernel/linear_cross_entropy.py``: ``linear_cross_entropy(hidden, weight, labels,
  temperature=1.0, reduction="none", dist_process_group=None)`` -> flat ``[N]`` fp32 log-probs
  and entropy. Here a torch computation for one rank (verl's is a Triton kernel); every call
  is counted in ``CALLS`` so a test sees which function ran.
- ``verl/models/mcore/model_forward_fused.py`` and ``model_forward_1f1b_overlap.py``: bind
  ``linear_cross_entropy`` at import time (``from verl.utils.kernel.linear_cross_entropy import
  linear_cross_entropy``) and call it after Megatron's SP all-gather when
  ``config.sequence_parallel``, with the TP group from ``parallel_state``, as verl's
  ``fused_output_processor``, ``_fused_GPTModel_forward`` and the 1F1B ``_postprocess`` do;
  ``fused_forward_model_engine`` keeps only the arguments the plugin reads
  (``temperature``, ``calculate_entropy``). verl's engine module itself is not stood in for:
  ``tests/integrations/test_verl_live.py`` runs the real one.
- a ``*.dist-info`` declaring the entry points given, so ``importlib.metadata`` finds them
  when the tree's root is on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

_FILES = {
    "verl/__init__.py": """
import importlib
import logging
import os

modules = os.getenv("VERL_USE_EXTERNAL_MODULES", "")
if modules:
    for module in modules.split(","):
        importlib.import_module(module)

_plugins_policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
if _plugins_policy != "none":
    from importlib.metadata import entry_points as _entry_points

    _allowed = None if _plugins_policy == "auto" else {n.strip() for n in _plugins_policy.split(",") if n.strip()}
    for _ep in _entry_points(group="verl.plugins"):
        if _allowed is not None and _ep.name not in _allowed:
            continue
        try:
            _ep.load()
        except Exception as _e:
            logging.getLogger(__name__).debug("Failed to load plugin '%s': %s", _ep.name, _e)
""",
    "verl/utils/__init__.py": "",
    "verl/utils/kernel/__init__.py": "",
    "verl/utils/kernel/linear_cross_entropy.py": """
import torch

CALLS = []


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    CALLS.append("verl")
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t() / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy
""",
    "verl/models/__init__.py": "",
    "verl/models/mcore/__init__.py": "",
    "verl/models/mcore/model_forward_fused.py": """
from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy


@dataclass
class FusedOutputProcessorContext:
    temperature: float


@dataclass
class CausalLMOutputForPPO:
    log_probs: object = None
    entropy: object = None


def fused_output_processor(*, hidden_states, output_layer, output_weight, labels, context, config, **_ignored):
    output = CausalLMOutputForPPO()
    if config.sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    weight = output_weight if output_weight is not None else output_layer.weight
    logprobs, entropy = linear_cross_entropy(
        hidden_states, weight, labels, context.temperature, "none", parallel_state.get_tensor_model_parallel_group()
    )
    output.entropy = entropy
    output.log_probs = logprobs
    return output


def _fused_GPTModel_forward(model, hidden_states, labels, temperature=1.0):
    # verl's patched GPTModel.forward, after the decoder: the same call with the model's config.
    if model.config.sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    logprobs, entropy = linear_cross_entropy(
        hidden_states, model.output_layer.weight, labels, temperature, "none",
        parallel_state.get_tensor_model_parallel_group(),
    )
    return CausalLMOutputForPPO(log_probs=logprobs, entropy=entropy)


def fused_forward_model_engine(vision_model=False):
    # verl's engine entry, reduced to its arguments the plugin reads; the model here is a stand-in
    # whose forward is _fused_GPTModel_forward (verl binds it so in patch_fused_forward).
    def fused_forward_model_engine_inner(model, hidden_states, labels, temperature, calculate_entropy):
        output = model.forward(hidden_states, labels, temperature=temperature)
        return {"log_probs": output.log_probs} | ({"entropy": output.entropy} if calculate_entropy else {})

    return fused_forward_model_engine_inner
""",
    "verl/models/mcore/model_forward_1f1b_overlap.py": """
from megatron.core import parallel_state

from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy


def postprocess(hidden_states, weight, labels_rmpad, temperature, sequence_parallel):
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    return linear_cross_entropy(
        hidden_states, weight, labels_rmpad, temperature, "none", parallel_state.get_tensor_model_parallel_group()
    )
""",
}


def write_fake_verl(root: Path, entry_points: dict[str, str]) -> Path:
    """Write the tree under ``root`` with ``entry_points`` (name -> object reference) in the
    ``verl.plugins`` group of a stand-in distribution; returns ``root`` (put it on ``sys.path``)."""
    for relative, text in _FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip("\n"))
    dist_info = root / "mcore_ppo_verl_plugin_test-0.0.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: mcore-ppo-verl-plugin-test\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[verl.plugins]\n{lines}")
    return root
