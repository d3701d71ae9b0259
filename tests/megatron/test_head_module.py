"""``VocabParallelFusedPPOHead`` on one rank: Megatron's ColumnParallelLinear with a fused PPO path.

Most tests run without Megatron's ``parallel_state`` (the head then resolves to one rank);
``megatron_state`` initialises a single-process gloo group and ``initialize_model_parallel(1, 1)``
for the cases that need it. Megatron 0.16.1's ``ColumnParallelLinear`` *forward* runs on CPU
without parallel_state, but its backward all-reduces over ``tp_group`` and asserts that the group
is not None; so the logits path (``labels=None``) is differentiated only under ``megatron_state``.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig

import mcore_ppo
from mcore_ppo import VocabParallelFusedPPOHead
from mcore_ppo_testing.reference import IGNORE_INDEX, assert_close, check_invariants, reference
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

H, V = 16, 37


@pytest.fixture
def megatron_state(monkeypatch):
    """A one-process gloo world with Megatron model parallelism initialised (TP 1, PP 1); torn down after."""
    assert not dist.is_initialized(), "another test left torch.distributed initialised"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def make_head(params_dtype=torch.float32, **kwargs) -> VocabParallelFusedPPOHead:
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=params_dtype)
    return VocabParallelFusedPPOHead(H, V, config=config, init_method=torch.nn.init.normal_, **kwargs)


def make_inputs(layout: str, dtype: torch.dtype, gen: torch.Generator):
    shape, lshape = ((7, 3, H), (3, 7)) if layout == "3d" else ((19, H), (19,))
    hidden = (torch.randn(shape, generator=gen) * 0.5).to(dtype)
    labels = torch.randint(0, V, lshape, generator=gen)
    labels.view(-1)[:3] = torch.tensor([0, V - 1, IGNORE_INDEX])
    g, e = torch.randn(lshape, generator=gen), torch.randn(lshape, generator=gen)
    return hidden, labels, g, e


def backward(log_prob, entropy, g, e):
    ((log_prob * g).sum() + (entropy * e).sum()).backward()


def test_construction_without_parallel_state():
    """Megatron's layer is built on one rank: same weight shape, dtype and init as the layer it replaces."""
    assert not dist.is_initialized()
    seed = next_seed()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = make_head()
        torch.manual_seed(seed)
        expected = torch.nn.init.normal_(torch.empty(V, H))
    assert isinstance(head.weight, torch.nn.Parameter) and head.weight.requires_grad
    assert head.weight.shape == (V, H) and head.weight.dtype == torch.float32
    assert torch.equal(head.weight.detach(), expected), "weight must come from init_method, as Megatron's"
    assert head.bias is None


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_forward_equals_functional(layout, params_dtype):
    """head(hidden, labels) is fused_log_probs_and_entropy with head.weight: outputs and gradients."""
    gen = generator(next_seed())
    head = make_head(params_dtype, temperature=0.7)
    hidden, labels, g, e = make_inputs(layout, params_dtype, gen)

    x1 = hidden.clone().requires_grad_(True)
    lp, ent = head(x1, labels)
    check_invariants(lp, ent, labels, V)
    backward(lp, ent, g, e)
    d_weight_head = head.weight.grad.clone()

    x2 = hidden.clone().requires_grad_(True)
    w2 = head.weight.detach().clone().requires_grad_(True)
    lp2, ent2 = mcore_ppo.fused_log_probs_and_entropy(x2, w2, labels, temperature=0.7)
    backward(lp2, ent2, g, e)
    for name, a, b in (("log_prob", lp, lp2), ("entropy", ent, ent2), ("d_hidden", x1.grad, x2.grad)):
        assert torch.equal(a, b), name
    assert torch.equal(d_weight_head, w2.grad), "d_weight"

    ref = reference(hidden, head.weight, labels, 0.7, g, e)
    assert_close(lp, ref["log_prob"], name="log_prob[head]", dtype=params_dtype, rtol=1e-5, track=False)
    assert_close(ent, ref["entropy"], name="entropy[head]", dtype=params_dtype, rtol=1e-5, track=False)


def test_temperature_override():
    """forward(temperature=T) overrides the head's default for that call only."""
    gen = generator(next_seed())
    head = make_head(temperature=1.3)
    hidden, labels, _, _ = make_inputs("3d", torch.float32, gen)
    with torch.no_grad():
        for temperature in (None, 0.7, 1.3):
            lp, ent = head(hidden, labels, temperature=temperature)
            check_invariants(lp, ent, labels, V)
            ref = reference(hidden, head.weight, labels, 1.3 if temperature is None else temperature)
            assert_close(lp, ref["log_prob"], name="log_prob[head]", dtype=torch.float32, rtol=1e-5, track=False)
            assert_close(ent, ref["entropy"], name="entropy[head]", dtype=torch.float32, rtol=1e-5, track=False)
        with pytest.raises(ValueError, match="temperature"):
            head(hidden, labels, temperature=0.0)


def test_sum_pi_squared_option_and_override():
    """``return_sum_pi_squared`` as a constructor option, an attribute (validated when set) and a
    forward keyword, as ``return_entropy``: a third output equal to the function's, no gradient;
    ``output_cross_entropy_loss`` stays one tensor."""
    gen = generator(next_seed())
    hidden, labels, g, _ = make_inputs("3d", torch.float32, gen)
    head = make_head(temperature=0.7, return_sum_pi_squared=True)
    x = hidden.clone().requires_grad_(True)
    lp, _, sp = head(x, labels)
    (lp * g).sum().backward()
    assert not sp.requires_grad and x.grad is not None
    expected = mcore_ppo.fused_log_probs_and_entropy(
        hidden, head.weight.detach(), labels, temperature=0.7, return_sum_pi_squared=True
    )
    assert torch.equal(sp, expected[2]) and torch.equal(lp.detach(), expected[0])
    with torch.no_grad():
        assert len(head(hidden, labels, return_sum_pi_squared=False)) == 2
        assert head(hidden, labels, output_cross_entropy_loss=True).shape == labels.shape
        plain = make_head(temperature=0.7)
        assert len(plain(hidden, labels)) == 2
        plain.weight.copy_(head.weight)
        _, ent2, sp2 = plain(hidden, labels, return_sum_pi_squared=True, return_entropy=False)
        assert ent2 is None and torch.equal(sp2, sp)
        with pytest.raises(TypeError, match="return_sum_pi_squared"):
            plain(hidden, labels, return_sum_pi_squared="yes")
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        plain.return_sum_pi_squared = 1
    plain.return_sum_pi_squared = True
    assert plain.options.return_sum_pi_squared is True
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        make_head(return_sum_pi_squared="yes")


def test_constructor_options():
    """ignore_index is honoured; bias=True and a bad temperature are rejected at construction."""
    gen = generator(next_seed())
    head = make_head(ignore_index=-1)
    hidden, labels, _, _ = make_inputs("2d", torch.float32, gen)
    labels[labels == IGNORE_INDEX] = 1
    labels[5] = -1
    with torch.no_grad():
        lp, ent = head(hidden, labels)
    assert lp[5] == 0 and ent[5] == 0 and (lp[:5] < 0).all()
    with pytest.raises(ValueError, match=r"bias must be False"):
        make_head(bias=True)
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0"):
        make_head(temperature=-1.0)


@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_logits_path_forward(layout):
    """labels=None: the ColumnParallelLinear it replaces, (hidden @ W.T, None); no parallel_state needed."""
    gen = generator(next_seed())
    head = make_head()
    hidden, _, _, _ = make_inputs(layout, torch.float32, gen)
    with torch.no_grad():
        logits, bias = head(hidden)
    assert bias is None
    assert_close(logits, hidden.double() @ head.weight.double().t(), name="logits", dtype=torch.float32, rtol=1e-6)


def test_logits_path_backward(megatron_state):
    """labels=None with Megatron's parallel_state: gradients of hidden @ W.T reach hidden and weight."""
    gen = generator(next_seed())
    head = make_head()
    hidden, _, _, _ = make_inputs("3d", torch.float32, gen)
    upstream = torch.randn(7, 3, V, generator=gen)
    x = hidden.clone().requires_grad_(True)
    logits, _ = head(x)
    (logits * upstream).sum().backward()
    w = head.weight.detach().double()
    assert_close(x.grad, upstream.double() @ w, name="d_hidden[logits]", dtype=torch.float32, rtol=1e-6, track=False)
    d_w = torch.einsum("sbv,sbh->vh", upstream.double(), hidden.double())
    assert_close(head.weight.grad, d_w, name="d_weight[logits]", dtype=torch.float32, rtol=1e-6, track=False)


def test_fused_path_with_parallel_state(megatron_state):
    """With parallel_state initialised the head uses Megatron's (size-1) TP group: same answer."""
    gen = generator(next_seed())
    head = make_head(temperature=0.7)
    assert head.tp_group is not None and dist.get_world_size(head.tp_group) == 1
    hidden, labels, g, e = make_inputs("3d", torch.float32, gen)
    x = hidden.clone().requires_grad_(True)
    lp, ent = head(x, labels)
    check_invariants(lp, ent, labels, V)
    backward(lp, ent, g, e)
    ref = reference(hidden, head.weight, labels, 0.7, g, e)
    assert_close(lp, ref["log_prob"], name="log_prob[head]", dtype=torch.float32, rtol=1e-5, track=False)
    assert_close(ent, ref["entropy"], name="entropy[head]", dtype=torch.float32, rtol=1e-5, track=False)
    for name, got in (("d_hidden", x.grad), ("d_weight", head.weight.grad)):
        assert_close(got, ref[name], name=name, dtype=torch.float32, rtol=1e-5, terms=ref[name + "_terms"], track=False)


@pytest.mark.parametrize("own_weight", [True, False], ids=["own-weight", "skip-allocation"])
def test_tied_weight_passed_in_forward(own_weight):
    """A weight passed to forward (tied embeddings) is used instead of head.weight and gets the gradient."""
    gen = generator(next_seed())
    head = make_head(temperature=1.3, skip_weight_param_allocation=not own_weight)
    assert (head.weight is not None) == own_weight
    embedding = torch.nn.Parameter(torch.randn(V, H, generator=gen) / math.sqrt(H))
    hidden, labels, g, e = make_inputs("3d", torch.float32, gen)
    x = hidden.clone().requires_grad_(True)
    lp, ent = head(x, labels, weight=embedding)
    check_invariants(lp, ent, labels, V)
    backward(lp, ent, g, e)
    ref = reference(hidden, embedding, labels, 1.3, g, e)
    assert_close(lp, ref["log_prob"], name="log_prob[head]", dtype=torch.float32, rtol=1e-5, track=False)
    assert_close(ent, ref["entropy"], name="entropy[head]", dtype=torch.float32, rtol=1e-5, track=False)
    for name, got in (("d_hidden", x.grad), ("d_weight", embedding.grad)):
        assert_close(got, ref[name], name=name, dtype=torch.float32, rtol=1e-5, terms=ref[name + "_terms"], track=False)
    if own_weight:
        assert head.weight.grad is None, "head.weight must not be used when a weight is passed"
    with torch.no_grad():
        logits, _ = head(hidden, weight=embedding)
    assert_close(logits, hidden.double() @ embedding.double().t(), name="logits", dtype=torch.float32, rtol=1e-6)


def test_skipped_weight_must_be_passed():
    head = make_head(skip_weight_param_allocation=True)
    hidden, labels, _, _ = make_inputs("2d", torch.float32, generator(next_seed()))
    with pytest.raises(ValueError, match=r"weight must be passed to forward"):
        head(hidden, labels)


@pytest.mark.parametrize("zero_out_wgrad", [False, True], ids=["dummy", "zeroed-dummy"])
def test_gradient_accumulation_into_main_grad(zero_out_wgrad):
    """Megatron's gradient-accumulation fusion: d_weight is added into weight.main_grad (fp32),
    and autograd gets one reused dummy gradient (zeroed for a ``zero_out_wgrad`` weight, which
    Megatron's DDP hook adds to main_grad), never a fresh ``[V/tp, h]`` tensor per backward.

    Building the layer with ``gradient_accumulation_fusion=True`` needs Megatron's CUDA extension,
    so the flag is switched on after construction, as the behaviour under test is the head's.
    """
    gen = generator(next_seed())
    head = make_head(temperature=0.7)
    head.gradient_accumulation_fusion = True
    if zero_out_wgrad:
        head.weight.zero_out_wgrad = True
    prefill = torch.randn(V, H, generator=gen, dtype=torch.float64)
    head.weight.main_grad = prefill.float().clone()
    hidden, labels, g, e = make_inputs("3d", torch.float32, gen)
    lp, ent = head(hidden, labels)
    check_invariants(lp, ent, labels, V)
    backward(lp, ent, g, e)
    ref = reference(hidden, head.weight, labels, 0.7, g, e)
    assert_close(
        head.weight.main_grad - prefill,
        ref["d_weight"],
        name="d_weight[main_grad]",
        dtype=torch.float32,
        rtol=1e-5,
        atol=1e-6 * prefill.abs().max().item(),  # rounding of the fp32 prefill + d_weight sum
        track=False,
    )
    assert head.weight.grad_added_to_main_grad is True
    dummy = head.weight.grad
    assert dummy is not None and dummy.shape == head.weight.shape
    if zero_out_wgrad:
        assert (dummy == 0).all(), "a zero_out_wgrad weight's dummy is zeroed (DDP's hook adds it)"
    # The next backward hands autograd the same dummy (as Megatron's DDP hook does, drop .grad first).
    head.weight.grad = None
    lp, ent = head(hidden, labels)
    backward(lp, ent, g, e)
    assert head.weight.grad.data_ptr() == dummy.data_ptr()
