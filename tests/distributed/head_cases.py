"""Data and runners shared by the head's multi-rank tests (``test_head_*.py``).

Every rank draws the same global data from the same seed (``shared_seed``), computes the
single-rank reference locally (full weight, ``tp_group=None``, the ``torch`` backend: the
oracle), then runs the head on its own part (vocab shard, SP sequence shard, CP chunks) and
compares. Global sizes are small (DESIGN: 2 busy cores) but chosen so every split is uneven
in the interesting way: several tokens per shard, vocab shards of 12/24/48 rows over a backend
vocab chunk of 16, token chunks that cut through sequences.

``MCORE_PPO_TEST_BACKEND`` (default ``torch``) picks the backend of the distributed side; its
device is the suite's (``conftest.DEVICE``: this rank's GPU under NCCL), so the same matrix runs
on GPUs with the Triton kernels. Results stay on that device (collectives need them there); the
comparisons bring both sides to the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from conftest import DEVICE

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends import TorchBackend, TorchConfig

BACKEND = os.environ.get("MCORE_PPO_TEST_BACKEND", "torch")
VOCAB = 96
HIDDEN = 16
TEMPERATURE = 0.7
IGNORE = -100
TP_SIZES = (2, 4, 8)  # TP 8 runs where the world has 8 ranks (skipped, with the reason, elsewhere)
DTYPES = (torch.float64, torch.float32)
# Normwise relative tolerance of a distributed result against the single-rank one of the same
# dtype, and of an fp32 result against the fp64 single-rank result on the same (fp32) data.
TOL_SAME_DTYPE = {torch.float64: 1e-13, torch.float32: 1e-5}
TOL_FP32_VS_FP64 = 1e-5

# Global (unsharded) shapes of the three layouts of docs/design.md §3; every sequence length divides
# by 8 (TP 8 with SP), and the three token counts differ so a reshape bug cannot hide.
SBH = "sbh"  # hidden [s, b, h], labels [b, s]
THD = "thd"  # packed: hidden [t, 1, h], labels [1, t]
NH = "nh"  # hidden [n, h], labels [n]
LAYOUT_SHAPES = {SBH: (16, 3), THD: (24, 1), NH: (40, None)}
# The distributed side runs the torch backend with small chunks (vocab shards of 12/24/48 rows cut
# into 16-row chunks, token chunks of 10 across sequences); the reference keeps the defaults
# (one chunk), so chunking and sharding are checked together.
SMALL_TOKEN_CHUNK = 10
SMALL_VOCAB_CHUNK = 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shard_boundary_ids(vocab: int = VOCAB, tp_sizes: Sequence[int] = TP_SIZES) -> list[int]:
    """The first and last global id of every vocab shard, for every TP size tested."""
    ids = set()
    for tp in tp_sizes:
        rows = vocab // tp
        for r in range(tp):
            ids.update((r * rows, (r + 1) * rows - 1))
    return sorted(ids)


def draw_ids(
    num: int, *, distinct_at: Sequence[int] = (), unusable: Sequence[int] = (), ignore_fraction: float = 0.25
) -> torch.Tensor:
    """``num`` global ids covering every shard, distinct at given positions, ignores sprinkled.

    - every shard's first and last id (:func:`shard_boundary_ids`) appears: they are the first
      ids given to ``distinct_at``, the rest go to random positions outside ``unusable``;
    - positions ``distinct_at`` hold pairwise distinct ids (the CP chunk boundaries);
    - about ``ignore_fraction`` of the remaining positions get ``IGNORE``;
    - ``unusable`` positions never receive a forced id (their value is not used as a label).
    """
    ids = torch.randint(0, VOCAB, (num,))
    must = shard_boundary_ids()
    must = [must[i] for i in torch.randperm(len(must)).tolist()]
    others = [i for i in torch.randperm(VOCAB).tolist() if i not in set(must)]
    pool = must + others
    distinct_at = list(dict.fromkeys(distinct_at))
    if len(distinct_at) > VOCAB:
        raise ValueError("more distinct positions than vocab ids")
    for pos, value in zip(distinct_at, pool, strict=False):
        ids[pos] = value
    taken = set(distinct_at) | set(unusable)
    free = [p for p in torch.randperm(num).tolist() if p not in taken]
    leftover = must[len(distinct_at) :]
    if len(leftover) > len(free):
        raise ValueError("not enough free positions to place every shard's boundary ids")
    for value in leftover:
        ids[free.pop()] = value
    for p in free[: int(ignore_fraction * len(free))]:
        ids[p] = IGNORE
    return ids


def signed_grads(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Per-token upstream gradients of both signs (the first two entries forced + and -)."""
    g = torch.randn(*shape, dtype=torch.float64)
    flat = g.view(-1)
    flat[0] = flat[0].abs() + 0.1
    flat[1] = -flat[1].abs() - 0.1
    return g.to(dtype)


@dataclass
class GlobalCase:
    """One layout's global data (every rank holds the same)."""

    layout: str
    hidden: torch.Tensor  # global [s, b, h] / [t, 1, h] / [n, h]
    weight: torch.Tensor  # full [V, h]
    labels: torch.Tensor  # [b, s] / [1, t] / [n]
    grad_log_prob: torch.Tensor  # like labels
    grad_entropy: torch.Tensor


def make_case(layout: str, dtype: torch.dtype) -> GlobalCase:
    """Fresh global data for ``layout`` (from the global RNG, so identical on every rank)."""
    seq, batch = LAYOUT_SHAPES[layout]
    hidden_shape = (seq, HIDDEN) if batch is None else (seq, batch, HIDDEN)
    label_shape = (seq,) if batch is None else (batch, seq)
    hidden = torch.randn(*hidden_shape, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(VOCAB, HIDDEN, dtype=torch.float64)).to(dtype)
    labels = draw_ids(seq * (batch or 1)).view(label_shape)
    grads = signed_grads(label_shape, dtype), signed_grads(label_shape, dtype)
    return GlobalCase(layout, hidden, weight, labels, *grads)


@dataclass
class HeadResult:
    """Outputs and gradients of one head call (on the device it ran on)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    d_hidden: torch.Tensor
    d_weight: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {
            "log_prob": self.log_prob,
            "entropy": self.entropy,
            "d_hidden": self.d_hidden,
            "d_weight": self.d_weight,
        }


def small_chunks_backend(backend: str, precision: str | None = None):
    """``backend``; the torch backend with chunks of SMALL_* (several chunks, ragged tails),
    built with ``precision`` when one is given."""
    if backend != "torch":
        return backend
    extra = {} if precision is None else {"precision": precision}
    return TorchBackend(TorchConfig(token_chunk=SMALL_TOKEN_CHUNK, vocab_chunk=SMALL_VOCAB_CHUNK, **extra))


def run_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    grad_log_prob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    backend: str = BACKEND,
    device: torch.device = DEVICE,
    small_chunks: bool = True,
    ignore_index: int = IGNORE,
    compiled: bool = False,
    precision: str | None = None,
    validate: bool | None = None,
) -> HeadResult:
    """Forward and backward of the public API on copies of the inputs (leaves on ``device``).

    An upstream gradient of None leaves that output unused (no gradient flows from it).
    ``compiled``: the function under ``torch.compile(fullgraph=True)`` (default options).
    """
    h = hidden.detach().clone().to(device).requires_grad_(True)
    w = weight.detach().clone().to(device).requires_grad_(True)
    head = torch.compile(fused_log_probs_and_entropy, fullgraph=True) if compiled else fused_log_probs_and_entropy
    log_prob, entropy = head(
        h,
        w,
        labels.to(device),
        temperature=TEMPERATURE,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        ignore_index=ignore_index,
        backend=small_chunks_backend(backend, precision) if small_chunks else backend,
        precision=precision,
        validate=validate,
    )
    outputs, grads = [], []
    for out, grad in ((log_prob, grad_log_prob), (entropy, grad_entropy)):
        if grad is not None:
            outputs.append(out)
            grads.append(grad.to(device=device, dtype=out.dtype))
    torch.autograd.backward(outputs, grads)
    return HeadResult(log_prob.detach(), entropy.detach(), h.grad, w.grad)


def reference(
    case: GlobalCase, labels: torch.Tensor | None = None, *, use_entropy: bool = True, precision: str | None = None
) -> HeadResult:
    """Single-rank result on the global data: full weight, ``tp_group=None``, torch backend, CPU."""
    return run_head(
        case.hidden,
        case.weight,
        case.labels if labels is None else labels,
        case.grad_log_prob,
        case.grad_entropy if use_entropy else None,
        backend="torch",
        device=torch.device("cpu"),
        small_chunks=False,
        precision=precision,
    )


def compare(check, actual: HeadResult, expected: HeadResult, dtype: torch.dtype, suite: str) -> None:
    """The four tensors against the single-rank result of the same dtype, recorded per suite and dtype."""
    kind = f"{suite}: {dtype_name(dtype)} vs single-rank"
    expected_tensors = expected.as_dict()
    for name, value in actual.as_dict().items():
        check.close(name, value, expected_tensors[name], tol=TOL_SAME_DTYPE[dtype], kind=kind)


def compare_with_fp64(check, actual: HeadResult, expected64: HeadResult, suite: str) -> None:
    """An fp32 result against the fp64 single-rank result on the same data (its true error)."""
    kind = f"{suite}: float32 vs fp64 single-rank"
    expected_tensors = expected64.as_dict()
    for name, value in actual.as_dict().items():
        check.close(name, value, expected_tensors[name], tol=TOL_FP32_VS_FP64, kind=kind)


def tp_part(result: HeadResult, tp: int, tp_rank: int, sequence_parallel: bool) -> HeadResult:
    """What TP rank ``tp_rank`` should hold of a global result: all outputs, its weight shard's
    gradient, and d_hidden whole (SP off) or its sequence shard (SP on)."""
    d_hidden = result.d_hidden.chunk(tp, dim=0)[tp_rank] if sequence_parallel else result.d_hidden
    return HeadResult(result.log_prob, result.entropy, d_hidden, result.d_weight.chunk(tp, dim=0)[tp_rank])


def upcast(case: GlobalCase) -> GlobalCase:
    """The same data in fp64 (exact upcast of fp32 values), for the fp64 reference."""
    return GlobalCase(
        case.layout,
        case.hidden.double(),
        case.weight.double(),
        case.labels,
        case.grad_log_prob.double(),
        case.grad_entropy.double(),
    )
