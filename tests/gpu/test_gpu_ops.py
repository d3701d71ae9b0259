"""The head as torch ops on CUDA: no host sync in a training call, ``torch.compile`` with
inductor, saved-tensor hooks that offload the probability buffer.

Run on a GPU (``pytest tests/gpu/test_gpu_ops.py``); skipped without CUDA.

- Every entry point's head call (the function, ``fused_log_probs_at``, the head module, verl's
  ``linear_cross_entropy``, the NeMo-RL adapter), forward and backward with default options,
  after a warm-up call, runs under ``torch.cuda.set_sync_debug_mode("error")``: any host sync
  raises.
- ``torch.compile(fullgraph=True)`` with default options (inductor) of the function, of
  ``fused_log_probs_at`` and of the head module's forward: outputs and gradients equal eager's.
- An offloading ``saved_tensors_hooks`` pair moves every saved tensor to the CPU and back
  (the buffer among them): gradients equal.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import TritonBackend, TritonConfig
from mcore_ppo_testing.seeds import next_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V, K = 1024, 512, 8192, 4


def _inputs(seed: int, *, ids: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(N, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, V, (N, K) if ids else (N,), device="cuda", generator=gen)
    labels[::5] = -100
    return x.requires_grad_(True), w.requires_grad_(True), labels


@contextlib.contextmanager
def _sync_is_an_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _train_call(head, x, w, labels):
    outs = [o for o in head(x, w, labels) if o is not None]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _function(x, w, labels):
    return mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7)


def _student(x, w, labels):
    return mcore_ppo.fused_log_probs_at(x, w, labels, temperature=0.7)


def _verl(x, w, labels):
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy

    return linear_cross_entropy(x, w, labels, 0.7)


ENTRIES = {"function": (_function, False), "fused_log_probs_at": (_student, True), "verl": (_verl, False)}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_training_call_makes_no_host_sync(entry):
    head, ids = ENTRIES[entry]
    x, w, labels = _inputs(next_seed(), ids=ids)
    _train_call(head, x, w, labels)  # warm: kernels compiled, plans cached
    with _sync_is_an_error():
        _train_call(head, x, w, labels)
        with torch.no_grad():
            head(x, w, labels)


def test_head_module_call_makes_no_host_sync(megatron_tp1):
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(params_dtype=torch.bfloat16, use_cpu_initialization=True)
    head = mcore_ppo.VocabParallelFusedPPOHead(
        H, V, config=config, init_method=torch.nn.init.xavier_normal_, temperature=0.7
    ).cuda()
    x, _, labels = _inputs(next_seed())
    hidden, batch_labels = x.detach().view(N // 2, 2, H).requires_grad_(True), labels.view(N // 2, 2).t()
    _train_call(lambda x_, w_, l_: head(x_, l_), hidden, None, batch_labels)
    with _sync_is_an_error():
        _train_call(lambda x_, w_, l_: head(x_, l_), hidden, None, batch_labels)


@pytest.mark.parametrize("entry", ["function", "fused_log_probs_at"])
def test_compiled_with_inductor_equals_eager(entry):
    head, ids = ENTRIES[entry]
    x, w, labels = _inputs(next_seed(), ids=ids)
    results = []
    for run in (head, torch.compile(head, fullgraph=True)):
        x.grad = w.grad = None
        outs = [o for o in run(x, w, labels) if o is not None]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        results.append(([o.detach() for o in outs], x.grad.clone(), w.grad.clone()))
    (outs, dx, dw), (c_outs, c_dx, c_dw) = results
    for a, b in zip(outs, c_outs, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(c_dx, dx, rtol=0, atol=0)
    torch.testing.assert_close(c_dw, dw, rtol=0, atol=0)


def test_offloading_hooks_see_the_buffer():
    """Every saved tensor moved to the CPU on pack and back on unpack (activation offloading):
    the probability buffer is among them and the gradients are bit for bit those without."""
    backend = TritonBackend(TritonConfig(buffer_budget_bytes=1 << 30))
    x, w, labels = _inputs(next_seed())

    def grads(offload: bool):
        xe, we = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.device, t.to("cpu")

        def unpack(stored):
            device, cpu = stored
            return cpu.to(device)

        context = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if offload else contextlib.nullcontext()
        with context:
            log_p, entropy = mcore_ppo.fused_log_probs_and_entropy(xe, we, labels, temperature=0.7, backend=backend)
        (log_p.sum() + entropy.sum()).backward()
        return xe.grad, we.grad, packed

    dx, dw, _ = grads(False)
    o_dx, o_dw, packed = grads(True)
    assert (N, V) in packed, packed
    assert torch.equal(dx, o_dx) and torch.equal(dw, o_dw)


def test_nemo_rl_adapter_call_makes_no_host_sync():
    """NeMo-RL's fused hidden-states call, as its patched GPT forward makes it (one rank, padded)."""
    from mcore_ppo.integrations.nemo_rl import from_parallel_hidden_states_to_logprobs

    x, w, labels = _inputs(next_seed())
    hidden = x.detach().view(N // 2, 2, H).requires_grad_(True)
    target = labels.view(N // 2, 2).t().clamp(min=0)

    def call(x_, w_, target_):
        log_probs = from_parallel_hidden_states_to_logprobs(
            x_, w_, None, target_, vocab_start_index=0, vocab_end_index=V, inference_only=False, tp_group=None,
            cp_group=None, chunk_size=128,
        )  # fmt: skip
        return log_probs if isinstance(log_probs, tuple) else (log_probs,)

    _train_call(call, hidden, w, target)
    with _sync_is_an_error():
        _train_call(call, hidden, w, target)
