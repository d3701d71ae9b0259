"""The head captured in a CUDA graph by ``torch.cuda.make_graphed_callables``.

Run on a GPU (``pytest tests/gpu/test_gpu_cuda_graph.py``); skipped without CUDA. A graphed
head replays the kernels its capture recorded: the same launches, so the same bits as the eager
call, for the forward outputs and both gradients, in the triton backend's recompute and buffer
modes, with a per-token temperature and without the entropy. New values copied into the static
inputs give the eager results of those values (the graph reads the inputs, it did not bake them
in). The default options capture too: on CUDA no check reads a value back (a bad label gives
NaN), so ``validate=True`` needs no host sync.
"""

from __future__ import annotations

import pytest
import torch

from mcore_ppo import fused_log_probs_and_entropy
from mcore_ppo.backends import TritonBackend, TritonConfig
from mcore_ppo_testing.seeds import next_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 2048, 1024, 32000


def _inputs(gen: torch.Generator, per_token_temperature: bool):
    x = (torch.randn(N, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)
    labels[::7] = -100
    t = 0.5 + torch.rand(N, device="cuda", generator=gen) if per_token_temperature else torch.tensor(0.7)
    return x, w, labels, t


def _eager(head, x, w, labels, t, grads):
    xe, we = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    outs = [o for o in head(xe, we, labels, t) if o is not None]
    torch.autograd.backward(outs, grads[: len(outs)])
    return [o.detach() for o in outs], xe.grad, we.grad


@pytest.mark.parametrize("budget", [0, None], ids=["recompute", "buffer"])
@pytest.mark.parametrize("per_token_temperature", [False, True], ids=["T-float", "T-tensor"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "no-entropy"])
def test_graphed_head_replays_the_eager_bits(budget, per_token_temperature, return_entropy):
    seed = next_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # None: the default budget, which holds this shape's buffer.
    backend = TritonBackend(TritonConfig() if budget is None else TritonConfig(buffer_budget_bytes=budget))

    def head(x, w, labels, t):
        temperature = t if per_token_temperature else 0.7
        return fused_log_probs_and_entropy(
            x, w, labels, temperature=temperature, backend=backend, return_entropy=return_entropy, validate=False
        )

    x, w, labels, t = _inputs(gen, per_token_temperature)
    x.requires_grad_(True)
    w.requires_grad_(True)
    grads = [torch.randn(N, device="cuda", generator=gen) for _ in range(2)]
    sample = (x, w, labels, t) if per_token_temperature else (x, w, labels, t.cuda())
    graphed = torch.cuda.make_graphed_callables(
        (lambda x, w, labels, t: tuple(o for o in head(x, w, labels, t) if o is not None)), sample
    )
    for step in range(2):  # the capture's own inputs, then new values copied into them
        if step:
            with torch.no_grad():
                new_x, new_w, new_labels, new_t = _inputs(gen, per_token_temperature)
                x.copy_(new_x)
                w.copy_(new_w)
                labels.copy_(new_labels)
                if per_token_temperature:
                    t.copy_(new_t)
        want, want_dx, want_dw = _eager(head, x, w, labels, t, grads)
        x.grad = w.grad = None
        outs = graphed(*sample)
        torch.autograd.backward(list(outs), grads[: len(outs)])
        assert len(outs) == len(want) == (2 if return_entropy else 1)
        for name, got, ref in zip(("log_p", "entropy")[: len(outs)], outs, want, strict=True):
            assert torch.equal(got, ref), f"{name} differs from the eager call (seed {seed}, step {step})"
        assert torch.equal(x.grad, want_dx), f"d_hidden differs (seed {seed}, step {step})"
        assert torch.equal(w.grad, want_dw), f"d_weight differs (seed {seed}, step {step})"


def test_default_options_capture_and_poison_bad_labels():
    """``validate=True`` (the default) inside capture: nothing is read back, and a bad label
    copied into the static labels gives its token a NaN log-prob on replay."""
    gen = torch.Generator(device="cuda").manual_seed(next_seed())
    x, w, labels, _ = _inputs(gen, False)
    fused_log_probs_and_entropy(x, w, labels, validate=True)  # warm: compiles and caches outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        log_p, _ = fused_log_probs_and_entropy(x, w, labels, validate=True)
    graph.replay()
    assert not log_p.isnan().any()
    labels[1] = V + 5
    graph.replay()
    assert log_p[1].isnan() and not log_p[2:].isnan().any()
