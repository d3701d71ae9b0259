"""What a caller chooses about the head (:class:`HeadOptions`) and how its tensors are laid out
(:class:`Layout`): frozen values, validated once when built, handed to the one pipeline.

The temperature is not an option but an input of each call (a number or a per-token tensor):
a per-call number is checked on its own, and the options object is reused as it is.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from mcore_ppo import validation
from mcore_ppo.backends import Backend, backend_precision, check_backend
from mcore_ppo.numerics import check_precision


@dataclass(frozen=True, kw_only=True)
class HeadOptions:
    """The head's options, validated when the object is built.

    Attributes:
        ignore_index: label value of tokens whose outputs are 0 and which get no gradient
            (prompt tokens, padding); an int that fits in int64.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:func:`mcore_ppo.backends.resolve_backend`),
            or a backend object built by the caller and used as it is, e.g.
            ``TritonBackend(TritonConfig(buffer_budget_bytes=...))`` (docs/kernels.md).
        return_entropy: False: no entropy work anywhere (the kernels skip its sums, the TP
            combine packs one value less, the backward drops its term); the entropy output is None.
        return_sum_pi_squared: True: a third output, per token ``Σ_v π_v²`` of the same
            tempered softmax (verl's optimal token baseline ``w_t = 1 − 2π_t + Σπ²``), from one
            more register sum in the same pass and one more value in the same TP all-reduce;
            fp32, clamped to ``[1/V, 1]``, 0 for ignored tokens, detached (no gradient). False
            (default): the outputs and the kernels are those without it.
        validate: True (default): every argument is checked and the verdict shared over the TP
            group before the first collective, without making the host wait for the device
            (docs/design.md §5): labels in ``[0, V)`` or ``ignore_index`` and a temperature
            tensor's values in ``[MIN_TEMPERATURE, inf)`` raise ValueError where reading them is
            free (CPU tensors), and elsewhere give their token NaN outputs, never a plausible
            number; the verdict is shared every call over a CPU (gloo) group, once per call
            signature over an accelerator's. False: the values are not read anywhere (NaN
            rule) and the verdict is shared once per signature on every group.
        precision: how fp32 operands are multiplied (:data:`mcore_ppo.numerics.PRECISIONS`):
            ``"auto"`` IEEE fp32 dots; ``"fp32_faithful"`` three fp16 products per product (the
            operands' fp16 parts) on the triton backend (fp32 accuracy at tensor-core speed); ``"ieee"`` IEEE, said
            explicitly. 16-bit operands are unaffected (their products are exact). None
            (default): a named backend's ``"auto"``, a backend object's own config.

    Raises:
        TypeError: a field of the wrong type (bool is not an int here; ``return_entropy``,
            ``return_sum_pi_squared`` and ``validate`` must be bools).
        ValueError: an ``ignore_index`` beyond int64, an unknown backend name or precision, or
            a precision other than a backend object's own.
    """

    ignore_index: int = -100
    backend: str | Backend = "auto"
    return_entropy: bool = True
    validate: bool = validation.VALIDATE_DEFAULT
    return_sum_pi_squared: bool = False
    precision: str | None = None

    def __post_init__(self) -> None:
        validation.check_ignore_index(self.ignore_index)
        check_backend(self.backend)
        validation.check_bool("return_entropy", self.return_entropy)
        validation.check_bool("return_sum_pi_squared", self.return_sum_pi_squared)
        # None is the entry points' "not given": the documented default.
        object.__setattr__(self, "validate", validation.resolve_validate(self.validate))
        if self.precision is not None:
            check_precision(self.precision)
            if not isinstance(self.backend, str) and self.precision != backend_precision(self.backend):
                raise ValueError(
                    f"precision={self.precision!r} differs from the backend object's own "
                    f"({backend_precision(self.backend)!r}): set it in the object's config"
                )

    @property
    def named_precision(self) -> str:
        """The precision a named backend is resolved with (``"auto"`` when none was given)."""
        return "auto" if self.precision is None else self.precision

    @property
    def effective_precision(self) -> str:
        """The precision the call runs with: the given one, else a backend object's own."""
        if self.precision is None and not isinstance(self.backend, str):
            return backend_precision(self.backend)
        return self.named_precision


def call_options(
    options: HeadOptions | None,
    *,
    ignore_index: int | None,
    backend: str | Backend | None,
    return_entropy: bool | None,
    validate: bool | None,
    return_sum_pi_squared: bool | None = None,
    precision: str | None = None,
) -> HeadOptions:
    """An entry point's :class:`HeadOptions`: ``options`` (default: the defaults) with every
    keyword that is not None put in its place.

    The common call, plain values and no options object, is built and validated once per
    distinct set of values; a bad value raises each time (an exception is not cached)."""
    if options is None:
        # The types are part of the key: True == 1, but ignore_index=True is refused.
        key = (
            type(ignore_index), ignore_index, type(backend), backend, type(return_entropy), return_entropy,
            type(validate), validate, type(return_sum_pi_squared), return_sum_pi_squared, type(precision), precision,
        )  # fmt: skip
        try:
            found = _PLAIN.get(key)
        except TypeError:  # an unhashable argument: no cache, the checks name it
            found, key = None, None
        if found is None:
            found = HeadOptions(
                **_given(ignore_index, backend, return_entropy, validate, return_sum_pi_squared, precision)
            )
            if key is not None:
                if len(_PLAIN) >= 64:
                    _PLAIN.clear()
                _PLAIN[key] = found
        return found
    if not isinstance(options, HeadOptions):
        raise TypeError(f"options must be a HeadOptions or None, got {validation.type_name(options)}")
    changes = _given(ignore_index, backend, return_entropy, validate, return_sum_pi_squared, precision)
    return replaced(options, **changes) if changes else options


def replaced(options: HeadOptions, **changes: object) -> HeadOptions:
    """``options`` with the fields ``changes`` names replaced (checked as :class:`HeadOptions`
    checks them), one object per options object and changes: a call's options are part of its
    prepared signature by identity (:class:`mcore_ppo.execution.Prepared`), so an override
    given on every call (a keyword beside an options object, the head module's per-call
    ``return_entropy``) must not make a new object each time, and a change to the values it
    holds returns it as it is. A bad value raises each time."""
    if all(_holds(options, name, value) for name, value in changes.items()):
        return options
    # The types are part of the key: True == 1, but return_entropy=1 is refused.
    key = (id(options), *((name, type(value), value) for name, value in sorted(changes.items())))
    try:
        found = _REPLACED.get(key)
    except TypeError:  # an unhashable value: no cache, the checks name it
        return dataclasses.replace(options, **changes)
    if found is None:
        found = dataclasses.replace(options, **changes)
        if len(_REPLACED) >= 64:
            _REPLACED.clear()
        # Holding the base options keeps its id from being reused while the entry lives.
        _REPLACED[key] = (options, found)
        return found
    return found[1]


# (type, value) of each keyword of a call without an options object -> its HeadOptions (frozen:
# one object serves every call with these values; a bad value raises each time, never cached).
_PLAIN: dict[tuple, HeadOptions] = {}


def _holds(options: HeadOptions, name: str, value: object) -> bool:
    """``options`` already has this value (and type) for the field ``name``."""
    held = getattr(options, name, _NO_FIELD)
    return type(held) is type(value) and held == value


_NO_FIELD = object()

# (id of an options object, (name, type, value) of each change) -> (that object, the replaced one).
_REPLACED: dict[tuple, tuple[HeadOptions, HeadOptions]] = {}


def _given(ignore_index, backend, return_entropy, validate, return_sum_pi_squared, precision) -> dict[str, object]:
    """The entry point's keywords that are not None, by field name."""
    given = (
        ("ignore_index", ignore_index), ("backend", backend), ("return_entropy", return_entropy),
        ("validate", validate), ("return_sum_pi_squared", return_sum_pi_squared), ("precision", precision),
    )  # fmt: skip
    return {name: value for name, value in given if value is not None}


class TokenOrder(enum.Enum):
    """How ``hidden``'s tokens pair with ``labels``."""

    #: Megatron's: hidden ``[s, b, h]`` with labels ``[b, s]`` (packed THD: ``[t, 1, h]`` with
    #: ``[1, t]``), or ``[n, h]`` with ``[n]``; a trailing ``k`` dim on labels gives ``k`` ids per
    #: token. Outputs are shaped like the labels.
    MEGATRON = "megatron"
    #: verl's: hidden ``[..., h]`` flattens to ``N`` tokens, labels hold their ``N`` ids in
    #: memory order, in any shape; outputs are ``[N]``.
    FLAT = "flat"


class HiddenGrad(enum.Enum):
    """Where the TP sum of ``d_hidden`` happens (it must happen exactly once)."""

    #: Hidden is replicated over TP; the head all-reduces ``d_hidden``.
    REDUCED = "reduced"
    #: Hidden is this rank's sequence shard: the head all-gathers it, and its backward
    #: reduce-scatters ``d_hidden`` (the TP sum and the SP scatter in one collective).
    SEQUENCE_PARALLEL = "sequence_parallel"
    #: Every rank returns its own shard's partial ``d_hidden``; the caller reduces it (verl's contract).
    PARTIAL = "partial"


class WeightGrad(enum.Enum):
    """Where the weight gradient goes."""

    #: Returned to autograd (``weight.grad``).
    GRAD = "grad"
    #: Accumulated into ``weight.main_grad`` (fp32) as Megatron's gradient-accumulation fusion
    #: does; autograd gets zeros and ``weight.grad_added_to_main_grad`` is set.
    MAIN_GRAD = "main_grad"


@dataclass(frozen=True)
class Layout:
    """How a call's tensors are laid out and where its gradients go."""

    tokens: TokenOrder = TokenOrder.MEGATRON
    hidden_grad: HiddenGrad = HiddenGrad.REDUCED
    weight_grad: WeightGrad = WeightGrad.GRAD

    @property
    def sequence_parallel(self) -> bool:
        """``hidden`` is this rank's sequence shard."""
        return self.hidden_grad is HiddenGrad.SEQUENCE_PARALLEL


def megatron_layout(sequence_parallel: bool, main_grad: bool = False) -> Layout:
    """The layout of a Megatron caller (the function, the head module): SP or not, and whether
    the weight gradient goes into ``main_grad``."""
    validation.check_bool("sequence_parallel", sequence_parallel)
    validation.check_bool("accumulate_into_main_grad", main_grad)
    return _MEGATRON_LAYOUTS[sequence_parallel, main_grad]


#: What a call whose own arguments were refused falls back to while its verdict is shared.
DEFAULT_OPTIONS = HeadOptions()
DEFAULT_LAYOUT = Layout()

_MEGATRON_LAYOUTS = {
    (sp, main): Layout(
        TokenOrder.MEGATRON,
        HiddenGrad.SEQUENCE_PARALLEL if sp else HiddenGrad.REDUCED,
        WeightGrad.MAIN_GRAD if main else WeightGrad.GRAD,
    )
    for sp in (False, True)
    for main in (False, True)
}
