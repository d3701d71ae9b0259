"""The head inside ``torch.autocast`` and under ``create_graph=True``.

Autocast: with fp32 inputs the head must give inside an autocast region exactly what it gives
outside (autocast would run the torch backend's logit GEMMs in bf16: log-probs off by ~0.1,
gradients by ~10 %). Checked bit for bit against the same call outside autocast, for the
forward and the backward inside the region (on CPU the backward runs on the calling thread and
sees its autocast state) and for a forward inside with the backward outside, on every backend
that runs here (``triton`` in the interpreter), and Liger's entry point through its PyTorch
fallback.

Double backward: the head's backward is not differentiable, so ``create_graph=True`` through it
raises ``NotImplementedError`` naming the head instead of returning wrong second derivatives
(a first-order backward differentiated again would give Hessian-vector products off by 8×).

Forward-mode AD: no backend forms tangents (the triton one would drop them, which forward AD reads
as a zero derivative), so a dual tensor (``torch.autograd.forward_ad``) or a ``torch.func``
transform's tensor (``jvp``, ``jacfwd``, ``vmap``, ``grad``) as hidden or weight raises
``NotImplementedError`` naming the head on every entry point that reaches the head's pass (the
function, ``fused_log_probs_at``, the head module, ``fused_topk``, Liger's entry), on both
backends, whether the inputs require grad or not, before any backend work.
"""

from __future__ import annotations

import pytest
import torch
from head_checks import TRITON_ON_CPU, entry_point, forbid_vocab_passes, plain_case
from torch.autograd import forward_ad

import mcore_ppo
from mcore_ppo.liger import is_available as liger_available
from mcore_ppo.shard import NO_DOUBLE_BACKWARD, NO_FORWARD_AD

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=TRITON_ON_CPU,
    ),
    pytest.param("liger", marks=pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")),
]
DOUBLE_BACKWARD = r"fused PPO head is differentiable once: backward\(create_graph=True\)"


def make_inputs(dtype=torch.float32, n=10, h=24, v=37):
    return plain_case(n, h, v, dtype=dtype, ignore_every=3)


def forward_backward(hidden, weight, labels, g, e, *, backend, autocast_forward, autocast_backward, dtype):
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast_forward):
        logp, ent = entry_point(backend)(x, w, labels, temperature=0.7)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast_backward):
        ((logp * g).sum() + (ent * e).sum()).backward()
    return logp, ent, x.grad, w.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("region", ["forward+backward", "forward"])
def test_same_result_inside_autocast(backend, dtype, region):
    inputs = make_inputs()
    outside = forward_backward(*inputs, backend=backend, autocast_forward=False, autocast_backward=False, dtype=dtype)
    inside = forward_backward(
        *inputs, backend=backend, autocast_forward=True, autocast_backward=region == "forward+backward", dtype=dtype
    )
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), inside, outside, strict=True):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} inside autocast, {b.dtype} outside"
        assert torch.equal(a, b), f"{name} differs inside autocast by {(a - b).abs().max().item():.3g}"


def test_autocast_state_restored_after_the_head():
    """The head turns autocast off for its own work only: the caller's region is unchanged after it."""
    hidden, weight, labels, _, _ = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
        assert torch.is_autocast_enabled("cpu")
        assert (hidden @ weight.t()).dtype == torch.bfloat16


def test_mixed_dtypes_inside_autocast_are_still_refused():
    """Outside autocast bf16 hidden with an fp32 weight is a TypeError; inside it is the same
    error (the head does not cast for autocast), with a hint that autocast does not apply."""
    hidden, weight, labels, _, _ = make_inputs()
    with pytest.raises(TypeError, match=r"weight dtype torch.float32 must match hidden dtype torch.bfloat16; a 16-bit"):
        mcore_ppo.fused_log_probs_and_entropy(hidden.bfloat16(), weight, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"must match hidden dtype torch.bfloat16 \(the head does not follow"):
            mcore_ppo.fused_log_probs_and_entropy(hidden.bfloat16(), weight, labels)


# --- double backward ------------------------------------------------------------------------------


def test_gradgradcheck_raises_instead_of_passing_wrong_values():
    hidden, weight, labels, _, _ = make_inputs(torch.float64, n=4, h=3, v=5)
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)

    def head(x, w):
        return mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.9, backend="torch")

    assert torch.autograd.gradcheck(head, (x, w))  # first order stays exact
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.gradgradcheck(head, (x, w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output", ["log_prob", "entropy"])
def test_create_graph_is_refused(backend, output):
    hidden, weight, labels, g, e = make_inputs()
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    logp, ent = entry_point(backend)(x, w, labels)
    loss = (logp * g).sum() if output == "log_prob" else (ent * e).sum()
    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD) as info:
        torch.autograd.grad(loss, (x, w), create_graph=True)
    assert str(info.value) == NO_DOUBLE_BACKWARD
    # The graph is intact: a plain first-order backward still works afterwards.
    torch.autograd.grad(loss, (x, w))


def test_hessian_vector_product_is_refused():
    hidden, weight, labels, _, _ = make_inputs(torch.float64)

    def objective(x):
        return mcore_ppo.fused_log_probs_and_entropy(x, weight, labels, backend="torch")[0].sum()

    with pytest.raises(NotImplementedError, match=DOUBLE_BACKWARD):
        torch.autograd.functional.hvp(objective, hidden, torch.ones_like(hidden))


def test_create_graph_elsewhere_in_the_graph_is_fine():
    """create_graph over a part of the graph the head is not on never reaches its backward."""
    hidden, weight, labels, _, _ = make_inputs()
    scale = torch.tensor(1.5, requires_grad=True)
    logp, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels)
    penalty = (scale**3) * logp.detach().sum()
    (grad,) = torch.autograd.grad(penalty, scale, create_graph=True)
    (second,) = torch.autograd.grad(grad, scale)
    assert torch.allclose(second, 6 * scale.detach() * logp.sum())


# --- forward-mode AD ---------------------------------------------------------------------------

FORWARD_AD = r"fused PPO head has no forward-mode derivative"
HEAD_BACKENDS = ["torch", pytest.param("triton", marks=TRITON_ON_CPU)]
FORWARD_AD_ENTRIES = ["function", "ids", "head", "topk"]


@pytest.fixture
def no_backend_work(monkeypatch):
    """Every pass over the vocab raises: the refusal comes before any of them."""
    forbid_vocab_passes(monkeypatch, "a pass over the vocab ran before the forward-mode refusal")


def _head_call(entry: str, backend: str, labels: torch.Tensor):
    """``fn(hidden, weight)`` -> the entry point's first output."""
    if entry == "function":
        return lambda x, w: mcore_ppo.fused_log_probs_and_entropy(x, w, labels, backend=backend)[0]
    if entry == "ids":
        ids = torch.stack([labels, labels.flip(0)], dim=-1)
        return lambda x, w: mcore_ppo.fused_log_probs_at(x, w, ids, backend=backend)[0]
    if entry == "topk":
        return lambda x, w: mcore_ppo.fused_topk(x, w, 3, impl=backend).log_probs
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)

    def head(x, w):
        module = mcore_ppo.VocabParallelFusedPPOHead(
            x.shape[-1], w.shape[0], config=config, init_method=torch.nn.init.zeros_, backend=backend,
            skip_weight_param_allocation=True,
        )  # fmt: skip
        return module(x, labels, weight=w)[0]

    return head


def _refused(fn, *args) -> None:
    with pytest.raises(NotImplementedError, match=FORWARD_AD) as info:
        fn(*args)
    assert str(info.value) == NO_FORWARD_AD


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "requires-grad"])
@pytest.mark.parametrize("wrt", ["hidden", "weight"])
@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("backend", HEAD_BACKENDS)
@pytest.mark.parametrize("entry", FORWARD_AD_ENTRIES)
def test_forward_mode_ad_is_refused(entry, backend, mode, wrt, requires_grad, no_backend_work):
    """A dual tensor of ``torch.autograd.forward_ad`` and ``torch.func.jvp``'s, as hidden or weight."""
    hidden, weight, labels, _, _ = make_inputs()
    hidden, weight = hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad)
    fn = _head_call(entry, backend, labels)
    primal = hidden if wrt == "hidden" else weight

    def with_primal(x):
        return fn(x, weight) if wrt == "hidden" else fn(hidden, x)

    if mode == "jvp":
        _refused(torch.func.jvp, with_primal, (primal,), (torch.ones_like(primal),))
        return
    with forward_ad.dual_level():
        _refused(with_primal, forward_ad.make_dual(primal, torch.ones_like(primal)))
        # Inside a dual level, inputs without a tangent are an ordinary call: nothing to refuse.
        assert forward_ad.unpack_dual(hidden).tangent is None


@pytest.mark.parametrize("transform", ["jacfwd", "vmap", "grad"])
def test_other_torch_func_transforms_are_refused(transform, no_backend_work):
    hidden, weight, labels, _, _ = make_inputs()
    fn = _head_call("function", "torch", labels)
    if transform == "jacfwd":
        _refused(torch.func.jacfwd(lambda x: fn(x, weight)), hidden)
    elif transform == "vmap":
        _refused(torch.func.vmap(lambda x: fn(x, weight)), hidden[None].expand(2, -1, -1))
    else:
        _refused(torch.func.grad(lambda x: fn(x, weight).sum()), hidden)


@pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")
def test_forward_ad_is_refused_by_liger_entry():
    hidden, weight, labels, _, _ = make_inputs()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(hidden, torch.ones_like(hidden))
        _refused(mcore_ppo.liger_log_probs_and_entropy, dual, weight, labels)
