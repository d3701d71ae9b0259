"""Finite extremes, CP metadata and the environment: a clear ValueError/TypeError naming
the argument (or the environment variable), or the fp64-correct result.

Complements ``test_validation.py`` (the documented bad inputs). Each case here was a silent wrong
answer or an error that did not say what was wrong: a temperature of 1e-38 (NaN), a huge Python
int temperature or ``ignore_index = 2**70`` (a bare OverflowError), hidden size 0 (a reshape
error), a ``tp_group`` of the wrong type (AttributeError), ``MCORE_PPO_BUFFER_BUDGET_BYTES=1GiB``
(a bare ``int()`` error), float ``cu_seqlens`` (silently truncated), garbage ``cu_seqlens`` at
``cp_size = 1`` (not checked), ``seq_dim`` / ``cu_seqlens`` / ``input_ids`` of a wrong type and a
float ``ignore_index`` in the CP helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from head_checks import TRITON_ON_CPU, plain_case

import mcore_ppo
from mcore_ppo.backends import resolve_backend
from mcore_ppo.parallel import roll_and_split_labels, roll_labels, sequence_bounds, split_for_cp
from mcore_ppo.validation import MIN_TEMPERATURE
from mcore_ppo_testing.reference import assert_close, reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

BACKENDS = [
    "torch",
    pytest.param("triton", marks=TRITON_ON_CPU),
]
ENV = "MCORE_PPO_BUFFER_BUDGET_BYTES"


def head(hidden, weight, labels, **kwargs):
    return mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, **kwargs)


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e-38, 5e-324, MIN_TEMPERATURE / 2, 10**400, -(10**400)])
def test_temperature_out_of_range(value):
    hidden, weight, labels, _, _ = plain_case()
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0, in \[0.0001, inf\)"):
        head(hidden, weight, labels, temperature=value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "temperature", [MIN_TEMPERATURE, 1e-2, 1e30, 10**300, 1e308], ids=["min", "0.01", "1e30", "int-10**300", "1e308"]
)
def test_extreme_temperatures_in_range_are_correct(backend, temperature):
    """The floor and the far end (1/T underflows: the uniform distribution) against fp64.

    Tolerances relative to the tempered logit scale max|x·w|/T (see head_checks: an fp32 logit
    carries an absolute error of ~1e-7 of it); gradients relative to their largest term, with the
    triton backward's recompute error of ~3e-8·max|z| (validation.MIN_TEMPERATURE) on top.
    """
    hidden, weight, labels, g, e = plain_case()
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_prob, entropy = head(x, w, labels, temperature=temperature, backend=backend)
    ((log_prob * g).sum() + (entropy * e).sum()).backward()
    ref = reference(hidden, weight, labels, float(temperature), g, e)
    scale = max((hidden @ weight.t()).abs().max().item() / float(temperature), 1.0)
    for name, value in (("log_prob", log_prob), ("entropy", entropy)):
        assert_close(value, ref[name], name=name, dtype=torch.float32, rtol=0.0, atol=1e-6 * scale, track=False)
    # A logit error δz ≈ 2^-23·scale moves p by ≲ 2·δz·p (head_checks); the triton backward's
    # recompute adds its own (validation.MIN_TEMPERATURE).
    grad_rtol = 1e-5 + (6e-7 if backend == "triton" else 2.5e-7) * scale
    for name, value in (("d_hidden", x.grad), ("d_weight", w.grad)):
        assert_close(
            value, ref[name], name=name, dtype=torch.float32, rtol=grad_rtol, atol=1e-30, terms=ref[name + "_terms"]
        )


# --- ignore_index, hidden size, tp_group ---------------------------------------------------------


@pytest.mark.parametrize("value", [2**70, 2**63, -(2**63) - 1])
def test_ignore_index_beyond_int64(value):
    hidden, weight, labels, _, _ = plain_case()
    with pytest.raises(ValueError, match=rf"ignore_index must fit in int64 .*got {value}"):
        head(hidden, weight, labels, ignore_index=value)


def test_ignore_index_at_the_int64_ends_is_fine():
    hidden, weight, labels, _, _ = plain_case()
    for value in (2**63 - 1, -(2**63)):
        log_prob, _ = head(hidden, weight, torch.where(labels < 0, value, labels), ignore_index=value)
        assert (log_prob[::4] == 0).all() and (log_prob[1::4] < 0).all()


@pytest.mark.parametrize("shapes", [((4, 0), (7, 0)), ((2, 2, 0), (7, 0)), ((4, 0), (7, 3))], ids=str)
def test_hidden_size_zero(shapes):
    hidden, weight = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    labels = torch.zeros(hidden.shape[:-1][::-1], dtype=torch.long)
    match = r"hidden size .*must be >= 1" if shapes[1][1] == 0 else r"hidden size 0 .*weight's second dim 3"
    with pytest.raises(ValueError, match=match):
        head(hidden, weight, labels)
    with pytest.raises(ValueError, match=match):
        mcore_ppo.linear_cross_entropy(hidden, weight, labels.t())


@pytest.mark.parametrize("group", ["tp", 2, object()], ids=["str", "int", "object"])
def test_process_group_type(group):
    hidden, weight, labels, _, _ = plain_case()
    with pytest.raises(TypeError, match=r"^tp_group must be a torch.distributed.ProcessGroup or None"):
        head(hidden, weight, labels, tp_group=group)
    with pytest.raises(TypeError, match=r"^dist_process_group must be a torch.distributed.ProcessGroup or None"):
        mcore_ppo.linear_cross_entropy(hidden, weight, labels, dist_process_group=group)


# --- the triton backend's device and the environment ---------------------------------------------


@pytest.fixture
def triton_backend():
    return pytest.importorskip("mcore_ppo.backends.triton_backend")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1GiB", 2**30), ("512 MiB", 512 * 2**20), ("64kib", 2**16), ("1.5GB", 1_500_000_000), (" 4096 ", 4096), ("0", 0)],
)
def test_budget_environment_variable_with_units(triton_backend, monkeypatch, text, expected):
    monkeypatch.setenv(ENV, text)
    assert resolve_backend("triton", torch.device("cpu")).config.buffer_budget_bytes == expected


@pytest.mark.parametrize("text", ["lots", "-1", "1e9", "1TiB", "GiB", "1 2"])
def test_budget_environment_variable_errors_name_it(triton_backend, monkeypatch, text):
    monkeypatch.setenv(ENV, text)
    hidden, weight, labels, _, _ = plain_case()
    with pytest.raises(ValueError, match=rf"^{ENV} must be a number of bytes >= 0, optionally with a unit"):
        head(hidden, weight, labels, backend="triton")


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_budget_of_a_backend_object(triton_backend, value, error):
    with pytest.raises(error, match=r"^buffer_budget_bytes must be"):
        triton_backend.TritonBackend(triton_backend.TritonConfig(buffer_budget_bytes=value))


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(triton_backend, monkeypatch):
    """On a CUDA machine, CPU tensors with backend='triton' reached a kernel launch error."""
    backend = triton_backend.TritonBackend()
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    hidden, weight, labels, _, _ = plain_case()
    refusal = r"backend='triton' cannot run these inputs: the triton kernels need CUDA tensors"
    with pytest.raises(ValueError, match=refusal + r" \(or TRITON_INTERPRET=1\), got cpu"):
        head(hidden, weight, labels, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors_infer_shapes(backend):
    """Meta tensors (shape inference) run through the reference path on either backend."""
    hidden, weight = torch.empty(5, 3, 8, device="meta"), torch.empty(11, 8, device="meta")
    labels = torch.empty(3, 5, dtype=torch.long, device="meta")
    hidden.requires_grad_(True)
    log_prob, entropy = head(hidden, weight, labels, backend=backend)
    assert log_prob.shape == entropy.shape == (3, 5) and log_prob.is_meta and log_prob.dtype == torch.float32
    log_prob.sum().backward()
    assert hidden.grad.shape == hidden.shape and hidden.grad.is_meta


# --- CP metadata ---------------------------------------------------------------------------------

IDS = torch.arange(8)[None]


@pytest.mark.parametrize(
    "cu_seqlens",
    [[0, 4.0, 8], [0, 4.5, 8], (0.0, 8.0), np.array([0.0, 4.0, 8.0]), [0, True, 8], [0, "4", 8]],
    ids=["float", "fraction", "tuple-of-floats", "numpy-floats", "bool", "str-item"],
)
@pytest.mark.parametrize("fn", [split_for_cp, roll_and_split_labels], ids=["split", "roll_and_split"])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_cu_seqlens_items_must_be_ints(fn, cp_size, cu_seqlens):
    with pytest.raises(TypeError, match=r"^cu_seqlens must hold ints, got"):
        fn(IDS, cp_size, 0, seq_dim=1, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize(
    "cu_seqlens",
    [torch.tensor([0.0, 4.0, 8.0]), torch.tensor([0, 1], dtype=torch.bool), "0,4,8", 8, 8.0],
    ids=["float-tensor", "bool-tensor", "str", "int", "float"],
)
def test_cu_seqlens_of_a_wrong_type(cu_seqlens):
    for cp_size in (1, 2):
        with pytest.raises(TypeError, match=r"^cu_seqlens must be a 1-D integer tensor"):
            split_for_cp(IDS, cp_size, 0, seq_dim=1, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize(
    "cu_seqlens",
    [[3, 1], [0, 4], [0, 9], [0, 6, 2, 8], [], [8]],
    ids=["garbage", "short", "long", "down", "empty", "one"],
)
def test_cu_seqlens_checked_at_cp_size_1(cu_seqlens):
    with pytest.raises(ValueError, match=r"^cu_seqlens must"):
        split_for_cp(IDS, 1, 0, seq_dim=1, cu_seqlens=cu_seqlens)


def test_integer_cu_seqlens_of_any_kind_are_fine():
    expected = split_for_cp(IDS, 2, 1, seq_dim=1, cu_seqlens=[0, 4, 8])
    for cu in (np.array([0, 4, 8]), torch.tensor([0, 4, 8], dtype=torch.int32), [0, np.int64(4), torch.tensor(8)]):
        assert torch.equal(split_for_cp(IDS, 2, 1, seq_dim=1, cu_seqlens=cu), expected)
    assert sequence_bounds((0, 0, 8), 8) == [0, 0, 8]  # an empty sequence is allowed


@pytest.mark.parametrize("seq_dim", ["1", 1.0, None, True], ids=["str", "float", "None", "bool"])
def test_seq_dim_type(seq_dim):
    for call in (
        lambda: split_for_cp(IDS, 2, 0, seq_dim=seq_dim),
        lambda: split_for_cp(IDS, 1, 0, seq_dim=seq_dim),
        lambda: roll_and_split_labels(IDS, 2, 0, seq_dim=seq_dim),
    ):
        with pytest.raises(TypeError, match=r"^seq_dim must be an int"):
            call()


@pytest.mark.parametrize("input_ids", [[0, 1, 2, 3], np.arange(4), None], ids=["list", "numpy", "None"])
def test_input_ids_type(input_ids):
    for call in (
        lambda: roll_labels(input_ids, seq_dim=0),
        lambda: roll_and_split_labels(input_ids, 2, 0, seq_dim=0),
    ):
        with pytest.raises(TypeError, match=r"^input_ids must be a torch.Tensor"):
            call()


@pytest.mark.parametrize("value", [-100.0, -100.5, True, "x", None], ids=["float", "fraction", "bool", "str", "None"])
def test_roll_ignore_index_type(value):
    with pytest.raises(TypeError, match=r"^ignore_index must be an int"):
        roll_and_split_labels(IDS, 2, 0, seq_dim=1, ignore_index=value)


def test_type_errors_qualify_non_builtin_types():
    """A numpy bool is not a bool here; the message says which "bool" it got."""
    hidden, weight, labels, _, _ = plain_case()
    with pytest.raises(TypeError, match=r"^sequence_parallel must be a bool, got numpy.bool"):
        head(hidden, weight, labels, sequence_parallel=np.bool_(False))
    with pytest.raises(
        TypeError,
        match=r"^temperature must be a number \(int or float\) or a floating-point torch.Tensor, got numpy.float32",
    ):
        head(hidden, weight, labels, temperature=np.float32(0.7))


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (
            {"gather_rows": [16, 256, 4]},
            TypeError,
            r"^gather_rows must be a tuple \(BLOCK_J, BLOCK_H, num_warps\), got list",
        ),
        (
            {"gather_rows": (16, 256)},
            ValueError,
            r"^gather_rows must be \(BLOCK_J, BLOCK_H, num_warps\), got \(16, 256\)",
        ),
        ({"gather_rows": (16, 255, 4)}, ValueError, r"^gather_rows\[1\] \(BLOCK_H\) must be a power of two, got 255"),
        ({"gather_rows": (16, 256, 0)}, ValueError, r"^gather_rows\[2\] \(num_warps\) must be >= 1, got 0"),
        ({"gather_rows": (16.0, 256, 4)}, TypeError, r"^gather_rows\[0\] \(BLOCK_J\) must be an int, got float"),
        ({"gather_scan_slots": 48}, ValueError, r"^gather_scan_slots must be a power of two, got 48"),
        ({"plan_cache_size": 0}, ValueError, r"^plan_cache_size must be >= 1, got 0"),
        ({"kept_kernels": 1}, TypeError, r"^kept_kernels must be a bool, got int"),
        ({"ieee_gemms": "blas"}, ValueError, r"^ieee_gemms must be one of"),
    ],
)
def test_triton_config_refuses_its_fields_by_name(fields, error, match):
    """A Triton block size that is not a power of two would fail inside Triton's compiler at the
    first launch; the config refuses it, and every other field of the wrong kind, when built."""
    from mcore_ppo import TritonConfig

    with pytest.raises(error, match=match):
        TritonConfig(**fields)
    TritonConfig(gather_rows=(8, 128, 2), gather_scan_slots=32)  # powers of two pass
