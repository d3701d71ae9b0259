"""verl's Megatron engine on the CPU: what its model build and optimizer assume about CUDA.

Applied in the actor workers only (when verl's Megatron engine module is imported), on top of
:func:`mcore_ppo_testing.cpu_shims.install_cpu_shims` (Megatron's own CUDA assumptions):

- ``.cuda()`` on modules and tensors stays on the CPU: mbridge's ``get_model`` moves the model
  with ``model.cuda(torch.cuda.current_device())`` and verl moves batches and buffers with it.
- ``Tensor.type()`` (no argument) names a CPU float tensor as its CUDA type: Megatron's mixed
  precision optimizers accept parameters only as ``torch.cuda.{Float,Half,BFloat16}Tensor``.
- mbridge's layer spec is TransformerEngine's (CUDA only): the bridge builds the local spec
  of :func:`mcore_ppo_testing.layer_specs.local_gpt_spec` (the reference attention, which runs
  verl's packed THD batches, and norms that run under SP), and its weight-name mapping looks the
  local spec's two norms up under TransformerEngine's names (``hf_models.te_norm_name``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install_engine_shims"]

_INSTALLED: dict[str, Any] = {}
_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _module_cuda(self: torch.nn.Module, device: object = None) -> torch.nn.Module:
    return self


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def install_engine_shims() -> None:
    """Install the CPU shims for verl's Megatron engine in this process (idempotent)."""
    if _INSTALLED or torch.cuda.is_available():
        return
    from mbridge.core.llm_bridge import LLMBridge

    from mcore_ppo_testing.cpu_shims import install_cpu_shims
    from mcore_ppo_testing.hf_models import te_norm_name
    from mcore_ppo_testing.layer_specs import local_gpt_spec

    install_cpu_shims()
    tensor_type = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        return tensor_type(self, *args, **kwargs)

    mapping = LLMBridge._weight_name_mapping_mcore_to_hf
    _INSTALLED.update(module_cuda=torch.nn.Module.cuda, tensor_cuda=torch.Tensor.cuda, tensor_type=tensor_type)
    torch.nn.Module.cuda = _module_cuda
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = cuda_named_type
    LLMBridge._get_transformer_layer_spec = lambda self, vp_stage=None: local_gpt_spec()(self.config)
    LLMBridge._weight_name_mapping_mcore_to_hf = lambda self, name: mapping(self, te_norm_name(name))
