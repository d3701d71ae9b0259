"""Per-token temperature tensors and ``return_entropy=False``, on every backend, against fp64.

Per-token temperature: token ``i``'s logits are divided by ``T_i`` (a tensor shaped like the
labels or broadcastable to them); values and both gradients against the fp64 reference of the
same per-token temperatures (:func:`mcore_ppo_testing.reference.reference`), with the
tolerances of ``head_checks`` (fp32 rounding, bf16's final gradient cast). A tensor filled with
one value gives exactly, bit for bit, what the float gives (the float path is unchanged).

Entropy off: ``(log_probs, None)``; the log-probs and the gradients of ``Σ g·log_prob`` are bit
for bit those of the entropy-on call whose entropy is unused (no entropy term reaches them).

Bad temperature tensors raise naming ``temperature`` (type, shape, device, values); without
the value check (``validate=False``) a bad value poisons its token's outputs with NaN and
leaves the other tokens exact.

Σπ² (``return_sum_pi_squared=True``): per token ``Σ_v softmax(z/T)_v²`` against the fp64
full-softmax reference (:func:`mcore_ppo_testing.reference.sum_pi_squared_reference`), on every
backend (torch, one chunk and several; triton fused, buffer, recompute, its generic forward,
and tiles that cut V = 37 into two vocab splits), entropy on and off, per-token temperatures,
16-bit and fp64 inputs, ignored tokens, ``k`` ids, verl's flat order. The option changes no
other output or gradient (bit for bit); the default return is two outputs; Σπ² carries no
gradient; a bad type is a ``TypeError`` naming it; a bad temperature with ``validate=False``
gives NaN for its token; Liger's entry refuses it. Tolerance: a ratio of fp32 sums (``Q / S²``),
``OUT_RTOL`` relative to its largest value as the other outputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from head_checks import BF16_CAST_RTOL, GRAD_ATOL, OUT_RTOL, TRITON_ON_CPU, entry_point, make_case, with_budget

import mcore_ppo
from mcore_ppo import validation
from mcore_ppo.backends import TorchBackend, TorchConfig, import_optional
from mcore_ppo.head_call import run_head
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy
from mcore_ppo.options import DEFAULT_LAYOUT, HeadOptions, HiddenGrad, Layout, TokenOrder
from mcore_ppo.parallel import split_for_cp, split_temperature_for_cp
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.reference import assert_close, check_invariants, reference, sum_pi_squared_reference
from mcore_ppo_testing.seeds import generator, next_seed

LIGER = pytest.mark.skipif(import_optional("liger_kernel") is None, reason="liger-kernel is not installed")
# (backend name, buffer budget): the triton backend in buffer mode and in recompute mode.
BACKENDS = [
    pytest.param("torch", None, id="torch"),
    pytest.param("triton", 1 << 30, id="triton-buffer", marks=TRITON_ON_CPU),
    pytest.param("triton", 0, id="triton-recompute", marks=TRITON_ON_CPU),
    pytest.param("liger", None, id="liger", marks=LIGER),
]
VOCAB, HIDDEN, TOKENS = 37, 16, 12


def _temperature(labels: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Temperatures in [0.3, 2.5]: ``token`` shaped like labels, ``sequence`` one per row
    (``[b, 1]``; ``[1]`` for 1-D labels), ``scalar`` a 0-d tensor."""
    shape = {"token": labels.shape, "sequence": (*labels.shape[:-1], 1), "scalar": ()}[kind]
    return 0.3 + 2.2 * torch.rand(shape, generator=gen)


def _run(case, temperature, *, use_entropy=True, return_entropy=True, **kwargs):
    """Forward + backward of ``Σ g·log_prob (+ Σ e·entropy)``; returns outputs and gradients."""
    hidden = case["hidden"].detach().requires_grad_(True)
    weight = case["weight"].detach().requires_grad_(True)
    head = entry_point(kwargs.pop("backend"))
    log_prob, entropy = head(
        hidden, weight, case["labels"], temperature=temperature, return_entropy=return_entropy, **kwargs
    )
    loss = (log_prob * case["g"]).sum()
    if use_entropy and entropy is not None:
        loss = loss + (entropy * case["e"]).sum()
    loss.backward()
    return {"log_prob": log_prob, "entropy": entropy, "d_hidden": hidden.grad, "d_weight": weight.grad}


def _compare(out, ref, dtype, *, with_entropy=True, tag="", backend="torch"):
    """Outputs fp32-exact; gradients relative to their terms' magnitudes. The triton backend
    rounds ``dz`` to 16 bits before its GEMMs for 16-bit inputs (tests/backends'
    test_16bit_inputs_match_fp64 has the same bounds)."""
    names = ("log_prob", "entropy") if with_entropy else ("log_prob",)
    for name in names:
        assert_close(out[name], ref[name], name=name + tag, dtype=dtype, rtol=OUT_RTOL)
    cast = BF16_CAST_RTOL if dtype == torch.bfloat16 else 0.0
    grad_rtol = OUT_RTOL
    if backend == "triton" and dtype == torch.bfloat16:
        grad_rtol, cast = 1e-2, 8e-3
    for name in ("d_hidden", "d_weight"):
        assert out[name] is not None and out[name].dtype == dtype, name
        assert_close(
            out[name],
            ref[name],
            name=name + tag,
            dtype=dtype,
            rtol=grad_rtol,
            atol=GRAD_ATOL,
            elementwise_rtol=cast,
            terms=ref[name + "_terms"],
        )


def _kwargs(backend: str, budget: int | None) -> dict:
    return {"backend": with_budget(backend, budget)}


# --- per-token temperature -------------------------------------------------------------------------


# Liger refuses a temperature tensor with 16-bit inputs (test_liger_refuses_16bit_tensor).
@pytest.mark.parametrize(
    "backend,budget,dtype",
    [
        pytest.param(*p.values, dtype, id=f"{p.id}-{name}", marks=p.marks)
        for p in BACKENDS
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
        if (p.values[0], dtype) != ("liger", torch.bfloat16)
    ],
)
@pytest.mark.parametrize("layout", ["2d", "3d", "packed"])
def test_per_token_temperature_matches_fp64(backend, budget, layout, dtype):
    gen = generator(next_seed())
    case = make_case(layout, dtype, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], "token", gen)
    out = _run(case, temperature, **_kwargs(backend, budget))
    check_invariants(out["log_prob"], out["entropy"], case["labels"], VOCAB)
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], case["e"])
    _compare(out, ref, dtype, tag="[T per token]", backend=backend)


@pytest.mark.parametrize("backend,budget", BACKENDS[:3])
@pytest.mark.parametrize("kind", ["sequence", "scalar"])
def test_broadcast_temperature_matches_fp64(backend, budget, kind):
    """``[b, 1]`` (one per sequence of ``[b, s]`` labels) and a 0-d tensor."""
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], kind, gen)
    out = _run(case, temperature, **_kwargs(backend, budget))
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], case["e"])
    _compare(out, ref, torch.float32, tag=f"[T per {kind}]")


@pytest.mark.parametrize("backend,budget", BACKENDS[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_constant_tensor_is_the_float_bit_for_bit(backend, budget, dtype):
    gen = generator(next_seed())
    case = make_case("3d", dtype, VOCAB, HIDDEN, TOKENS, gen)
    by_float = _run(case, 0.7, **_kwargs(backend, budget))
    by_tensor = _run(case, torch.full(case["labels"].shape, 0.7), **_kwargs(backend, budget))
    for name, value in by_float.items():
        assert torch.equal(value, by_tensor[name]), f"{name} differs between temperature=0.7 and a tensor of 0.7"


def test_temperature_gets_no_gradient():
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], "token", gen).requires_grad_(True)
    out = _run(case, temperature, backend="torch")
    assert temperature.grad is None
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], case["e"])
    _compare(out, ref, torch.float32)


def test_flat_labels_take_n_elements_or_broadcast():
    """verl's entry: any shape of N elements in the labels' memory order, or broadcastable."""
    gen = generator(next_seed())
    case = make_case("packed", torch.float32, VOCAB, HIDDEN, TOKENS, gen)  # hidden [t, 1, h], labels [1, t]
    hidden, weight, labels = case["hidden"], case["weight"], case["labels"]
    temperature = _temperature(labels, "token", gen)
    expected, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature)
    for t in (temperature, temperature.reshape(-1), temperature.reshape(TOKENS, 1)):
        got, ent = linear_cross_entropy(hidden, weight, labels, t, backend="torch")
        assert torch.equal(got, expected.reshape(-1)) and ent.shape == (TOKENS,)
    got, ent = linear_cross_entropy(hidden, weight, labels, torch.tensor(0.7), backend="torch", return_entropy=False)
    assert ent is None and torch.equal(got, linear_cross_entropy(hidden, weight, labels, 0.7, backend="torch")[0])


def test_options_object_and_keywords():
    """``options=HeadOptions(...)`` is used as given; a keyword replaces its field for the call."""
    gen = generator(next_seed())
    case = make_case("2d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    args = (case["hidden"], case["weight"], case["labels"])
    options = HeadOptions(backend="torch", return_entropy=False)
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(*args, temperature=0.9, options=options)
    assert entropy is None
    log_prob2, entropy2 = mcore_ppo.fused_log_probs_and_entropy(
        *args, temperature=0.9, options=options, return_entropy=True
    )
    assert entropy2 is not None and torch.equal(log_prob, log_prob2)
    with pytest.raises(TypeError, match="options must be a HeadOptions"):
        mcore_ppo.fused_log_probs_and_entropy(*args, options={"backend": "torch"})


@LIGER
def test_liger_refuses_16bit_tensor():
    gen = generator(next_seed())
    case = make_case("2d", torch.bfloat16, VOCAB, HIDDEN, TOKENS, gen)
    with pytest.raises(ValueError, match="temperature"):
        mcore_ppo.liger_log_probs_and_entropy(
            case["hidden"], case["weight"], case["labels"], temperature=torch.ones(TOKENS)
        )


# --- bad temperature tensors -------------------------------------------------------------------------


@pytest.fixture
def small():
    gen = generator(next_seed())
    return make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)  # labels [3, 4]


def _call(case, temperature):
    return mcore_ppo.fused_log_probs_and_entropy(
        case["hidden"], case["weight"], case["labels"], temperature=temperature, backend="torch"
    )


@pytest.mark.parametrize("shape", [(4, 3), (3, 5), (2, 1), (3, 4, 1), (12,)])
def test_shape_not_broadcastable(small, shape):
    with pytest.raises(ValueError, match=r"temperature must be shaped like labels \(3, 4\)"):
        _call(small, torch.ones(shape))


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, 5e-5, math.nan, math.inf, -math.inf])
def test_bad_values(small, value):
    temperature = torch.ones(3, 4)
    temperature[1, 2] = value
    with pytest.raises(ValueError, match=r"temperature values must be finite and >= 0.0001"):
        _call(small, temperature)


def test_min_temperature_itself_is_accepted(small):
    _call(small, torch.full((3, 1), validation.MIN_TEMPERATURE, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_bad_dtype(small, dtype):
    with pytest.raises(TypeError, match=r"temperature must be a floating-point tensor"):
        _call(small, torch.ones(3, 4).to(dtype))


def test_wrong_device(small):
    with pytest.raises(ValueError, match=r"temperature must be on the labels' device"):
        _call(small, torch.ones(3, 4, device="meta"))


def test_not_a_tensor_or_float(small):
    with pytest.raises(TypeError, match=r"temperature must be a number \(int or float\) or a floating-point"):
        _call(small, [1.0, 2.0])


@pytest.mark.parametrize("backend,budget", BACKENDS[:3])
def test_unchecked_bad_values_poison_their_tokens(small, backend, budget):
    """validate=False: no value read back (no host sync on CUDA), NaN outputs for the bad tokens."""
    temperature = 0.5 + torch.rand(3, 4, generator=generator(next_seed()))
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[0, 1], bad[2, 3] = True, True
    poisoned = temperature.clone()
    poisoned[0, 1], poisoned[2, 3] = 0.0, math.nan
    log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
        small["hidden"], small["weight"], small["labels"], temperature=poisoned, validate=False,
        **_kwargs(backend, budget),
    )  # fmt: skip
    assert torch.isnan(log_prob[bad]).all() and torch.isnan(entropy[bad]).all()
    ref = reference(small["hidden"], small["weight"], small["labels"], temperature.masked_fill(bad, 1.0))
    assert_close(log_prob[~bad], ref["log_prob"][~bad], name="log_prob", dtype=torch.float32, rtol=OUT_RTOL)
    assert_close(entropy[~bad], ref["entropy"][~bad], name="entropy", dtype=torch.float32, rtol=OUT_RTOL)


# --- entropy off --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,budget", BACKENDS)
@pytest.mark.parametrize("layout", ["2d", "3d"])
@pytest.mark.parametrize("per_token", [False, True], ids=["T-float", "T-tensor"])
def test_entropy_off(backend, budget, layout, per_token):
    gen = generator(next_seed())
    case = make_case(layout, torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], "token", gen) if per_token else 0.8
    off = _run(case, temperature, return_entropy=False, **_kwargs(backend, budget))
    assert off["entropy"] is None
    on = _run(case, temperature, use_entropy=False, **_kwargs(backend, budget))
    for name in ("log_prob", "d_hidden", "d_weight"):
        assert torch.equal(off[name], on[name]), f"{name}: entropy off differs from entropy on (unused)"
    ref = reference(case["hidden"], case["weight"], case["labels"], temperature, case["g"], None)
    _compare(off, ref, torch.float32, with_entropy=False, tag="[entropy off]")


def test_entropy_off_under_no_grad_and_return_entropy_type():
    gen = generator(next_seed())
    case = make_case("2d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    with torch.no_grad():
        log_prob, entropy = mcore_ppo.fused_log_probs_and_entropy(
            case["hidden"], case["weight"], case["labels"], return_entropy=False
        )
    assert entropy is None and log_prob.shape == case["labels"].shape
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        HeadOptions(return_entropy=1)
    assert HeadOptions().return_entropy is True


# --- context parallelism: the temperature is split like the tokens --------------------------------------


def test_split_temperature_for_cp_follows_the_labels():
    labels = torch.arange(2 * 16).view(2, 16)
    per_token = torch.rand(2, 16) + 0.5
    for rank in range(2):
        got = split_temperature_for_cp(per_token, 2, rank, seq_dim=1)
        assert torch.equal(got, split_for_cp(per_token, 2, rank, seq_dim=1))
        # The pairing survives: the temperature of label j is still the one of its token.
        index = split_for_cp(labels, 2, rank, seq_dim=1)
        assert torch.equal(got, per_token.view(-1)[index.view(-1)].view(2, 8))
    per_sequence = torch.rand(2, 1) + 0.5
    assert split_temperature_for_cp(per_sequence, 2, 1, seq_dim=1) is per_sequence
    packed = torch.rand(1, 24) + 0.5
    cu = [0, 8, 24]
    ours = split_temperature_for_cp(packed, 2, 1, seq_dim=1, cu_seqlens=cu)
    assert torch.equal(ours, split_for_cp(packed, 2, 1, seq_dim=1, cu_seqlens=cu))
    with pytest.raises(ValueError, match="cp_rank"):
        split_temperature_for_cp(torch.tensor(1.0), 2, 2, seq_dim=1)


# --- the head module ------------------------------------------------------------------------------------


def test_head_module_tensor_temperature_and_return_entropy():
    """``VocabParallelFusedPPOHead(return_entropy=False)``, a per-call temperature tensor, and the
    per-call ``return_entropy`` override (one rank, no parallel_state)."""
    pytest.importorskip("megatron.core")
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    head = mcore_ppo.VocabParallelFusedPPOHead(
        HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, backend="torch", return_entropy=False
    )
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _temperature(case["labels"], "sequence", gen)
    hidden = case["hidden"].detach().requires_grad_(True)
    log_prob, entropy = head(hidden, case["labels"], temperature=temperature)
    assert entropy is None
    (log_prob * case["g"]).sum().backward()
    weight = head.weight.detach()
    ref = reference(case["hidden"], weight, case["labels"], temperature, case["g"], None)
    out = {"log_prob": log_prob, "d_hidden": hidden.grad, "d_weight": head.weight.grad}
    _compare(out, ref, torch.float32, with_entropy=False, tag="[head module]")
    log_prob2, entropy2 = head(case["hidden"], case["labels"], temperature=temperature, return_entropy=True)
    assert torch.equal(log_prob2, log_prob.detach())
    assert_close(entropy2, ref["entropy"], name="entropy[head module]", dtype=torch.float32, rtol=OUT_RTOL)


def test_gpt_log_probs_tensor_temperature_and_entropy_off(megatron_tp1):
    """``gpt_log_probs_and_entropy`` passes a temperature tensor and ``return_entropy`` to the head:
    a ``[b, 1]`` tensor gives, row by row, what each row's float gives, bit for bit; entropy off
    gives ``(log_probs, None)`` with the same log-probs."""
    from mcore_ppo_testing.gpt_reference import synthetic_batch
    from mcore_ppo_testing.layer_specs import local_gpt_spec

    # Megatron builds on the GPU where there is one (the CPU shims stand aside there).
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build_gpt_model(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        max_sequence_length=16,
        params_dtype=torch.float64,
        seed=2024,
        transformer_layer_spec=local_gpt_spec(),
        device=device,
    )
    mcore_ppo.install_fused_head(model, temperature=0.7, backend="torch")
    batch = synthetic_batch("padded", vocab_size=64, seq_length=16, generator=generator(next_seed()), device=device)
    rows = batch.labels.shape[0]
    temperature = torch.linspace(0.5, 1.5, rows, dtype=torch.float64, device=device).view(rows, 1)
    with torch.no_grad():
        lp, ent = mcore_ppo.gpt_log_probs_and_entropy(
            model, labels=batch.labels, temperature=temperature, **batch.model_inputs()
        )
        for r in range(rows):
            lp_r, ent_r = mcore_ppo.gpt_log_probs_and_entropy(
                model, labels=batch.labels, temperature=float(temperature[r]), **batch.model_inputs()
            )
            # Bit for bit on the CPU; CUDA's fp64 GEMMs may round a row differently per call.
            exact = {"rtol": 0, "atol": 0} if device.type == "cpu" else {"rtol": 1e-12, "atol": 1e-12}
            torch.testing.assert_close(lp[r], lp_r[r], **exact)
            torch.testing.assert_close(ent[r], ent_r[r], **exact)
        lp_off, ent_off = mcore_ppo.gpt_log_probs_and_entropy(
            model, labels=batch.labels, temperature=temperature, return_entropy=False, **batch.model_inputs()
        )
    assert ent_off is None
    torch.testing.assert_close(lp_off, lp, **exact)


# --- Σπ² (return_sum_pi_squared) ------------------------------------------------------------------------


def _triton(**config):
    from mcore_ppo.backends import TritonBackend, TritonConfig

    return TritonBackend(TritonConfig(**config))


def _triton_splits():
    """One vocab tile per program: V = 37 in two splits, merged per token (the squared factor)."""
    from mcore_ppo.backends.triton_config import INTERPRETER_FORWARD

    return _triton(forward_config=replace(INTERPRETER_FORWARD, tiles_per_split=1))


SP_BACKENDS = [
    pytest.param(lambda: "torch", id="torch"),
    # Several vocab and token chunks with ragged tails: the merge inside a rank rescales q too.
    pytest.param(lambda: TorchBackend(TorchConfig(token_chunk=5, vocab_chunk=8)), id="torch-chunked"),
    pytest.param(lambda: _triton(buffer_budget_bytes=0), id="triton-recompute", marks=TRITON_ON_CPU),
    pytest.param(lambda: _triton(buffer_budget_bytes=1 << 30), id="triton-buffer", marks=TRITON_ON_CPU),
    pytest.param(lambda: _triton(fused_forward=False), id="triton-generic-forward", marks=TRITON_ON_CPU),
    pytest.param(_triton_splits, id="triton-splits", marks=TRITON_ON_CPU),
]


def _sp_temperature(labels: torch.Tensor, kind: str, gen: torch.Generator) -> float | torch.Tensor:
    if kind == "float":
        return 0.7
    return 0.3 + 2.2 * torch.rand(labels.shape, generator=gen)


def _with_and_without_sp(case, temperature, backend, *, return_entropy=True, **kwargs):
    """The call with Σπ² and without, each forward + backward of ``Σ g·log_prob (+ Σ e·H)``."""
    results = []
    for with_sp in (False, True):
        hidden = case["hidden"].detach().requires_grad_(True)
        weight = case["weight"].detach().requires_grad_(True)
        out = mcore_ppo.fused_log_probs_and_entropy(
            hidden, weight, case["labels"], temperature=temperature, backend=backend,
            return_entropy=return_entropy, return_sum_pi_squared=with_sp, **kwargs,
        )  # fmt: skip
        assert len(out) == (3 if with_sp else 2)
        loss = (out[0] * case["g"]).sum()
        if out[1] is not None:
            loss = loss + (out[1] * case["e"]).sum()
        loss.backward()
        results.append((out, hidden.grad, weight.grad))
    return results


@pytest.mark.parametrize("make_backend", SP_BACKENDS)
@pytest.mark.parametrize("layout", ["2d", "3d", "packed"])
def test_sum_pi_squared_matches_fp64_and_changes_nothing_else(make_backend, layout):
    """Entropy on with per-token temperatures, entropy off with a float: Σπ² against fp64, and
    every other output and both gradients bit for bit those of the call without it."""
    backend = make_backend()
    gen = generator(next_seed())
    for dtype, kind, return_entropy in ((torch.float32, "token", True), (torch.float32, "float", False)):
        case = make_case(layout, dtype, VOCAB, HIDDEN, TOKENS, gen)
        temperature = _sp_temperature(case["labels"], kind, gen)
        (plain, dh0, dw0), (with_sp, dh1, dw1) = _with_and_without_sp(
            case, temperature, backend, return_entropy=return_entropy
        )
        sp = with_sp[2]
        assert sp.dtype == torch.float32 and sp.shape == case["labels"].shape and not sp.requires_grad
        ref = sum_pi_squared_reference(case["hidden"], case["weight"], case["labels"], temperature)
        assert_close(sp, ref, name=f"sum_pi_squared[{kind}]", dtype=dtype, rtol=OUT_RTOL)
        ignored = case["labels"] == -100
        assert ignored.any() and torch.all(sp[ignored] == 0)
        assert torch.all(sp[~ignored] >= 1.0 / VOCAB) and torch.all(sp[~ignored] <= 1.0)
        assert torch.equal(plain[0], with_sp[0])
        assert (with_sp[1] is None) == (not return_entropy)
        if return_entropy:
            assert torch.equal(plain[1], with_sp[1])
        assert torch.equal(dh0, dh1) and torch.equal(dw0, dw1)


@pytest.mark.parametrize("make_backend", SP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
def test_sum_pi_squared_dtypes(make_backend, dtype):
    """16-bit inputs against the fp64 reference of the same values; fp64 inputs to fp64 rounding."""
    gen = generator(next_seed())
    case = make_case("3d", dtype, VOCAB, HIDDEN, TOKENS, gen)
    temperature = _sp_temperature(case["labels"], "token", gen)
    out = mcore_ppo.fused_log_probs_and_entropy(
        case["hidden"], case["weight"], case["labels"], temperature=temperature, backend=make_backend(),
        return_sum_pi_squared=True,
    )  # fmt: skip
    ref = sum_pi_squared_reference(case["hidden"], case["weight"], case["labels"], temperature)
    rtol = 1e-12 if dtype == torch.float64 else OUT_RTOL
    assert_close(out[2], ref, name=f"sum_pi_squared[{dtype}]", dtype=dtype, rtol=rtol)


@pytest.mark.parametrize("make_backend", SP_BACKENDS)
def test_sum_pi_squared_k_ids_and_edges(make_backend):
    """``[..., k]`` labels: Σπ² per token, equal to the one-label call's (k = 1 and k = 3);
    every token ignored: zeros, no NaN; uniform logits: exactly ``1/V``; one dominant logit: 1."""
    backend = make_backend()
    gen = generator(next_seed())
    case = make_case("3d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    hidden, weight, labels = case["hidden"], case["weight"], case["labels"]
    one = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend=backend, return_sum_pi_squared=True)
    ids = torch.randint(0, VOCAB, (*labels.shape, 3), generator=gen)
    ids[..., 0] = labels
    ids[labels == -100] = -100
    for k in (1, 3):
        log_q, _, sp = mcore_ppo.fused_log_probs_at(
            hidden, weight, ids[..., :k], backend=backend, return_sum_pi_squared=True
        )
        assert log_q.shape == ids[..., :k].shape and sp.shape == labels.shape
        assert_close(sp, one[2], name=f"sum_pi_squared[k={k}]", dtype=torch.float32, rtol=OUT_RTOL)
        ref = sum_pi_squared_reference(hidden, weight, ids[..., :k], 1.0)
        assert_close(sp, ref, name=f"sum_pi_squared[k={k}] vs fp64", dtype=torch.float32, rtol=OUT_RTOL)
    all_ignored = torch.full_like(labels, -100)
    out = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, all_ignored, backend=backend, return_sum_pi_squared=True
    )
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    flat = torch.zeros(5, HIDDEN)
    uniform = mcore_ppo.fused_log_probs_and_entropy(
        flat, weight, torch.arange(5), backend=backend, return_sum_pi_squared=True
    )[2]
    assert torch.all((uniform - 1.0 / VOCAB).abs() <= 1e-7 / VOCAB) and torch.all(uniform >= 1.0 / VOCAB)
    peaked = torch.zeros(2, HIDDEN)
    peaked[:, 0] = 1e4
    w = torch.zeros(VOCAB, HIDDEN)
    w[3, 0] = 1.0
    assert torch.equal(
        mcore_ppo.fused_log_probs_and_entropy(peaked, w, torch.tensor([3, 5]), backend=backend,
                                              return_sum_pi_squared=True)[2],
        torch.ones(2),
    )  # fmt: skip


@pytest.mark.parametrize("make_backend", SP_BACKENDS)
def test_sum_pi_squared_unchecked_bad_temperature_is_nan(make_backend):
    gen = generator(next_seed())
    case = make_case("2d", torch.float32, VOCAB, HIDDEN, TOKENS, gen)
    labels = case["labels"].clone()
    labels[3] = 5
    temperature = torch.full(labels.shape, 0.7)
    temperature[3] = 0.0
    out = mcore_ppo.fused_log_probs_and_entropy(
        case["hidden"], case["weight"], labels, temperature=temperature, backend=make_backend(),
        return_sum_pi_squared=True, validate=False,
    )  # fmt: skip
    assert math.isnan(out[2][3]) and math.isnan(out[1][3])
    others = torch.arange(labels.numel()) != 3
    ref = sum_pi_squared_reference(case["hidden"], case["weight"], labels, temperature.clamp(min=0.7))
    assert_close(out[2][others], ref[others], name="sum_pi_squared", dtype=torch.float32, rtol=OUT_RTOL)


def test_sum_pi_squared_returns_and_options_object():
    """Default: two outputs. ``HeadOptions(return_sum_pi_squared=True)`` as ``options`` (and
    ``run_head`` with it): three; a keyword False overrides it back to two."""
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    labels = torch.tensor([1, 2, -100, 4, 10, 0])
    assert len(mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend="torch")) == 2
    options = HeadOptions(backend="torch", return_sum_pi_squared=True)
    out = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, options=options)
    assert len(out) == 3
    assert len(mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, options=options,
                                                     return_sum_pi_squared=False)) == 2  # fmt: skip
    direct = run_head(hidden, weight, labels, 1.0, options, tp_group=None, layout=DEFAULT_LAYOUT)
    assert len(direct) == 3 and torch.equal(direct[2], out[2])
    two = run_head(hidden, weight, labels, 1.0, HeadOptions(backend="torch"), tp_group=None, layout=DEFAULT_LAYOUT)
    assert len(two) == 2
    _, entropy, sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, backend="torch", return_entropy=False, return_sum_pi_squared=True
    )
    assert entropy is None and torch.equal(sp, out[2])


def test_sum_pi_squared_flat_token_order():
    """The layout verl's route runs (``TokenOrder.FLAT``, ``HiddenGrad.PARTIAL``): ``run_head``
    with ``HeadOptions(return_sum_pi_squared=True)`` gives ``[N]`` Σπ² in memory order."""
    gen = generator(next_seed())
    hidden = torch.randn(5, 2, 8, generator=gen)
    weight = torch.randn(13, 8, generator=gen)
    labels = torch.randint(0, 13, (5, 2), generator=gen)
    labels[0, 1] = -100
    temperature = 0.3 + torch.rand(5, 2, generator=gen)
    layout = Layout(TokenOrder.FLAT, HiddenGrad.PARTIAL)
    options = HeadOptions(backend="torch", return_sum_pi_squared=True, return_entropy=False)
    x = hidden.clone().requires_grad_(True)
    log_probs, entropy, sp = run_head(x, weight, labels, temperature, options, tp_group=None, layout=layout)
    assert entropy is None and log_probs.shape == sp.shape == (10,)
    ref = sum_pi_squared_reference(hidden.reshape(10, 8), weight, labels.reshape(10), temperature.reshape(10))
    assert_close(sp, ref, name="sum_pi_squared[flat]", dtype=torch.float32, rtol=OUT_RTOL)
    log_probs.sum().backward()
    assert x.grad is not None


def test_sum_pi_squared_gets_no_gradient():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 10, 0])
    log_prob, entropy, sp = mcore_ppo.fused_log_probs_and_entropy(
        hidden, weight, labels, backend="torch", return_sum_pi_squared=True
    )
    assert log_prob.requires_grad and entropy.requires_grad
    assert not sp.requires_grad and sp.grad_fn is None
    with pytest.raises(RuntimeError):
        sp.sum().backward()
    (log_prob.sum() + (entropy * sp).sum()).backward()  # Σπ² as a weight: a constant
    expected_h, expected_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, backend="torch")
    (lp2.sum() + (ent2 * sp).sum()).backward()
    assert torch.equal(hidden.grad, expected_h) and torch.equal(weight.grad, expected_w)


@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0])
def test_sum_pi_squared_wrong_type_is_a_type_error(bad):
    hidden, weight, labels = torch.randn(4, 8), torch.randn(11, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        HeadOptions(return_sum_pi_squared=bad)
    for entry in (mcore_ppo.fused_log_probs_and_entropy, mcore_ppo.fused_log_probs_at):
        call_labels = labels if entry is mcore_ppo.fused_log_probs_and_entropy else labels[:, None]
        with pytest.raises(TypeError, match="return_sum_pi_squared"):
            entry(hidden, weight, call_labels, backend="torch", return_sum_pi_squared=bad)


def test_liger_refuses_sum_pi_squared():
    hidden, weight, labels = torch.randn(4, 8), torch.randn(11, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="return_sum_pi_squared"):
        mcore_ppo.liger_log_probs_and_entropy(hidden, weight, labels, return_sum_pi_squared=True)
    with pytest.raises(TypeError, match="return_sum_pi_squared"):
        mcore_ppo.liger_log_probs_and_entropy(hidden, weight, labels, return_sum_pi_squared="yes")
