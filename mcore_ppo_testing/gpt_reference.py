"""The logits path of a Megatron GPT model, for parity checks of the fused head (tests, demo).

:func:`logits_log_probs_and_entropy` runs the model as Megatron would without the head — the
output layer's ``[b, s, V/tp]`` logits, gathered over TP (autograd-aware) and log-softmaxed in
float64 — so its values and gradients are the reference the fused path must equal.
:func:`synthetic_batch` builds the small padded and packed batches the tests and demo use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_ppo.parallel.context_parallel import roll_labels
from mcore_ppo.parallel.groups import group_size, resolve_tp_group


def logits_log_probs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    packed_seq_params: PackedSeqParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` float64 ``[b, s]`` from the model's full logits (last stage).

    The model is called with ``labels=None`` (its output layer, fused head or not, then returns
    logits); the vocab shards are all-gathered over Megatron's TP group with
    ``gather_from_tensor_model_parallel_region`` (backward: each rank keeps its shard's
    gradient), so a backward through these outputs reaches every parameter as Megatron's
    unfused path does. Tokens labelled ``ignore_index`` get 0 and no gradient.
    """
    logits = model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
    if group_size(resolve_tp_group()) > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    log_softmax = torch.log_softmax(logits.double() / temperature, dim=-1)
    valid = labels != ignore_index
    picked = log_softmax.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


@dataclass
class GPTBatch:
    """Inputs of one GPT forward: ``[b, s]`` padded or ``[1, t]`` packed (with ``packed_seq_params``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    packed_seq_params: PackedSeqParams | None = None
    cu_seqlens: list[int] | None = None

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`mcore_ppo.gpt_log_probs_and_entropy` (minus labels)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "packed_seq_params": self.packed_seq_params,
        }


def synthetic_batch(
    kind: str,
    *,
    vocab_size: int,
    seq_length: int = 16,
    batch_size: int = 2,
    seq_lengths: tuple[int, ...] = (4, 8, 4),
    prompt_length: int = 3,
    pad_length: int = 2,
    ignore_index: int = -100,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> GPTBatch:
    """A random batch with next-token labels (rolled globally; prompts and padding ignored).

    ``kind="padded"``: ``[batch_size, seq_length]``; each row's first ``prompt_length`` labels
    and last ``pad_length`` positions are ``ignore_index``; causal attention (mask None).
    ``kind="packed"``: ``[1, sum(seq_lengths)]`` THD with ``PackedSeqParams``; positions restart
    per sequence, each sequence is rolled within itself (its last label is ``ignore_index``) and
    its first ``prompt_length // 2`` labels are ignored.
    """
    if kind == "padded":
        ids = torch.randint(0, vocab_size, (batch_size, seq_length), generator=generator)
        labels = roll_labels(ids, seq_dim=1, ignore_index=ignore_index)
        labels[:, :prompt_length] = ignore_index
        if pad_length:
            labels[:, -pad_length:] = ignore_index
        positions = torch.arange(seq_length).expand(batch_size, seq_length).contiguous()
        return GPTBatch(ids.to(device), positions.to(device), labels.to(device))
    if kind == "packed":
        total = sum(seq_lengths)
        bounds = [0]
        for length in seq_lengths:
            bounds.append(bounds[-1] + length)
        ids = torch.randint(0, vocab_size, (1, total), generator=generator)
        labels = roll_labels(ids, seq_dim=1, cu_seqlens=bounds, ignore_index=ignore_index)
        for start in bounds[:-1]:
            labels[:, start : start + prompt_length // 2] = ignore_index
        positions = torch.cat([torch.arange(length) for length in seq_lengths]).unsqueeze(0)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=max(seq_lengths),
            max_seqlen_kv=max(seq_lengths),
        )
        return GPTBatch(ids.to(device), positions.to(device), labels.to(device), None, params, bounds)
    raise ValueError(f"kind must be 'padded' or 'packed', got {kind!r}")


def weighted_backward(
    log_probs: torch.Tensor, entropy: torch.Tensor, grad_log_prob: torch.Tensor, grad_entropy: torch.Tensor
) -> None:
    """Backward of ``Σ g·log_prob + Σ e·entropy``: per-token upstream gradients for both outputs."""
    ((log_probs * grad_log_prob).sum() + (entropy * grad_entropy).sum()).backward()


def pop_parameter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (each must exist), leaving ``.grad`` cleared."""
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"parameter {name} got no gradient"
        grads[name] = param.grad.detach().clone()
        param.grad = None
    return grads
