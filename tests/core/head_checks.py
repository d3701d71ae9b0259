"""Cases, runner and comparison of the head against the float64 reference
(:mod:`mcore_ppo_testing.reference`), shared by ``test_head_reference.py`` (values) and
``test_head_gradients.py`` (gradients).

Tolerances, and why (``rtol`` is relative to the tensor's largest reference value, see
:func:`mcore_ppo_testing.reference.assert_close`):

* Every output is fp32 and every backend statistic is accumulated in fp32, whatever the input
  dtype (bf16 inputs are compared with the fp64 reference of the *same* bf16 values upcast, so
  only the head's own arithmetic is measured). With h ≤ 32 and V ≤ 300, fp32 rounding of the
  GEMM, the exp-sums and the log gives errors of a few 1e-7 relative: ``rtol = 1e-5`` for the
  outputs and for fp32 gradients.
* Gradients of bf16 inputs are accumulated in fp32 and cast to bf16 once at the end; that cast
  alone is a relative error of up to 2^-9 per element, so they get ``elementwise_rtol = 2^-8``
  (a factor 2 of margin) on top of the fp32 ``rtol``. Overall ~1e-2 relative at worst.
* Logits scaled to ~1e4 (see ``test_head_reference.test_extreme_logits``): the fp32 GEMM that produces the
  logits is itself off by ~scale·eps·sqrt(h) (≈1e-3 absolute at 1e4), before the head does
  anything, and the exact answer depends on the logits to first order; so the tolerances there
  are relative to the logit *scale*, not to the outputs.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import TorchBackend, TorchConfig, import_optional
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants
from mcore_ppo_testing.seeds import generator, next_seed

# The triton backend on these tests' CPU tensors: only in Triton's interpreter (conftest turns it
# on where there is no CUDA; on a GPU machine the CPU tensors would be refused, so skip there).
TRITON_ON_CPU = pytest.mark.skipif(
    import_optional("triton") is None or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the triton backend runs CPU tensors only in the interpreter (TRITON_INTERPRET=1)",
)
OUT_RTOL = 1e-5  # fp32 outputs and fp32 gradients, relative to the tensor's max
BF16_CAST_RTOL = 2.0**-8  # the final cast of a gradient to bf16 (2^-9 relative, ×2 margin)
# Probabilities below fp32's smallest normal (~1e-38) flush to 0 in the head but not in the fp64
# reference; their gradient terms are < 1e-38·|x|·|g| — far below this floor.
GRAD_ATOL = 1e-30
LAYOUTS = ("2d", "3d", "packed")
DTYPES = (torch.float32, torch.bfloat16)


def chunked_torch(token_chunk: int, vocab_chunk: int) -> TorchBackend:
    """A torch backend with small chunks, so several chunks and ragged tails are exercised."""
    return TorchBackend(TorchConfig(token_chunk=token_chunk, vocab_chunk=vocab_chunk))


def label_shape(layout: str, tokens: int, batch: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(hidden shape without h, labels shape)`` of a layout with about ``tokens`` tokens."""
    if layout == "2d":
        return (tokens,), (tokens,)
    if layout == "packed":
        return (tokens, 1), (1, tokens)
    seq = max(tokens // batch, 2)
    return (seq, batch), (batch, seq)


def make_case(
    layout: str,
    dtype: torch.dtype,
    vocab: int,
    hidden_size: int,
    tokens: int,
    gen: torch.Generator,
    ignore_fraction: float = 0.3,
    logit_std: float = 3.0,
) -> dict[str, torch.Tensor]:
    """Random hidden, weight, labels (first and last vocab id present, ignored sprinkled) and g, e."""
    lead, lshape = label_shape(layout, tokens)
    hidden = torch.randn(*lead, hidden_size, generator=gen) * logit_std
    weight = torch.randn(vocab, hidden_size, generator=gen) / math.sqrt(hidden_size)
    labels = torch.randint(0, vocab, lshape, generator=gen)
    flat = labels.view(-1)
    ignored = torch.rand(flat.shape, generator=gen) < ignore_fraction
    flat[ignored] = IGNORE_INDEX
    flat[0], flat[-1] = 0, vocab - 1  # both ends of the vocab, always
    g = torch.randn(lshape, generator=gen)
    e = torch.randn(lshape, generator=gen)
    # Per-token upstream gradients of both signs, always.
    g.view(-1)[0], g.view(-1)[-1] = g.view(-1)[0].abs() + 0.1, -g.view(-1)[-1].abs() - 0.1
    e.view(-1)[0], e.view(-1)[-1] = -e.view(-1)[0].abs() - 0.1, e.view(-1)[-1].abs() + 0.1
    return {"hidden": hidden.to(dtype), "weight": weight.to(dtype), "labels": labels, "g": g, "e": e}


def plain_case(
    n: int = 10, h: int = 12, v: int = 29, *, dtype: torch.dtype = torch.float32, ignore_every: int = 4
) -> tuple[torch.Tensor, ...]:
    """``(hidden [n, h], weight [v, h], labels [n], g [n], e [n])`` from the test's next seed, for
    the edge-case tests: weight scaled to unit logits, every ``ignore_every``-th label ignored
    (positions 0, k, 2k, ...; the others valid), fp32 upstream gradients."""
    gen = generator(next_seed())
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::ignore_every] = IGNORE_INDEX
    return hidden, weight, labels, torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def run_head(
    case: dict[str, torch.Tensor],
    temperature: float,
    use: str = "both",
    **kwargs,
) -> dict[str, torch.Tensor | None]:
    """Forward + backward of ``Σ g·log_prob + Σ e·entropy`` (or one term) through the public API.

    Also checks that no input was mutated and that the outputs satisfy the invariants.
    """
    originals = {k: v.clone() for k, v in case.items()}
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    kwargs.setdefault("backend", "torch")
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, case["labels"], temperature=temperature, **kwargs
    )
    check_invariants(log_prob, entropy, case["labels"], case["weight"].shape[0])
    terms = []
    if use in ("both", "log_prob"):
        terms.append((log_prob * case["g"]).sum())
    if use in ("both", "entropy"):
        terms.append((entropy * case["e"]).sum())
    sum(terms).backward()
    for key, value in originals.items():
        assert torch.equal(case[key], value), f"input {key} was mutated"
    assert torch.equal(hidden.detach(), originals["hidden"]) and torch.equal(weight.detach(), originals["weight"])
    return {"log_prob": log_prob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}


def compare(
    out: dict,
    ref: dict,
    dtype: torch.dtype,
    *,
    rtol: float = OUT_RTOL,
    atol: float = 0.0,
    grad_rtol: float = OUT_RTOL,
    tag: str = "",
    grad_tag: str | None = None,
    track_grads: bool = True,
    track_scale: float | None = None,
) -> None:
    """Outputs and both gradients against the reference, with the tolerances of the module doc.

    Gradients are compared relative to the magnitude of the terms they sum (``*_terms`` of the
    reference), so a gradient that cancels to ~0 is not held to an impossible relative bound.
    ``track_scale`` (outputs: error / track_scale; gradients: error / their largest term
    magnitude) replaces the max-norm relative error in the error table, under ``grad_tag``.
    """
    for name in ("log_prob", "entropy"):
        assert_close(out[name], ref[name], name=name + tag, dtype=dtype, rtol=rtol, atol=atol, track_scale=track_scale)
    cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    for name in ("d_hidden", "d_weight"):
        assert out[name] is not None, f"{name} is None: the gradient did not reach the input"
        assert out[name].dtype == dtype, f"{name} dtype {out[name].dtype}, expected {dtype}"
        assert_close(
            out[name],
            ref[name],
            name=name + (tag if grad_tag is None else grad_tag),
            dtype=dtype,
            rtol=grad_rtol,
            atol=GRAD_ATOL,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
            track=track_grads,
            track_scale=None if track_scale is None else ref[name + "_terms"].max().item(),
        )


def with_budget(backend: str, budget: int | None):
    """``backend``, or a ``TritonBackend`` with that probability-buffer budget when one is given."""
    if budget is None:
        return backend
    from mcore_ppo.backends import TritonBackend, TritonConfig

    return TritonBackend(TritonConfig(buffer_budget_bytes=budget))


def entry_point(backend: str):
    """The head's entry for a backend name, and Liger's own entry point for ``"liger"``."""
    if backend == "liger":
        return mcore_ppo.liger_log_probs_and_entropy
    return functools.partial(mcore_ppo.fused_log_probs_and_entropy, backend=backend)


def forbid_vocab_passes(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Every pass over the vocab (the torch and triton backends', the top-k's) raises
    ``AssertionError(why)``: for tests whose refusal must come before any of them."""
    from mcore_ppo.backends import torch_backend
    from mcore_ppo.distill import topk

    def forbidden(*args, **kwargs):
        raise AssertionError(why)

    for name in ("shard_statistics", "shard_gradients", "gather_logits"):
        monkeypatch.setattr(torch_backend.TorchBackend, name, forbidden)
    if import_optional("triton") is not None:
        from mcore_ppo.backends import triton_backend

        for name in ("head_forward", "shard_statistics", "shard_gradients", "gather_logits"):
            monkeypatch.setattr(triton_backend.TritonBackend, name, forbidden)
    monkeypatch.setattr(topk.topk_triton, "shard_topk_triton", forbidden)
    monkeypatch.setattr(topk.topk_torch, "shard_topk_torch", forbidden)
