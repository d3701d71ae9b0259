"""Optional ``liger`` backend: Liger-Kernel's fused linear *scaled* cross-entropy.

Liger returns per-token ``nll`` and entropy of ``softmax(x @ W.T / T)`` through its own
autograd (a CuTe kernel on Hopper bf16 with ``nvidia-cutlass-dsl``, a chunked PyTorch
fallback elsewhere). It does not expose the per-shard softmax statistics of the Backend
protocol, so it implements :class:`~mcore_ppo.backends.base.OutputsBackend` instead:
:func:`mcore_ppo.pipeline.run_head` calls :meth:`LigerBackend.log_probs_and_entropy` in place
of the head's autograd Function, and skips its own TP mapping.

Where its contract fits:
- TP 1: ``LigerFusedLinearScaledCrossEntropyFunction``.
- TP > 1 with hidden replicated (no sequence parallelism): its TP variant
  ``LigerFusedLinearScaledCrossEntropyTPFunction`` (CUDA tensors; its backward already
  returns the TP-reduced ``d_hidden``, so the head must not reduce it again).
- Sequence parallelism: not supported (Liger would need the gathered hidden and a
  reduce-scatter of its gradient); the pipeline raises ``ValueError``.
- verl's entry at TP > 1: not supported (verl's contract returns the *partial* ``d_hidden``,
  Liger's TP variant the reduced one).

Differences from the head's own backends, documented rather than hidden: Liger's entropy is
computed in the input dtype on its CuTe path (bf16 for bf16 inputs; returned here as fp32),
its log-prob error is above the head's contract (docs/benchmarks), its input validation
syncs the host, ignored tokens still cost GEMM work, and ``main_grad`` fusion is not used
(the weight gets a ``.grad`` that Megatron's DDP hook adds to ``main_grad``).
``backend="auto"`` never picks it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from mcore_ppo.backends import import_optional
from parallel.ranks import ProcessGroup, group_size

LIGER_MODULE = "liger_kernel.ops.fused_linear_scaled_cross_entropy"


def _liger() -> ModuleType | None:
    return import_optional(LIGER_MODULE)


@functools.cache
def _device_path_missing(device: torch.device) -> str | None:
    """Why Liger's one-rank function cannot load its kernels for ``device``, or None.

    On Hopper (sm90) liger-kernel >= 0.8.5 dispatches to a CuTe DSL kernel that imports
    ``cutlass`` on first use; without ``nvidia-cutlass-dsl`` that first call raises
    ModuleNotFoundError from deep inside Liger. Asked here once per device, through Liger's own
    dispatcher where this version has one.
    """
    resolve = getattr(_liger(), "_resolve_implementation", None)
    if resolve is None:
        return None
    try:
        resolve(device)
    except ImportError as err:
        return (
            f"liger-kernel runs {torch.cuda.get_device_name(device)} through its CuTe DSL kernels, which need "
            f"nvidia-cutlass-dsl (pip install 'liger-kernel[cutedsl]'): {err}"
        )
    return None


def is_available() -> bool:
    """Liger-Kernel (with its fused linear scaled CE, ≥ 0.8.2) is installed."""
    module = _liger()
    return module is not None and hasattr(module, "LigerFusedLinearScaledCrossEntropyFunction")


class LigerBackend:
    """Liger's fused linear scaled CE behind the head's API (see the module docstring)."""

    name = "liger"
    computes_outputs = True

    def unsupported(
        self, tp_size: int, sequence_parallel: bool, hidden: torch.Tensor, *, reduce_hidden_grad: bool = True
    ) -> str | None:
        """Why Liger cannot run this case, or None when it can."""
        if sequence_parallel and tp_size > 1:
            return "sequence parallelism is not supported by Liger's fused linear scaled CE"
        if hidden.is_cuda and tp_size == 1:
            missing = _device_path_missing(hidden.device)
            if missing is not None:
                return missing
        if tp_size > 1 and not reduce_hidden_grad:
            return "Liger's tensor-parallel function reduces d_hidden itself; this entry must return the partial one"
        if tp_size > 1:
            module = _liger()
            if module is None or not hasattr(module, "LigerFusedLinearScaledCrossEntropyTPFunction"):
                return "this Liger version has no tensor-parallel fused linear scaled CE"
            if not hidden.is_cuda:
                return "Liger's tensor-parallel fused linear scaled CE needs CUDA tensors"
        return None

    def log_probs_and_entropy(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float,
        ignore_index: int,
        tp_group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(log_prob [n], entropy [n])`` for ``hidden [n, h]``, global ``labels [n]``.

        Differentiable through Liger's autograd; ignored tokens give zeros.
        """
        module = _liger()
        if module is None:
            raise RuntimeError("backend='liger' needs liger-kernel (pip install liger-kernel)")
        labels = labels.long()
        if group_size(tp_group) > 1:
            nll, entropy = module.LigerFusedLinearScaledCrossEntropyTPFunction.apply(
                hidden, weight, labels, tp_group, temperature, ignore_index, 1, True
            )
        else:
            nll, entropy = module.LigerFusedLinearScaledCrossEntropyFunction.apply(
                hidden, weight, labels, temperature, ignore_index, 1, True
            )
        return -nll.float(), entropy.float()
