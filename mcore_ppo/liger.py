"""Liger-Kernel's fused linear *scaled* cross-entropy behind the head's checks: an entry point of its own.

Liger returns per-token ``nll`` and entropy of ``softmax(x @ W.T / T)`` through its own autograd
(a CuTe kernel on Hopper bf16 with ``nvidia-cutlass-dsl``, a chunked PyTorch fallback elsewhere).
It exposes no per-shard softmax statistics, so it fits none of the head's backend protocol:
:func:`liger_log_probs_and_entropy` shares the head's argument checks (and their verdict over
the TP group) and its token order, then runs Liger instead of the head's autograd Function.

Where its contract fits:
- TP 1: ``LigerFusedLinearScaledCrossEntropyFunction``.
- TP > 1 with hidden replicated (no sequence parallelism): its TP variant
  ``LigerFusedLinearScaledCrossEntropyTPFunction`` (CUDA tensors; its backward returns the
  TP-reduced ``d_hidden`` itself).
- Sequence parallelism, ``k`` ids per token, verl's partial ``d_hidden``: not supported.

Per-token temperature: Liger's API takes one float. A ``[n]`` temperature tensor is applied by
scaling each hidden row by ``1/T_i`` before Liger's GEMM (at ``T = 1``): ``(x/T_i)·w`` is the
tempered logit up to one fp32 rounding of ``x/T_i``, and autograd carries the ``1/T_i`` into
``d_hidden``. Only for fp32 (and fp64) inputs: for bf16/fp16 the scaled rows would be rounded to
the input dtype once more (a relative error of 2^-9 in every logit, above the head's contract),
so that combination raises ValueError.

Differences from the head, documented rather than hidden: Liger's entropy is computed in the
input dtype on its CuTe path (bf16 for bf16 inputs; returned here as fp32), its log-prob error
is above the head's contract (docs/benchmarks), its input validation syncs the host, ignored
tokens still cost GEMM work, and ``main_grad`` fusion is not used (the weight gets a ``.grad``
that Megatron's DDP hook adds to ``main_grad``). Like the head, it runs with autocast off and
refuses a double backward.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from mcore_ppo.backends import import_optional
from mcore_ppo.head_call import attempt, check_call
from mcore_ppo.options import DEFAULT_OPTIONS, call_options, megatron_layout
from mcore_ppo.parallel.groups import resolve_tp_group
from mcore_ppo.parallel.ranks import ProcessGroup, group_size
from mcore_ppo.shard import autocast_off, refuse_double_backward
from mcore_ppo.tokens import from_rows, hidden_rows, to_rows

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


def liger_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: ProcessGroup | None = None,
    ignore_index: int | None = None,
    return_entropy: bool | None = None,
    validate: bool | None = None,
    return_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`mcore_ppo.fused_log_probs_and_entropy`'s contract, computed by Liger-Kernel.

    The arguments, layouts (no sequence parallelism, one label per token) and checks are the
    head's; see the module doc for what Liger supports and how it differs.
    ``return_sum_pi_squared`` must stay False: Liger's kernel returns whole outputs, not the
    per-shard sums Σπ² is made of (use :func:`mcore_ppo.fused_log_probs_and_entropy`).

    Raises:
        TypeError, ValueError: as the head, and ValueError for a case Liger cannot run (naming
            why), for ``return_sum_pi_squared=True``, or where liger-kernel (with its fused
            linear scaled CE) is not installed.
    """

    def build():
        options = call_options(
            None, ignore_index=ignore_index, backend=None, return_entropy=return_entropy, validate=validate,
            return_sum_pi_squared=return_sum_pi_squared,
        )  # fmt: skip
        if options.return_sum_pi_squared:
            raise ValueError(
                "return_sum_pi_squared=True is not supported by liger_log_probs_and_entropy: Liger-Kernel's fused "
                "linear cross-entropy returns whole outputs, not the per-shard sums Σπ² comes from; use "
                "mcore_ppo.fused_log_probs_and_entropy(..., return_sum_pi_squared=True)"
            )
        return options

    options, error = attempt(build, DEFAULT_OPTIONS)
    tp_group = resolve_tp_group(tp_group)
    call = check_call(
        hidden, weight, labels, temperature, options, tp_group, megatron_layout(False), ids=False,
        unsupported=functools.partial(_unsupported, temperature=temperature, tp_group=tp_group), prior_error=error,
    )  # fmt: skip
    module = _liger()
    batch_first = labels.dim() == 2
    tokens, token_labels = hidden_rows(hidden), to_rows(call.labels, batch_first)
    row_temperature = call.temperature if isinstance(call.temperature, torch.Tensor) else None
    with autocast_off(hidden.device):
        if row_temperature is not None:
            tokens = tokens * (1.0 / row_temperature.to(tokens.dtype))[:, None]
        scale = 1.0 if row_temperature is not None else call.temperature
        if group_size(tp_group) > 1:
            out = module.LigerFusedLinearScaledCrossEntropyTPFunction.apply(
                tokens, weight, token_labels, tp_group, scale, options.ignore_index, 1, options.return_entropy
            )
        else:
            out = module.LigerFusedLinearScaledCrossEntropyFunction.apply(
                tokens, weight, token_labels, scale, options.ignore_index, 1, options.return_entropy
            )
    if options.return_entropy:
        log_probs, entropy = -out[0].float(), out[1].float()
    else:
        log_probs, entropy = -_first(out).float(), None
    if call.bad_temperature is not None and not options.validate:
        log_probs = log_probs.masked_fill(call.bad_temperature, torch.nan)
        entropy = None if entropy is None else entropy.masked_fill(call.bad_temperature, torch.nan)
    _guard_backward(hidden.device, *(out if isinstance(out, (tuple, list)) else (out,)))
    if batch_first:
        batch, seq = labels.shape
        log_probs = from_rows(log_probs, True, batch, seq)
        entropy = None if entropy is None else from_rows(entropy, True, batch, seq)
    return log_probs, entropy


def _guard_backward(device: torch.device, *outputs: torch.Tensor | None) -> None:
    """Liger's backward node runs with autocast off and refuses ``create_graph=True``, as the
    head's Function does: hooks on the node itself (on CPU the backward runs on the caller's
    thread, inside its autocast region; a double backward would differentiate Liger's
    precomputed gradients as constants)."""
    nodes = {out.grad_fn for out in outputs if out is not None and out.grad_fn is not None}
    for node in nodes:
        entered: list = []

        def before(grad_outputs, entered=entered):
            # Grad mode is on inside a backward exactly with create_graph=True.
            refuse_double_backward()
            context = autocast_off(device)
            context.__enter__()
            entered.append(context)

        def after(grad_inputs, grad_outputs, entered=entered):
            entered.pop().__exit__(None, None, None)

        node.register_prehook(before)
        node.register_hook(after)


def _unsupported(hidden: torch.Tensor, *, temperature: object, tp_group: ProcessGroup | None) -> str | None:
    """Why Liger cannot run this case, or None when it can."""
    reason = _why_not(hidden, temperature, tp_group)
    return None if reason is None else f"Liger-Kernel cannot run these inputs: {reason}"


def _why_not(hidden: torch.Tensor, temperature: object, tp_group: ProcessGroup | None) -> str | None:
    if not is_available():
        return "liger-kernel with its fused linear scaled cross entropy is not installed (pip install liger-kernel)"
    if isinstance(temperature, torch.Tensor) and hidden.dtype not in (torch.float32, torch.float64):
        return (
            f"a per-token temperature tensor with {hidden.dtype} inputs: Liger takes one float temperature, "
            "and scaling the hidden rows by 1/T in their 16-bit dtype would add a rounding to every logit "
            "(module doc); use the head, fp32 inputs, or a float temperature"
        )
    tp_size = group_size(tp_group)
    if hidden.is_cuda and tp_size == 1:
        missing = _device_path_missing(hidden.device)
        if missing is not None:
            return missing
    if tp_size > 1:
        if not hasattr(_liger(), "LigerFusedLinearScaledCrossEntropyTPFunction"):
            return "this Liger version has no tensor-parallel fused linear scaled CE"
        if not hidden.is_cuda:
            return "Liger's tensor-parallel fused linear scaled CE needs CUDA tensors"
    return None


def _first(out):
    """Liger's nll whether it returned it alone or in a one-element tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out
