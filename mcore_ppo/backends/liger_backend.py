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

Per-token temperature: Liger's API takes one float. A ``[n]`` temperature tensor is applied by
scaling each hidden row by ``1/T_i`` before Liger's GEMM (at ``T = 1``): ``(x/T_i)·w`` is the
tempered logit up to one fp32 rounding of ``x/T_i``, and autograd carries the ``1/T_i`` into
``d_hidden``; Liger's ``d_W = dzᵀ (x/T)`` is the formula's. Only for fp32 (and fp64) inputs:
for bf16/fp16 the scaled rows would be rounded to the input dtype once more (a relative error
of 2^-9 in every logit, above the head's contract), so that combination raises ValueError (use
``backend="triton"`` or ``"torch"`` there). ``return_entropy=False`` is Liger's own option.

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
        self,
        tp_size: int,
        sequence_parallel: bool,
        hidden: torch.Tensor,
        *,
        reduce_hidden_grad: bool = True,
        per_token_temperature: bool = False,
    ) -> str | None:
        """Why Liger cannot run this case, or None when it can."""
        if per_token_temperature and hidden.dtype not in (torch.float32, torch.float64):
            return (
                f"a per-token temperature tensor with {hidden.dtype} inputs: Liger takes one float temperature, "
                "and scaling the hidden rows by 1/T in their 16-bit dtype would add a rounding to every logit "
                "(module doc); use backend='triton' or 'torch', fp32 inputs, or a float temperature"
            )
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
        temperature: float | torch.Tensor,
        ignore_index: int,
        tp_group: ProcessGroup | None,
        return_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 ``(log_prob [n], entropy [n] or None)`` for ``hidden [n, h]``, global ``labels [n]``.

        Differentiable through Liger's autograd; ignored tokens give zeros. A per-token
        ``temperature`` tensor scales the hidden rows (module doc).
        """
        module = _liger()
        if module is None:
            raise RuntimeError("backend='liger' needs liger-kernel (pip install liger-kernel)")
        labels = labels.long()
        if isinstance(temperature, torch.Tensor):
            if hidden.dtype not in (torch.float32, torch.float64):
                raise ValueError(self.unsupported(1, False, hidden, per_token_temperature=True))
            hidden = hidden * (1.0 / temperature.to(hidden.dtype))[:, None]
            temperature = 1.0
        if group_size(tp_group) > 1:
            out = module.LigerFusedLinearScaledCrossEntropyTPFunction.apply(
                hidden, weight, labels, tp_group, temperature, ignore_index, 1, return_entropy
            )
        else:
            out = module.LigerFusedLinearScaledCrossEntropyFunction.apply(
                hidden, weight, labels, temperature, ignore_index, 1, return_entropy
            )
        if not return_entropy:
            return -_first(out).float(), None
        nll, entropy = out
        return -nll.float(), entropy.float()


def _first(out):
    """Liger's nll whether it returned it alone or in a one-element tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out
