"""verl-compatible entry: ``linear_cross_entropy`` with verl's signature and contract.

A verl user switches by import::

    # from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy

The contract is verl's ``LinearCrossEntropy`` (``verl/utils/kernel/linear_cross_entropy.py``):

- ``hidden`` of any shape ``[..., h]`` is flattened to ``[N, h]`` and ``labels`` to ``[N]``
  in their own memory order (no transpose: a Megatron ``[s, b, h]`` hidden pairs with
  ``[s, b]``-ordered labels, as in verl's packed ``b = 1`` THD path).
- ``weight`` is this rank's vocab shard ``[V/tp, h]``; labels are global ids; the rank's index
  in ``dist_process_group`` is its shard index. ``dist_process_group=None`` means one rank
  (Megatron's ``parallel_state`` is *not* consulted, as in verl).
- Returns ``(log_probs, entropy)``, fp32. ``reduction="none"``: both ``[N]``. ``"sum"`` /
  ``"mean"``: ``log_probs`` is the sum / mean over all ``N`` tokens (a 0-d tensor) and
  ``entropy`` stays ``[N]``.
- Backward returns this rank's *partial* ``d_hidden`` (its vocab shard's contribution), shaped
  like ``hidden``: the caller reduces it over TP, as verl's Megatron integration does with
  ``gather_from_sequence_parallel_region`` (SP: reduce-scatter in backward). Without SP wrap
  ``hidden`` in ``copy_to_tensor_model_parallel_region`` first; or use
  :func:`mcore_ppo.fused_log_probs_and_entropy`, which reduces it itself.

Beyond verl: labels equal to ``ignore_index`` (-100) give 0 log-prob, 0 entropy and no
gradient (verl has no ignore index: such labels give undefined values there), CPU tensors and
any hidden size work, and uneven vocab shards are rejected with a clear error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_ppo import validation
from mcore_ppo.backends.base import Backend
from mcore_ppo.head_call import attempt, run_head
from mcore_ppo.options import DEFAULT_OPTIONS, HeadOptions, HiddenGrad, Layout, TokenOrder, call_options

# verl's reductions of the log-probs; its "mean" is over all N tokens, ignored ones included.
_VERL_REDUCTIONS = ("none", "sum", "mean")
# verl's contract: the caller reduces d_hidden over TP (PARTIAL), or, for a caller that reduces
# nothing itself, the head does (REDUCED).
_LAYOUTS = {
    False: Layout(TokenOrder.FLAT, HiddenGrad.PARTIAL),
    True: Layout(TokenOrder.FLAT, HiddenGrad.REDUCED),
}


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor | None = 1.0,
    reduction: str | None = "none",
    dist_process_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int | None = None,
    backend: str | Backend | None = None,
    reduce_hidden_grad: bool = False,
    return_entropy: bool | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """verl's ``linear_cross_entropy``: per-token log-probs and entropy of ``softmax(hidden @ W.T / T)``.

    Args:
        hidden: ``[..., h]``, flattened to ``[N, h]``.
        weight: this rank's vocab shard ``[V/tp, h]``, same dtype as ``hidden``.
        labels: global vocab ids, ``N`` elements in any shape.
        temperature: a Python float > 0 (None means 1.0, as in verl), or a per-token
            floating-point tensor (not in verl): ``N`` elements in the labels' memory order, or
            broadcastable to ``labels``' shape; no gradient (see
            :func:`mcore_ppo.head_call.run_head`).
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (of ``log_probs`` over the ``N`` tokens;
            None means ``"none"``).
        dist_process_group: the TP group; None for one rank.
        ignore_index: label value of tokens to skip (keyword-only; not in verl; default -100).
        backend: ``"auto"`` (default), ``"torch"``, ``"triton"`` or a backend object
            (keyword-only; ``TritonBackend(TritonConfig(buffer_budget_bytes=...))`` sizes the
            triton backend's probability buffer).
        reduce_hidden_grad: keyword-only, not in verl: True sums ``d_hidden`` over TP here
            (for callers that, unlike verl's contract, reduce nothing themselves: the verl
            plugin without sequence parallelism, :mod:`mcore_ppo.integrations.verl`).
        return_entropy: keyword-only, not in verl: False skips the entropy work and returns
            ``(log_probs, None)``.
        validate: keyword-only, not in verl: check label range and temperature values (one
            host sync on CUDA); None: the default (:class:`mcore_ppo.options.HeadOptions`).

    Returns:
        ``(log_probs, entropy)``, fp32: ``[N]`` and ``[N]``, or a 0-d ``log_probs`` for
        ``"sum"`` / ``"mean"``. ``d_hidden`` is this rank's partial (see the module doc).
    """
    if temperature is None:
        temperature = 1.0

    def checked() -> tuple[str, HeadOptions, Layout]:
        mode = "none" if reduction is None else reduction
        if not isinstance(mode, str):
            raise TypeError(f"reduction must be a str, got {validation.type_name(mode)}")
        mode = mode.lower()
        if mode not in _VERL_REDUCTIONS:
            raise ValueError(f"reduction must be one of {_VERL_REDUCTIONS}, got {mode!r}")
        validation.check_bool("reduce_hidden_grad", reduce_hidden_grad)
        options = call_options(
            None, ignore_index=ignore_index, backend=backend, return_entropy=return_entropy, validate=validate
        )
        return mode, options, _LAYOUTS[reduce_hidden_grad]

    (reduction, options, layout), error = attempt(checked, ("none", DEFAULT_OPTIONS, _LAYOUTS[False]))
    validation.check_process_group(dist_process_group, "dist_process_group")
    log_probs, entropy = run_head(
        hidden, weight, labels, temperature, options, tp_group=dist_process_group, layout=layout, prior_error=error
    )
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy
