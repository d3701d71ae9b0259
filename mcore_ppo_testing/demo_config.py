"""The PPO demo's configuration (``configs/ppo_demo.yaml``): typed sections and the one loader.

``scripts/launch.sh`` and ``scripts/ppo_step.py`` both read the YAML through
:func:`load_demo_config`, which checks every key and type once: an unknown key is a
``ValueError`` and a value of the wrong type a ``TypeError``, each naming the key
(``ppo.clip_ratio``). The ``ppo`` section holds :class:`~mcore_ppo.actor.PPOActorConfig`'s
options (the temperature comes from ``head``) plus the demo's ``ppo_epochs`` and ``lr``.

The sizes are checked against the model too (``vocab_size``, ``num_attention_heads`` and
``ffn_hidden_size`` divide by ``tp``, ``num_layers`` by ``pp``), and the head's backend name
against :data:`mcore_ppo.backends.BACKENDS`, whenever a config is built or overridden.

Command line (``launch.sh`` runs the same check through ``scripts/launch_preflight.py``, before it
starts torchrun; the module imports without torch, so a refusal costs no torch import)::

    python -m mcore_ppo_testing.demo_config CONFIG [ppo_step.py's overrides] --layout
    # prints "tp cp pp" (the config's, or the sizes given), then where each part of the layout
    # comes from (layout_origin); one line and exit 2 on a bad config, size or option

Sizes on the command line (``--tp``, ``--cp``, ``--pp``) set the whole layout, the ones not given
being 1: ``--tp 2`` is a TP 2 run on 2 ranks whatever CP or PP the config names; without any,
the config's layout runs (:func:`apply_overrides`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_ppo.actor import PPOActorConfig

__all__ = [
    "DemoConfig",
    "HeadConfig",
    "LayoutConfig",
    "ModelConfig",
    "PPOConfig",
    "RolloutConfig",
    "RunConfig",
    "ToleranceConfig",
    "add_override_arguments",
    "apply_overrides",
    "layout_origin",
    "load_demo_config",
]

_DTYPES = ("float32", "float64", "bfloat16")
# mcore_ppo.backends.BACKENDS, repeated so that this module imports without torch (the registry
# imports it): scripts/launch.sh's pre-flight checks a config before torchrun, and a refusal should
# not cost a torch import. tests/harness/test_launch.py checks that the two agree.
_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class LayoutConfig:
    """The parallel layout. ``sequence_parallel`` needs ``tp > 1`` (refused otherwise)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    cp_mode: str = "model"  # model: the decoder runs CP | head: CP at the head only

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.cp_mode not in ("model", "head"):
            raise ValueError(f"layout.cp_mode must be 'model' or 'head', got {self.cp_mode!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("layout.sequence_parallel needs layout.tp > 1 (SP shards the sequence over the TP ranks)")

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on."""
        return self.sequence_parallel

    @property
    def cp_at_head(self) -> bool:
        """CP applied at the head (the model sees whole sequences)."""
        return self.cp > 1 and self.cp_mode == "head"


@dataclass(frozen=True)
class ModelConfig:
    """The GPT's shape (``build_gpt_model``'s keywords) and parameter dtype."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_sequence_length: int
    ffn_hidden_size: int | None = None
    tie_embeddings: bool = False
    params_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"model.params_dtype must be one of {', '.join(_DTYPES)}, got {self.params_dtype!r}")

    def shape(self) -> dict[str, Any]:
        """``build_gpt_model``'s shape keywords (everything but the dtype)."""
        shape = dataclasses.asdict(self)
        del shape["params_dtype"]
        return shape

    @property
    def dtype(self) -> Any:
        """``params_dtype`` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.params_dtype)


@dataclass(frozen=True)
class HeadConfig:
    """The fused head's options."""

    temperature: float = 1.0
    backend: str = "auto"  # auto | torch | triton
    buffer_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"head.backend must be one of {', '.join(_BACKENDS)}, got {self.backend!r}")


@dataclass(frozen=True)
class PPOConfig:
    """The actor's options and the demo's optimiser loop."""

    actor: PPOActorConfig
    ppo_epochs: int = 1  # policy updates per rollout
    lr: float = 1e-4  # AdamW


@dataclass(frozen=True)
class RolloutConfig:
    """Synthetic packed rollouts: inclusive length ranges of prompts and responses."""

    num_seqs: int
    prompt_len: tuple[int, int]
    response_len: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "response_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"rollout.{name} must be [low, high] with 1 <= low <= high, got {[low, high]}")


@dataclass(frozen=True)
class ToleranceConfig:
    """What the parity lines must stay under."""

    log_prob: float  # |head - fp64 full-logits path| (and |CP - cp1|)
    entropy: float
    params: float  # max |CP - cp1| over every parameter after all steps


@dataclass(frozen=True)
class RunConfig:
    """Steps, the model's seed, the cp=1 reference and the tolerances."""

    steps: int
    tolerance: ToleranceConfig
    seed: int = 1234  # model initialisation
    cp1_reference: bool = True  # with CP: also run the same steps without CP and compare


@dataclass(frozen=True)
class DemoConfig:
    """The whole demo configuration, as :func:`load_demo_config` returns it."""

    model: ModelConfig
    rollout: RolloutConfig
    run: RunConfig
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(actor=PPOActorConfig()))

    def __post_init__(self) -> None:
        # What Megatron would refuse on every rank after torchrun started: checked here, once.
        model, layout = self.model, self.layout
        ffn = model.ffn_hidden_size if model.ffn_hidden_size is not None else 4 * model.hidden_size
        for name, size, by, what in (
            ("model.vocab_size", model.vocab_size, layout.tp, "tp"),
            ("model.num_attention_heads", model.num_attention_heads, layout.tp, "tp"),
            ("model.ffn_hidden_size", ffn, layout.tp, "tp"),
            ("model.hidden_size", model.hidden_size, model.num_attention_heads, "model.num_attention_heads"),
            ("model.num_layers", model.num_layers, layout.pp, "pp"),
        ):
            if size % by:
                raise ValueError(f"{name} = {size} does not divide by {what} = {by}")
        if self.run.steps < 1:
            raise ValueError(f"run.steps must be >= 1, got {self.run.steps}")

    def with_overrides(
        self,
        *,
        tp: int | None = None,
        cp: int | None = None,
        pp: int | None = None,
        sequence_parallel: bool | None = None,
        cp_mode: str | None = None,
        steps: int | None = None,
        backend: str | None = None,
    ) -> DemoConfig:
        """A copy with the given (command-line) values; None keeps the config's."""
        layout = {"tp": tp, "cp": cp, "pp": pp, "sequence_parallel": sequence_parallel, "cp_mode": cp_mode}
        layout = {k: v for k, v in layout.items() if v is not None}
        config = dataclasses.replace(self, layout=dataclasses.replace(self.layout, **layout))
        if steps is not None:
            config = dataclasses.replace(config, run=dataclasses.replace(config.run, steps=steps))
        if backend is not None:
            config = dataclasses.replace(config, head=dataclasses.replace(config.head, backend=backend))
        return config


# ---------------------------------------------------------------------------------------------
# The loader


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:  # YAML writes whole numbers as ints
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, list | tuple) and len(value) == len(args) and all(map(_matches, value, args))
    raise TypeError(f"no YAML check for {annotation!r}")  # a new field type: teach _matches


def _describe(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _typed(value: Any, annotation: Any, key: str) -> Any:
    if not _matches(value, annotation):
        hint = ""
        if isinstance(value, str) and _matches(0.5, annotation):
            # PyYAML reads YAML 1.1, where 1e-4 (no dot) is a string.
            hint = " (write a float with a dot, e.g. 1.0e-4: YAML reads 1e-4 as a string)"
        raise TypeError(f"{key} must be {_describe(annotation)}, got {type(value).__name__} {value!r}{hint}")
    if isinstance(value, list):
        return tuple(value)
    if type(value) is int and _matches(0.5, annotation):
        return float(value)
    return value


def _mapping(raw: Any, key: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TypeError(f"{key} must be a mapping, got {type(raw).__name__}")
    return dict(raw)


def _check_keys(raw: dict[str, Any], known: list[str], required: list[str], section: str) -> None:
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown key {section}{unknown[0]} (known: {', '.join(known)})")
    missing = [name for name in required if name not in raw]
    if missing:
        raise ValueError(f"missing key {section}{missing[0]}")


def _fields(cls: type, raw: dict[str, Any], section: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw``'s values checked against ``cls``'s fields (``skip``: fields the caller fills)."""
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    _check_keys(raw, [f.name for f in fields], required, f"{section}.")
    hints = typing.get_type_hints(cls)
    return {name: _typed(value, hints[name], f"{section}.{name}") for name, value in raw.items()}


def demo_config_from_dict(raw: Any) -> DemoConfig:
    """A :class:`DemoConfig` from the parsed YAML (see :func:`load_demo_config` for the errors)."""
    raw = _mapping(raw, "the config")
    _check_keys(raw, ["model", "layout", "head", "ppo", "rollout", "run"], ["model", "rollout", "run"], "")
    head = HeadConfig(**_fields(HeadConfig, _mapping(raw.get("head"), "head"), "head"))
    run = _mapping(raw["run"], "run")
    tolerance = _fields(ToleranceConfig, _mapping(run.pop("tolerance", None), "run.tolerance"), "run.tolerance")
    ppo = _mapping(raw.get("ppo"), "ppo")
    loop = _fields(PPOConfig, {k: ppo.pop(k) for k in ("ppo_epochs", "lr") if k in ppo}, "ppo", skip=("actor",))
    actor_options = _fields(PPOActorConfig, ppo, "ppo", skip=("temperature",))
    try:
        actor = PPOActorConfig(temperature=head.temperature, **actor_options)
    except ValueError as e:  # the actor's own checks (clip ratios, aggregation mode, ...)
        raise ValueError(f"ppo: {e}") from e
    return DemoConfig(
        model=ModelConfig(**_fields(ModelConfig, _mapping(raw["model"], "model"), "model")),
        rollout=RolloutConfig(**_fields(RolloutConfig, _mapping(raw["rollout"], "rollout"), "rollout")),
        run=RunConfig(tolerance=ToleranceConfig(**tolerance), **_fields(RunConfig, run, "run", skip=("tolerance",))),
        layout=LayoutConfig(**_fields(LayoutConfig, _mapping(raw.get("layout"), "layout"), "layout")),
        head=head,
        ppo=PPOConfig(actor=actor, **loop),
    )


def load_demo_config(path: str | Path) -> DemoConfig:
    """Read and check a demo YAML config.

    Raises:
        OSError: the file cannot be read.
        ValueError: an unknown or missing key, or a value out of range, named in the message
            (prefixed with the file).
        TypeError: a value of the wrong type, its key named in the message (prefixed with the file).
    """
    with open(path) as f:
        raw = yaml.safe_load(f)
    try:
        return demo_config_from_dict(raw)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from e


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line overrides of a config (``scripts/ppo_step.py``'s, checked by ``launch.sh``)."""
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's)")
    parser.add_argument("--cp", type=int, help="context-parallel size (default: the config's)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default: the config's)")
    parser.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallelism on")
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    parser.add_argument("--cp-mode", choices=["model", "head"], help="where CP runs (default: the config's)")
    parser.add_argument("--steps", type=int, help="PPO steps (default: the config's)")
    parser.add_argument("--backend", help=f"head backend, one of {', '.join(_BACKENDS)} (default: the config's)")


_SIZES = ("tp", "cp", "pp")


def _given_sizes(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in _SIZES if getattr(args, name) is not None}


def apply_overrides(config: DemoConfig, args: argparse.Namespace) -> DemoConfig:
    """``config`` with the values of :func:`add_override_arguments` given on the command line.

    Sizes given set the whole layout: those not given are 1 (``--tp 2`` alone is TP 2 × CP 1 ×
    PP 1, not TP 2 with the config's CP); with none given the config's sizes stay. A size below 1,
    or one the model does not divide by, is refused naming its flag (ValueError). Sequence
    parallelism shards the sequence over the TP ranks, so it needs TP > 1: ``--sp`` with a TP of
    1 is refused rather than ignored, and a TP of 1 turns a config's SP off (the layout it names
    has none)."""
    given = _given_sizes(args)
    for name, value in given.items():
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    sizes = {name: given.get(name, 1) for name in _SIZES} if given else {}
    tp = sizes.get("tp", config.layout.tp)
    sequence_parallel = args.sp
    if tp == 1:
        if args.sp:
            raise ValueError("--sp needs --tp > 1: sequence parallelism shards the sequence over the TP ranks")
        sequence_parallel = False
    try:
        return config.with_overrides(
            **sizes,
            sequence_parallel=sequence_parallel,
            cp_mode=args.cp_mode,
            steps=args.steps,
            backend=args.backend,
        )
    except ValueError as err:
        # DemoConfig names a size by its config key; this one came from the command line.
        message = str(err)
        for name, value in given.items():
            message = message.replace(f"by {name} = {value}", f"by --{name} {value}")
        raise ValueError(message) from err


def layout_origin(config: DemoConfig, args: argparse.Namespace, path: str | Path) -> str:
    """The layout :func:`apply_overrides` makes of ``config`` (read from ``path``) and ``args``, and
    where each part came from, in one line (``launch.sh``'s first): e.g. ``TP 2 × CP 1 × PP 1,
    SP on: TP from --tp; CP 1, PP 1 (not given: sizes on the command line set the whole layout,
    the config's CP 2 is not used); SP from configs/ppo_demo.yaml``."""
    layout = apply_overrides(config, args).layout
    given = _given_sizes(args)
    parts, from_config = [], []
    if given:
        parts.append(", ".join(f"{name.upper()} from --{name}" for name in given))
        rest = [name for name in _SIZES if name not in given]
        if rest:
            unused = [f"{name.upper()} {size}" for name in rest if (size := getattr(config.layout, name)) != 1]
            note = f", the config's {' and '.join(unused)} not used" if unused else ""
            parts.append(
                f"{', '.join(name.upper() + ' 1' for name in rest)} (not given: sizes on the command line set the "
                f"whole layout{note})"
            )
    else:
        from_config += ["TP", "CP", "PP"]
    if args.sp is not None:
        parts.append(f"SP from {'--sp' if args.sp else '--no-sp'}")
    elif layout.tp == 1 and config.layout.sp:
        parts.append("SP off (TP 1)")
    else:
        from_config.append("SP")
    if from_config:
        parts.append(f"{', '.join(from_config[:-1])} and {from_config[-1]}" if len(from_config) > 1 else from_config[0])
        parts[-1] += f" from {path}"
    cp_mode = f" ({'in the model' if layout.cp_mode == 'model' else 'at the head'})" if layout.cp > 1 else ""
    return (
        f"TP {layout.tp} × CP {layout.cp}{cp_mode} × PP {layout.pp}, SP {'on' if layout.sp else 'off'}: "
        + "; ".join(parts)
    )


class _OneLineParser(argparse.ArgumentParser):
    """An argument error is one line (``launch.sh`` shows it as it is), not usage plus error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m mcore_ppo_testing.demo_config CONFIG [overrides] [--layout]``: check CONFIG
    with the overrides (one line on stderr and exit 2 when bad); ``--layout`` prints ``tp cp pp``,
    then :func:`layout_origin`'s line."""
    parser = _OneLineParser(prog="demo_config", description=main.__doc__)
    parser.add_argument("config")
    add_override_arguments(parser)
    parser.add_argument("--layout", action="store_true", help="print the layout's tp cp pp")
    args = parser.parse_args(argv)
    try:
        config = load_demo_config(args.config)
        layout = apply_overrides(config, args).layout
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        print(f"demo_config: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.layout:
        print(layout.tp, layout.cp, layout.pp)
        print(layout_origin(config, args, args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
