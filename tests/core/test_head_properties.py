"""Property-based test of the head against the one fp64 reference, with hypothesis.

Drawn per example: the backend (``torch``; ``triton`` in the interpreter, fp32 only), the dtype
(fp32, fp64; bf16 on the torch backend), the layout ([s,b,h]+[b,s], packed [t,1,h]+[1,t],
[n,h]+[n]), sizes (h and V from 1, ragged), the ignore pattern (none, some, all), the
temperature (from the floor ``MIN_TEMPERATURE`` to 1e4, log-uniform, plus the usual values),
the logit scale, the label dtype (int64/int32/int16, uint8 where the ids fit, with an ignore
index that dtype can hold), which outputs get a gradient, and the data seed. Checked: the
invariants, both outputs and both gradients against :func:`mcore_ppo_testing.reference.reference`;
and Σπ² (``return_sum_pi_squared``, torch backend) against
:func:`mcore_ppo_testing.reference.sum_pi_squared_reference`.

Tolerances (``head_checks`` has the rationale): ``eps`` is the unit roundoff of the computation
(fp32 for fp32/bf16 inputs, fp64 for fp64) and ``scale = max(1, max|x·w| / T)`` the tempered
logit scale. An fp32 logit carries an absolute error of a few ``eps·scale``, which the log-prob
inherits and which moves each ``p_j`` by a relative few ``eps·scale`` (more on the triton
backward, which recomputes the logits in another order: ``validation.MIN_TEMPERATURE``). So
outputs within ``rtol·max|ref| + 16·eps·scale``, gradients within ``rtol + k·eps·scale`` of the
magnitude of the terms they sum (k = 8 torch, 32 triton), and bf16 gradients also within the one
final rounding to bf16 (2^-8 elementwise). The triton backend's buffer backward (drawn beside the
recompute one) takes ``log p`` of a probability below 1e-30 as log(1e-30) (a smaller literal
would make Triton compute in fp64), so terms of such ``p`` carry an absolute error up to
~1e-30·|e|·|x|/T per token: gradients get that much absolute slack on that path.

Bounded for CI: ``MAX_EXAMPLES`` examples per test (environment ``MCORE_PPO_HYPOTHESIS_EXAMPLES``
for a longer local run), no deadline, no example database. Reproducible: hypothesis is seeded
with ``MCORE_PPO_TEST_SEED`` (:func:`mcore_ppo_testing.seeds.base_seed`), so a run draws the same
examples every time and another seed draws others; a failure prints its example.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from head_checks import TRITON_ON_CPU, with_budget

import mcore_ppo
from mcore_ppo.validation import MIN_TEMPERATURE
from mcore_ppo_testing.reference import assert_close, check_invariants, reference, sum_pi_squared_reference
from mcore_ppo_testing.seeds import base_seed, generator

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

MAX_EXAMPLES = int(os.environ.get("MCORE_PPO_HYPOTHESIS_EXAMPLES", "100"))
BOUNDED = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
TEMPERATURES = st.one_of(
    st.sampled_from([MIN_TEMPERATURE, 0.01, 0.7, 1.0, 1.3, 1e4]),
    st.floats(min_value=math.log10(MIN_TEMPERATURE), max_value=4.0).map(lambda p: 10.0**p),
)


@st.composite
def cases(draw, backend: str) -> dict:
    dtypes = [torch.float32] if backend == "triton" else [torch.float32, torch.float64, torch.bfloat16]
    dtype = draw(st.sampled_from(dtypes))
    layout = draw(st.sampled_from(["2d", "3d", "packed"]))
    if layout == "3d":
        seq, batch = draw(st.integers(1, 5)), draw(st.integers(1, 3))
        lead, label_shape = (seq, batch), (batch, seq)
    else:
        n = draw(st.integers(1, 12))
        lead, label_shape = ((n,), (n,)) if layout == "2d" else ((n, 1), (1, n))
    h, vocab = draw(st.integers(1, 16)), draw(st.integers(1, 40))
    label_dtype = draw(st.sampled_from(LABEL_DTYPES))
    ignore_index = draw(st.sampled_from([255, vocab]) if label_dtype == torch.uint8 else st.sampled_from([-100, -1]))
    gen = generator(draw(st.integers(0, 2**31 - 1)))
    logit_std = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    hidden = torch.randn(*lead, h, generator=gen, dtype=torch.float64) * logit_std
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64) / math.sqrt(h)
    labels = torch.randint(0, vocab, label_shape, generator=gen)
    pattern = draw(st.sampled_from(["none", "some", "all"]))
    if pattern != "none":
        ignored = torch.rand(label_shape, generator=gen) < (0.4 if pattern == "some" else 2.0)
        labels[ignored] = ignore_index
    # The triton backend's two backwards: recompute (budget 0) or the probability buffer.
    budget = draw(st.sampled_from([0, 1 << 30])) if backend == "triton" else None
    use = draw(st.sampled_from(["both", "log_prob", "entropy"]))
    g = torch.randn(label_shape, generator=gen) if use != "entropy" else None
    e = torch.randn(label_shape, generator=gen) if use != "log_prob" else None
    return {
        "hidden": hidden.to(dtype),
        "weight": weight.to(dtype),
        "labels": labels.to(label_dtype),
        "ignore_index": ignore_index,
        "temperature": draw(TEMPERATURES),
        "g": g,
        "e": e,
        "buffer_budget_bytes": budget,
    }


def check_against_reference(case: dict, backend: str) -> None:
    hidden, weight, labels = case["hidden"], case["weight"], case["labels"]
    temperature, ignore_index, g, e = case["temperature"], case["ignore_index"], case["g"], case["e"]
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        x,
        w,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        backend=with_budget(backend, case["buffer_budget_bytes"]),
    )
    objective = sum((out * up.to(out.dtype)).sum() for out, up in ((log_prob, g), (entropy, e)) if up is not None)
    objective.backward()
    ref = reference(hidden, weight, labels.long(), temperature, g, e, ignore_index)

    fp64 = hidden.dtype == torch.float64
    if not fp64:
        check_invariants(log_prob, entropy, labels, weight.shape[0], ignore_index)
    eps = 2.0**-53 if fp64 else 2.0**-24
    rtol = 1e-12 if fp64 else 1e-5
    scale = max(1.0, (hidden.double() @ weight.double().t()).abs().max().item() / temperature)
    for name, value in (("log_prob", log_prob), ("entropy", entropy)):
        assert_close(value, ref[name], name=name, dtype=hidden.dtype, rtol=rtol, atol=16 * eps * scale, track=False)
    k = 32 if backend == "triton" else 8
    cast = 2.0**-8 if hidden.dtype == torch.bfloat16 else 0.0
    atol = 1e-30
    if case["buffer_budget_bytes"]:  # the buffer backward's log p floor (module doc)
        upstream = max(t.abs().max().item() for t in (g, e, torch.zeros(1)) if t is not None)
        inputs = max(hidden.abs().max().item(), weight.abs().max().item())
        atol += 1e-29 * upstream * inputs / temperature
    for name, value in (("d_hidden", x.grad), ("d_weight", w.grad)):
        assert value is not None and value.dtype == hidden.dtype, f"{name}: {value}"
        assert_close(
            value,
            ref[name],
            name=name,
            dtype=hidden.dtype,
            rtol=rtol + k * eps * scale,
            atol=atol,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
            track=False,
        )


@seed(base_seed())
@BOUNDED
@given(case=cases("torch"))
def test_torch_backend_matches_fp64_reference(case):
    check_against_reference(case, "torch")


@TRITON_ON_CPU
@seed(base_seed())
@settings(BOUNDED, max_examples=max(1, MAX_EXAMPLES // 2))  # the interpreter is slow
@given(case=cases("triton"))
def test_triton_backend_matches_fp64_reference(case):
    check_against_reference(case, "triton")


@seed(base_seed())
@settings(BOUNDED, max_examples=max(1, MAX_EXAMPLES // 2))
@given(
    n=st.integers(1, 10),
    h=st.integers(1, 12),
    vocab=st.integers(1, 40),
    logit_std=st.sampled_from([0.01, 1.0, 10.0, 100.0]),
    temperature=st.sampled_from([1e-4, 0.3, 1.0, 1e4]),
    data_seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_sum_pi_squared_torch_backend_matches_fp64(n, h, vocab, logit_std, temperature, data_seed, dtype):
    """Any size (V = 1 included), logit scale and temperature: in ``[1/V, 1]`` and within a few
    roundings of the logits' own error (``eps·scale``, as the property test of the head)."""
    gen = generator(data_seed)
    hidden = (torch.randn(n, h, generator=gen, dtype=torch.float64) * logit_std).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen, dtype=torch.float64) / math.sqrt(h)).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, temperature=temperature, backend="torch", return_sum_pi_squared=True
    )[2]
    ref = sum_pi_squared_reference(hidden, weight, labels, temperature)
    valid = labels != -100
    assert torch.all(sp[~valid] == 0)
    assert torch.all(sp[valid] >= (1.0 / vocab) * (1 - 1e-7)) and torch.all(sp[valid] <= 1.0)
    eps = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    scale = max(1.0, (hidden.double() @ weight.double().t()).abs().max().item() / temperature)
    # Σπ² moves by ~2·Σπ²·δz under a logit error δz: relative error a few eps·scale.
    assert torch.all((sp.double() - ref).abs() <= 32 * eps * scale * ref + 1e-300)
