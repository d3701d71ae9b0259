"""Every documented bad input raises the documented exception, naming the argument.

``TypeError`` for wrong Python types and dtypes, ``ValueError`` for wrong values, shapes,
layouts and devices (see :mod:`mcore_ppo.validation`). The checks must run before any compute.
Multi-rank checks (shard sizes across TP, SP divisibility with a real group) live in
``tests/distributed``; here the single-rank part of the SP layout check is called directly.
"""

from __future__ import annotations

import math

import pytest
import torch

import mcore_ppo
from mcore_ppo.backends import torch_backend
from mcore_ppo.parallel import roll_and_split_labels, roll_labels, split_for_cp
from mcore_ppo.validation import check_layout
from mcore_ppo_testing.reference import IGNORE_INDEX, check_invariants
from mcore_ppo_testing.seeds import generator, next_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: see conftest.one_thread

H, V = 8, 13


@pytest.fixture
def data():
    """Valid 2-D and 3-D inputs (s=4, b=3), fresh per test."""
    gen = generator(next_seed())
    return {
        "h2": torch.randn(6, H, generator=gen),
        "l2": torch.randint(0, V, (6,), generator=gen),
        "h3": torch.randn(4, 3, H, generator=gen),
        "l3": torch.randint(0, V, (3, 4), generator=gen),
        "w": torch.randn(V, H, generator=gen),
    }


@pytest.fixture
def no_compute(monkeypatch):
    """Fail loudly if the backend is reached: validation must raise before any compute."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the backend ran before validation rejected the input")

    monkeypatch.setattr(torch_backend.TorchBackend, "shard_statistics", forbidden)
    monkeypatch.setattr(torch_backend.TorchBackend, "shard_gradients", forbidden)


def head(hidden, weight, labels, **kwargs):
    return mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, **kwargs)


def test_valid_inputs_pass(data):
    """The fixtures themselves are valid (so the failures below are about the one bad argument)."""
    for hidden, labels in ((data["h2"], data["l2"]), (data["h3"], data["l3"])):
        lp, ent = head(hidden, data["w"], labels, temperature=2)  # an int temperature is fine
        check_invariants(lp, ent, labels, V)


# --- shapes and layouts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hidden_key", "labels_fn"),
    [
        ("h2", lambda d: d["l2"][:-1]),  # [n-1] for [n, h]
        ("h2", lambda d: d["l2"][None]),  # [1, n] for [n, h]
        ("h3", lambda d: d["l3"].t()),  # [s, b] instead of [b, s]
        ("h3", lambda d: d["l3"].reshape(-1)),  # flat [b·s] for [s, b, h]
        ("h3", lambda d: d["l3"][:, :-1]),  # too short a sequence
    ],
    ids=["2d-short", "2d-extra-dim", "3d-transposed", "3d-flat", "3d-short"],
)
def test_wrong_label_shape(data, hidden_key, labels_fn, no_compute):
    with pytest.raises(ValueError, match=r"labels must have shape"):
        head(data[hidden_key], data["w"], labels_fn(data))


def test_hidden_size_mismatch(data, no_compute):
    with pytest.raises(ValueError, match=r"hidden size 8 .*weight's second dim 7"):
        head(data["h3"], data["w"][:, :7], data["l3"])


@pytest.mark.parametrize("shape", [(H,), (2, 2, 3, H)], ids=["1d", "4d"])
def test_hidden_rank(data, shape, no_compute):
    with pytest.raises(ValueError, match=r"hidden must be \[n, h\] or \[s, b, h\]"):
        head(torch.randn(shape), data["w"], data["l2"])


@pytest.mark.parametrize("shape", [(0, H), (V * H,), (1, V, H)], ids=["empty", "1d", "3d"])
def test_bad_weight_shape(data, shape, no_compute):
    with pytest.raises(ValueError, match=r"weight must be this rank's \[vocab_shard, hidden\] shard"):
        head(data["h2"], torch.randn(shape), data["l2"])


def test_sequence_parallel_layout_single_rank_part(data):
    """check_layout with a fake TP size of 2 under SP: hidden is the sequence shard [s/2, b, h]."""
    hidden, w = data["h3"][:2], data["w"]  # the shard of s=4
    check_layout(hidden, w, data["l3"], tp_size=2, sequence_parallel=True)  # labels cover the whole s
    check_layout(data["h2"][:3], w, data["l2"], tp_size=2, sequence_parallel=True)
    check_layout(data["h3"], w, data["l3"], tp_size=2, sequence_parallel=False)  # no SP: hidden replicated
    labels_odd = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sequence length 5 of labels is not divisible by the tensor-parallel size 2"):
        check_layout(hidden, w, labels_odd, tp_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"labels must have shape .*\(3, 4\).*SP shard"):
        check_layout(hidden, w, torch.zeros(3, 6, dtype=torch.long), tp_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"labels must have shape"):
        check_layout(hidden, w, data["l3"], tp_size=2, sequence_parallel=False)


# --- types and dtypes ----------------------------------------------------------------------------


def test_dtype_mismatch(data, no_compute):
    with pytest.raises(TypeError, match=r"weight dtype torch.bfloat16 must match hidden dtype torch.float32"):
        head(data["h2"], data["w"].bfloat16(), data["l2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_labels_not_integer(data, dtype, no_compute):
    with pytest.raises(TypeError, match=r"labels must be an integer tensor"):
        head(data["h2"], data["w"], data["l2"].to(dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_hidden(data, dtype, no_compute):
    with pytest.raises(TypeError, match=r"hidden must be a floating-point tensor"):
        head(data["h2"].to(dtype), data["w"].to(dtype), data["l2"])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_hidden(data, dtype, no_compute):
    """fp8 operands are refused by name (torch has no promotion of them for its ops)."""
    with pytest.raises(TypeError, match=rf"^hidden must be bfloat16, float16, float32, float64, got dtype {dtype}"):
        head(data["h2"].to(dtype), data["w"].to(dtype), data["l2"])


@pytest.mark.parametrize("name", ["hidden", "weight", "labels"])
def test_not_a_tensor(data, name, no_compute):
    args = {"hidden": data["h2"], "weight": data["w"], "labels": data["l2"]}
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        head(args["hidden"], args["weight"], args["labels"])


@pytest.mark.parametrize("value", [-100.0, True, "x"])
def test_ignore_index_type(data, value, no_compute):
    with pytest.raises(TypeError, match=r"ignore_index must be an int"):
        head(data["h2"], data["w"], data["l2"], ignore_index=value)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_sequence_parallel_type(data, value, no_compute):
    with pytest.raises(TypeError, match=r"sequence_parallel must be a bool"):
        head(data["h2"], data["w"], data["l2"], sequence_parallel=value)


# --- devices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_meta", ["weight", "labels", "hidden"])
def test_second_device(data, on_meta, no_compute):
    """A tensor on another device ('meta' stands in for a second device) is a ValueError, before compute."""
    args = {"hidden": data["h2"], "weight": data["w"], "labels": data["l2"]}
    args[on_meta] = args[on_meta].to("meta")
    with pytest.raises(ValueError, match=rf"must be on one device.*{on_meta} on meta"):
        head(args["hidden"], args["weight"], args["labels"])


# --- label range ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -101, V, V + 7])
@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_label_out_of_range(data, layout, bad, no_compute):
    hidden, labels = (data["h2"], data["l2"].clone()) if layout == "2d" else (data["h3"], data["l3"].clone())
    labels.view(-1)[1] = bad
    labels.view(-1)[0] = IGNORE_INDEX  # the ignore_index itself is fine
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {V}\).*ignore_index=-100; found {bad}"):
        head(hidden, data["w"], labels)


def test_default_ignore_index_is_out_of_range_with_a_custom_one(data, no_compute):
    labels = data["l2"].clone()
    labels[2] = IGNORE_INDEX
    with pytest.raises(ValueError, match=r"ignore_index=-1; found -100"):
        head(data["h2"], data["w"], labels, ignore_index=-1)


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -0.0, -0.7, math.nan, math.inf, -math.inf])
def test_temperature_value(data, value, no_compute):
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0"):
        head(data["h2"], data["w"], data["l2"], temperature=value)


# A tensor is a per-token temperature (tests/core/test_head_options.py checks those).
@pytest.mark.parametrize("value", ["1.0", None, True], ids=["str", "None", "bool"])
def test_temperature_type(data, value, no_compute):
    with pytest.raises(
        TypeError, match=r"temperature must be a number \(int or float\) or a floating-point torch.Tensor"
    ):
        head(data["h2"], data["w"], data["l2"], temperature=value)


# --- backend -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda", "Torch", ""])
def test_backend_name(data, name, no_compute):
    with pytest.raises(ValueError, match=r"backend must be one of"):
        head(data["h2"], data["w"], data["l2"], backend=name)


def test_backend_type(data, no_compute):
    with pytest.raises(TypeError, match=r"backend must be a str"):
        head(data["h2"], data["w"], data["l2"], backend=3)


# --- context parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [split_for_cp, roll_and_split_labels], ids=["split", "roll_and_split"])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_padded_length_not_divisible(fn, cp_size):
    ids = torch.zeros(2, 2 * cp_size + 2, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"length {2 * cp_size + 2}, which is not divisible by 2\*cp_size"):
        fn(ids, cp_size, 0, seq_dim=1)


@pytest.mark.parametrize("fn", [split_for_cp, roll_and_split_labels], ids=["split", "roll_and_split"])
def test_cp_packed_length_not_divisible(fn):
    ids = torch.zeros(1, 14, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sequence 1 has length 6, which is not divisible by 2\*cp_size=4"):
        fn(ids, 2, 1, seq_dim=1, cu_seqlens=[0, 8, 14])


@pytest.mark.parametrize("cp_rank", [2, -1, 1.0, True, None])
def test_bad_cp_rank(cp_rank):
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, cp_size=2\)"):
        split_for_cp(torch.zeros(1, 8), 2, cp_rank, seq_dim=1)


@pytest.mark.parametrize("cp_size", [0, -2, 2.0, True, None])
def test_bad_cp_size(cp_size):
    with pytest.raises(ValueError, match=r"cp_size must be a positive int"):
        roll_and_split_labels(torch.zeros(1, 8, dtype=torch.long), cp_size, 0, seq_dim=1)


@pytest.mark.parametrize(
    "cu_seqlens",
    [
        [4, 8],  # does not start at 0
        [0, 4],  # does not end at the packed length 8
        [0, 8, 12],  # past the end
        [0, 6, 2, 8],  # decreasing
        [8],  # too short
        torch.tensor([[0, 4, 8]]),  # 2-D
    ],
    ids=["start", "end", "past-end", "decreasing", "short", "2d"],
)
@pytest.mark.parametrize("fn", [split_for_cp, roll_and_split_labels], ids=["split", "roll_and_split"])
def test_bad_cu_seqlens(fn, cu_seqlens):
    with pytest.raises(ValueError, match=r"cu_seqlens must"):
        fn(torch.zeros(1, 8, dtype=torch.long), 2, 0, seq_dim=1, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("seq_dim", [2, -3])
def test_bad_seq_dim(seq_dim):
    with pytest.raises(ValueError, match=rf"seq_dim={seq_dim} is out of range for a 2-D tensor"):
        split_for_cp(torch.zeros(2, 8), 2, 0, seq_dim=seq_dim)


def test_roll_labels_needs_integer_ids():
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor"):
        roll_labels(torch.zeros(1, 8), seq_dim=1)


def test_split_needs_a_tensor():
    with pytest.raises(TypeError, match=r"tensor must be a torch.Tensor, got list"):
        split_for_cp([0] * 8, 2, 0, seq_dim=0)
