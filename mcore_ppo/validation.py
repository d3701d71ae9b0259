"""Input checks of the head: clear exceptions naming the argument, never a device assert.

``TypeError`` for wrong Python or tensor types (including dtypes), ``ValueError`` for wrong
values, shapes, devices and layouts.

Checks that read tensor *values* (the label range, a temperature tensor's values) cost a host
synchronisation on CUDA; they run on every device when the head's ``validate`` option is on
(:class:`mcore_ppo.options.HeadOptions`; default :data:`VALIDATE_DEFAULT`), both in one sync,
and not at all when it is off (then a bad label gives a NaN log-prob, a bad temperature NaN
outputs for its token, never a plausible wrong number). What these checks conclude on each
rank is shared over the TP group by :mod:`mcore_ppo.verdict` before the first collective.
"""

from __future__ import annotations

import math

import torch

from mcore_ppo.parallel.ranks import ProcessGroup

#: Default of the head's ``validate`` option: the checks on (they never make the host wait for
#: the device: docs/design.md §5).
VALIDATE_DEFAULT = True


#: Smallest temperature accepted. The tempered logits ``z = x·w / T`` are fp32, so an absolute
#: error of ~1e-7·|z| comes with them; the log-probs are exact to it, but the ``triton``
#: backward, which recomputes ``p = exp(z - lse)``, carries a relative gradient error of about
#: 3e-8·max|z| (3e-3 at |z| = 1e5; docs/design.md §5), and beyond |z| ~ 1e7 its gradients are
#: garbage and then inf/NaN (1e-38 gave NaN outputs on every backend). At T ≥ 1e-4 logits of
#: LLM size (|x·w| ≲ 10) keep |z| ≲ 1e5, gradients at bf16-level accuracy. Sampling itself stops
#: below ~1e-5 (vLLM treats such temperatures as greedy), so nothing a PPO step needs is refused.
#: Large temperatures need no bound: 1/T underflows to 0 and the outputs are those of the uniform
#: distribution, the fp32 rounding of the exact answer.
MIN_TEMPERATURE = 1e-4
TEMPERATURE_TYPES = "a number (int or float) or a floating-point torch.Tensor"
#: Labels are compared with ``ignore_index`` and the vocab range in int64 whatever their dtype
#: (a comparison in a narrow dtype wraps: -100 is 156 in uint8). These convert to int64 exactly;
#: uint64 does not (values from 2**63 on would wrap negative, possibly onto ``ignore_index``).
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32)
# The operands' dtypes the head computes in (fp8 and the other storage formats have no promotion
# to fp32 in torch's ops and no dot of their own in the kernels).
HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def is_int(value: object) -> bool:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: object) -> str:
    """``value``'s type for an error message, qualified when it is not a builtin: a numpy bool
    is ``numpy.bool``, not a bare ``bool`` beside "must be a bool"."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_bool(name: str, value: object) -> bool:
    """``value`` is a bool (a numpy bool or an int is not); returns it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` is an int (bool is not) >= 1; returns it."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def resolve_validate(validate: object) -> bool:
    """An entry point's ``validate``: a bool as given, None the documented default
    (:data:`VALIDATE_DEFAULT`); anything else a TypeError."""
    if validate is None:
        return VALIDATE_DEFAULT
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool or None, got {type_name(validate)}")
    return validate


def check_power_of_two(name: str, value: object) -> int:
    """``value`` is an int >= 1 and a power of two (a Triton block size or warp count); returns it."""
    check_positive_int(name, value)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def check_temperature(temperature: object) -> float:
    """``temperature`` is a Python int or float, finite, in ``[MIN_TEMPERATURE, inf)``; returns it as float."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be {TEMPERATURE_TYPES}, got {type_name(temperature)}")
    allowed = (
        f"finite and > 0, in [{MIN_TEMPERATURE:g}, inf) (below {MIN_TEMPERATURE:g} the fp32 tempered logits "
        "x·w/T grow past the precision the gradients need, and overflow)"
    )
    try:
        value = float(temperature)
    except OverflowError:  # a Python int beyond the float range
        raise ValueError(f"temperature must be {allowed}, got an int too large for a float") from None
    # value - value == 0 is False for inf and NaN (math.isfinite would reject a float that
    # torch.compile traces symbolically, once the temperature has changed between calls).
    if not value - value == 0 or value < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be {allowed}, got {value}")
    return value


def check_temperature_tensor(temperature: object, labels: torch.Tensor, *, flat_labels: bool = False) -> torch.Tensor:
    """A per-token temperature tensor, checked against ``labels`` (int64, the caller's layout).

    Returns it detached (the head gives the temperature no gradient) and broadcast to
    ``labels``' shape (a view). ``flat_labels`` (verl's pairing) also takes any tensor of
    ``labels.numel()`` elements, in the labels' memory order.

    Raises:
        TypeError: not a tensor, or not a floating-point dtype (integer, bool, complex).
        ValueError: on another device than ``labels``, or a shape that does not broadcast to
            ``labels``' shape. Its *values* are checked by :func:`check_temperature_values`.
    """
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature must be {TEMPERATURE_TYPES}, got {type_name(temperature)}")
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature must be a floating-point tensor, got dtype {temperature.dtype}")
    if temperature.device != labels.device:
        raise ValueError(
            f"temperature must be on the labels' device {labels.device}, got a tensor on {temperature.device}"
        )
    temperature = temperature.detach()
    shape = tuple(labels.shape)
    try:
        broadcast = torch.broadcast_shapes(tuple(temperature.shape), shape) == shape
    except RuntimeError:
        broadcast = False
    if broadcast:
        return temperature.expand(shape)
    if flat_labels and temperature.numel() == labels.numel():
        return temperature.reshape(shape)
    what = f"{labels.numel()} elements or " if flat_labels else ""
    raise ValueError(
        f"temperature must be shaped like labels {shape} or broadcastable to it ({what}e.g. [b, 1] per "
        f"sequence for [b, s] labels), got shape {tuple(temperature.shape)}"
    )


def bad_temperatures(temperature: torch.Tensor) -> torch.Tensor:
    """Bool mask of the values :func:`check_temperature` would refuse: NaN, ±inf, or below
    :data:`MIN_TEMPERATURE` (zero and negatives included). Compared in fp64, as the float path."""
    values = temperature.to(torch.float64)
    return ~(torch.isfinite(values) & (values >= MIN_TEMPERATURE))


def check_ignore_index(ignore_index: object) -> int:
    """``ignore_index`` is an int (bool is not accepted) that fits in int64, the dtype labels are
    compared in; returns it."""
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {type_name(ignore_index)}")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64 (labels are compared in int64), got {ignore_index}")
    return ignore_index


def check_tensor(name: str, value: object, kind: str = "any") -> torch.Tensor:
    """``value`` is a tensor; ``kind`` "float": floating point, "index": integer, "mask": bool,
    integer or floating point (a 0/1 mask or per-token weights). TypeError otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(value)}")
    dtype = value.dtype
    is_int = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    ok = {
        "any": True,
        "float": dtype.is_floating_point,
        "index": is_int,
        "mask": dtype.is_floating_point or is_int or dtype == torch.bool,
    }[kind]
    if not ok:
        what = {"float": "a floating-point", "index": "an integer", "mask": "a bool, integer or floating-point"}[kind]
        raise TypeError(f"{name} must be {what} tensor, got dtype {dtype}")
    return value


def check_process_group(group: object, name: str = "tp_group") -> None:
    """``group`` is None (one rank) or a ``torch.distributed.ProcessGroup``."""
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type_name(group)}")


def check_tensors(hidden: object, weight: object, labels: object, precision: str = "auto") -> None:
    """Tensors, floating ``hidden`` and ``weight`` of one dtype (or, with a ``precision`` other
    than ``"auto"``, 16-bit ``hidden`` with an fp32 ``weight``), ``labels`` of a
    :data:`LABEL_DTYPES` dtype, one device."""
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type_name(value)}")
    if not hidden.dtype.is_floating_point:
        raise TypeError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    if hidden.dtype not in HIDDEN_DTYPES:
        accepted = ", ".join(str(dtype).removeprefix("torch.") for dtype in HIDDEN_DTYPES)
        raise TypeError(f"hidden must be {accepted}, got dtype {hidden.dtype} (cast it and the weight)")
    upcast = precision != "auto" and weight.dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16)
    if weight.dtype != hidden.dtype and not upcast:
        # The head computes in its inputs' dtype inside autocast regions too.
        hint = " (the head does not follow torch.autocast: cast one of them)" if _autocast_on(hidden.device) else ""
        raise TypeError(
            f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}{hint}; a 16-bit hidden with an "
            "fp32 weight takes precision='fp32_faithful' or 'ieee'"
        )
    if labels.dtype not in LABEL_DTYPES:
        accepted = ", ".join(str(dtype).removeprefix("torch.") for dtype in LABEL_DTYPES)
        raise TypeError(f"labels must be an integer tensor ({accepted}), got dtype {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"hidden, weight and labels must be on one device, got hidden on {hidden.device}, "
            f"weight on {weight.device}, labels on {labels.device}"
        )


def _autocast_on(device: torch.device) -> bool:
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


def check_layout(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp_size: int,
    sequence_parallel: bool,
    *,
    ids: bool = False,
) -> None:
    """Shapes of docs/design.md §3: [s,b,h]+[b,s], [t,1,h]+[1,t], [n,h]+[n]; SP shards dim 0 of
    hidden. ``ids``: labels carry a trailing ``k >= 1`` dim (``k`` ids per token)."""
    check_weight_shape(weight)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [n, h] or [s, b, h], got shape {tuple(hidden.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} (last dim of hidden) does not match weight's second dim {weight.shape[1]}"
        )
    sp = sequence_parallel and tp_size > 1
    seq = hidden.shape[0] * (tp_size if sp else 1)
    if hidden.dim() == 3:
        expected = (hidden.shape[1], seq)
        what = "[b, s, k] for hidden [s, b, h]" if ids else "[b, s] for hidden [s, b, h]"
    else:
        expected = (seq,)
        what = "[n, k] for hidden [n, h]" if ids else "[n] for hidden [n, h]"
    if ids:
        if labels.dim() != len(expected) + 1 or tuple(labels.shape[:-1]) != expected:
            sp_note = f" (hidden's first dim {hidden.shape[0]} is the SP shard, × tp {tp_size})" if sp else ""
            shape = ", ".join(map(str, expected))
            raise ValueError(
                f"labels must have shape {what} with k ids per token, i.e. ({shape}, k){sp_note}, got "
                f"{tuple(labels.shape)} (one more dim than the tokens': read as k ids per token)"
            )
        if labels.shape[-1] < 1:
            raise ValueError(f"labels must hold k >= 1 ids per token (last dim), got shape {tuple(labels.shape)}")
        return
    if tuple(labels.shape) != expected:
        if sp and labels.dim() == len(expected) and labels.shape[-1] % tp_size:
            raise ValueError(
                f"sequence_parallel: the sequence length {labels.shape[-1]} of labels is not "
                f"divisible by the tensor-parallel size {tp_size}"
            )
        sp_note = f" (hidden's first dim {hidden.shape[0]} is the SP shard, × tp {tp_size})" if sp else ""
        raise ValueError(f"labels must have shape {what}, i.e. {expected}{sp_note}, got {tuple(labels.shape)}")


def check_weight_shape(weight: torch.Tensor) -> None:
    """``weight`` is a ``[vocab_shard >= 1, hidden >= 1]`` matrix."""
    if weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight must be this rank's [vocab_shard, hidden] shard, got shape {tuple(weight.shape)}")
    if weight.shape[1] < 1:
        raise ValueError(
            f"the hidden size (last dim of hidden and weight) must be >= 1, got weight {tuple(weight.shape)}"
        )


def check_flat_layout(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tp_size: int) -> None:
    """verl's pairing: hidden ``[..., h]`` flattens to ``N`` tokens, labels hold ``N`` ids in any shape."""
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (the hidden size last)")
    tokens = math.prod(hidden.shape[:-1])
    if labels.numel() != tokens:
        raise ValueError(
            f"labels has {labels.numel()} elements but hidden flattens to {tokens} tokens "
            f"(hidden shape {tuple(hidden.shape)}, labels shape {tuple(labels.shape)})"
        )
    check_layout(hidden.reshape(tokens, hidden.shape[-1]), weight, labels.reshape(-1), tp_size, False)
