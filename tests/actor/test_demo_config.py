"""The demo config's one loader (``mcore_ppo_testing.demo_config``): the shipped YAML loads into
typed sections, and every bad key, type or value is refused with its key named (single process)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mcore_ppo.actor import PPOActorConfig
from mcore_ppo_testing.demo_config import (
    DemoConfig,
    LayoutConfig,
    add_override_arguments,
    apply_overrides,
    demo_config_from_dict,
    load_demo_config,
    main,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ppo_demo.yaml"
RAW = yaml.safe_load(CONFIG.read_text())


def _with(path: str, value) -> dict:
    """The shipped config with ``path`` (``section.key``) set to ``value`` (deleted when ``...``)."""
    raw = copy.deepcopy(RAW)
    *sections, key = path.split(".")
    node = raw
    for s in sections:
        node = node[s]
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return raw


def test_shipped_config_loads_typed():
    config = load_demo_config(CONFIG)
    assert isinstance(config, DemoConfig)
    assert (config.layout.tp, config.layout.cp, config.layout.pp) == (2, 2, 1)
    assert config.layout.sp and not config.layout.cp_at_head
    assert config.model.shape()["vocab_size"] == 512 and "params_dtype" not in config.model.shape()
    assert str(config.model.dtype) == "torch.float32"
    assert config.rollout.prompt_len == (4, 16) and config.rollout.response_len == (8, 40)
    assert config.run.tolerance.log_prob == 5e-5 and config.run.cp1_reference
    # The actor's options: typed by PPOActorConfig itself, the temperature from the head section.
    assert isinstance(config.ppo.actor, PPOActorConfig)
    assert config.ppo.actor.temperature == config.head.temperature == 0.7
    assert config.ppo.actor.clip_ratio_c == 3.0 and config.ppo.ppo_epochs == 2 and config.ppo.lr == 3e-4


def test_defaults_of_optional_sections_and_keys():
    raw = {k: v for k, v in RAW.items() if k in ("model", "rollout", "run")}
    config = demo_config_from_dict(raw)
    assert config.layout == LayoutConfig()
    assert (config.head.temperature, config.head.backend, config.head.buffer_budget_bytes) == (1.0, "auto", None)
    assert (config.ppo.ppo_epochs, config.ppo.lr) == (1, 1e-4)
    assert config.ppo.actor == PPOActorConfig()
    assert config.run.seed == 1234 and config.rollout.seed == 0


def test_whole_numbers_are_accepted_as_floats():
    config = demo_config_from_dict(_with("ppo.lr", 1))
    assert config.ppo.lr == 1.0 and isinstance(config.ppo.lr, float)
    assert isinstance(demo_config_from_dict(_with("ppo.max_grad_norm", 2)).ppo.actor.max_grad_norm, float)


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("ppo.clip_ratoi", 0.2, "ppo.clip_ratoi"),
        ("ppo.temperature", 0.7, "ppo.temperature"),  # the temperature is the head's
        ("layout.dp", 2, "layout.dp"),
        ("run.tolerance.logprob", 1e-5, "run.tolerance.logprob"),
        ("extra", {}, "extra"),
    ],
)
def test_unknown_keys_are_value_errors_naming_the_key(path, value, named):
    with pytest.raises(ValueError, match=re.escape(f"unknown key {named}")):
        demo_config_from_dict(_with(path, value))


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("ppo.clip_ratio", "0.2", "ppo.clip_ratio"),
        ("ppo.lr", "1e-4", "ppo.lr"),  # YAML 1.1 reads 1e-4 as a string
        ("ppo.micro_batch_size", 2.5, "ppo.micro_batch_size"),
        ("layout.tp", True, "layout.tp"),
        ("layout.sequence_parallel", 1, "layout.sequence_parallel"),
        ("rollout.prompt_len", [4, 16, 3], "rollout.prompt_len"),
        ("head.buffer_budget_bytes", "1GiB", "head.buffer_budget_bytes"),
        ("model", [1, 2], "model"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_key(path, value, named):
    with pytest.raises(TypeError, match=re.escape(named)):
        demo_config_from_dict(_with(path, value))


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("model.vocab_size", ..., "missing key model.vocab_size"),
        ("run.tolerance", ..., "missing key run.tolerance.log_prob"),
        ("rollout", ..., "missing key rollout"),
        ("layout.cp_mode", "inside", "layout.cp_mode"),
        ("layout.pp", 0, "layout.pp"),
        ("model.params_dtype", "float16", "model.params_dtype"),
        ("rollout.response_len", [9, 3], "rollout.response_len"),
        ("ppo.clip_ratio_c", 0.5, "ppo: clip_ratio_c"),  # the actor's own check, its section named
    ],
)
def test_missing_keys_and_bad_values_are_value_errors(path, value, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        demo_config_from_dict(_with(path, value))


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with("ppo.clip_ratoi", 0.2)))
    with pytest.raises(ValueError, match=re.escape(f"{path}: unknown key ppo.clip_ratoi")):
        load_demo_config(path)


def test_overrides_replace_and_recheck():
    config = load_demo_config(CONFIG)
    changed = config.with_overrides(tp=4, cp=1, sequence_parallel=False, cp_mode="head", steps=1, backend="torch")
    assert (changed.layout.tp, changed.layout.cp, changed.layout.pp) == (4, 1, 1)
    assert not changed.layout.sp and changed.layout.cp_mode == "head"
    assert changed.run.steps == 1 and changed.head.backend == "torch"
    assert config.with_overrides() == config and config.layout.tp == 2  # None keeps; the original is untouched
    with pytest.raises(ValueError, match=re.escape("layout.sequence_parallel needs layout.tp > 1")):
        config.with_overrides(tp=1)  # SP needs tp > 1: refused, not ignored
    assert not config.with_overrides(tp=1, sequence_parallel=False).layout.sp
    with pytest.raises(ValueError, match=re.escape("layout.tp")):
        config.with_overrides(tp=0)


def test_tp_1_on_the_command_line_and_sp():
    """``--tp 1`` turns the config's SP off (the layout it names has none); ``--sp`` with TP 1 is
    refused, not ignored."""
    parser = argparse.ArgumentParser()
    add_override_arguments(parser)
    config = load_demo_config(CONFIG)
    assert config.layout.sp
    assert not apply_overrides(config, parser.parse_args(["--tp", "1"])).layout.sp
    with pytest.raises(ValueError, match=re.escape("--sp needs --tp > 1")):
        apply_overrides(config, parser.parse_args(["--tp", "1", "--sp"]))
    assert apply_overrides(config, parser.parse_args(["--tp", "4", "--sp"])).layout.sp


def test_sizes_on_the_command_line_set_the_whole_layout():
    """``--tp 2`` alone is TP 2 × CP 1 × PP 1 (not the config's CP 2); no size given keeps the
    config's; a size below 1, or one the model does not divide by, names its flag."""
    parser = argparse.ArgumentParser()
    add_override_arguments(parser)
    config = load_demo_config(CONFIG)
    layout = apply_overrides(config, parser.parse_args(["--tp", "2"])).layout
    assert (layout.tp, layout.cp, layout.pp, layout.sp) == (2, 1, 1, True)
    layout = apply_overrides(config, parser.parse_args(["--pp", "2"])).layout
    assert (layout.tp, layout.cp, layout.pp, layout.sp) == (1, 1, 2, False)
    layout = apply_overrides(config, parser.parse_args([])).layout
    assert (layout.tp, layout.cp, layout.pp) == (config.layout.tp, config.layout.cp, config.layout.pp)
    with pytest.raises(ValueError, match=re.escape("--cp must be >= 1, got 0")):
        apply_overrides(config, parser.parse_args(["--cp", "0"]))
    with pytest.raises(ValueError, match=re.escape("model.vocab_size = 512 does not divide by --tp 3")):
        apply_overrides(config, parser.parse_args(["--tp", "3"]))


def test_command_line_prints_the_layout_or_exits_2(tmp_path, capsys):
    assert main([str(CONFIG), "--layout"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["2", "2", "1"]
    assert main([str(CONFIG), "--layout", "--tp", "4", "--cp", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["4", "1", "1"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with("layout.tp", "two")))
    assert main([str(path), "--layout"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "layout.tp" in captured.err
    assert main([str(tmp_path / "missing.yaml")]) == 2


# launch.sh checks the config before torchrun: that must not pay for importing Megatron.
_CHECK_WITHOUT_MEGATRON = """
import sys
from mcore_ppo_testing.demo_config import main
status = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
assert not loaded, loaded
sys.exit(status)
"""


def test_config_check_needs_no_megatron():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_WITHOUT_MEGATRON, str(CONFIG), "--layout"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["2", "2", "1"]


def test_actor_names_resolve_lazily():
    import mcore_ppo.actor as actor

    assert sorted(actor.__all__) == sorted(actor._EXPORTS)
    for name, module in actor._EXPORTS.items():
        assert getattr(actor, name) is getattr(__import__(module, fromlist=[name]), name)
    with pytest.raises(AttributeError, match="no_such_name"):
        actor.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "option, value, error, match",
    [
        ("clip_ratio", "0.2", TypeError, r"^clip_ratio must be a number, got str"),
        ("clip_ratio_low", "0.2", TypeError, r"^clip_ratio_low must be a number or None, got str"),
        ("clip_ratio_high", float("nan"), ValueError, r"^clip_ratio_high must be finite, got nan"),
        ("clip_ratio_c", True, TypeError, r"^clip_ratio_c must be a number or None, got bool"),
        ("entropy_coeff", "0", TypeError, r"^entropy_coeff must be a number, got str"),
        ("entropy_coeff", float("inf"), ValueError, r"^entropy_coeff must be finite"),
        ("max_grad_norm", "1.0", TypeError, r"^max_grad_norm must be a number or None, got str"),
        ("temperature", "1", TypeError, r"^temperature must be a number, got str"),
        ("micro_batch_size", 0, ValueError, r"^micro_batch_size must be >= 1, got 0"),
        ("micro_batch_size", 2.0, TypeError, r"^micro_batch_size must be an int or None, got float"),
        ("max_tokens_per_micro_batch", 0, ValueError, r"^max_tokens_per_micro_batch must be >= 1, got 0"),
        ("ignore_index", -100.0, TypeError, r"^ignore_index must be an int, got float"),
        ("pad_token_id", -1, ValueError, r"^pad_token_id must be >= 0, got -1"),
    ],
)
def test_actor_options_of_the_wrong_kind_are_refused_by_name(option, value, error, match):
    """PPOActorConfig checks each option's type before its range: a string from a config file
    is refused by name, not in a comparison or, for a coefficient, only inside the loss."""
    with pytest.raises(error, match=match):
        PPOActorConfig(**{option: value})
    PPOActorConfig(**{option: _ACCEPTED[option]})  # the same option with a value of its kind passes


# A value of each option's kind and range (ints where a float is taken, too).
_ACCEPTED = {
    "clip_ratio": 0.3, "clip_ratio_low": 0.1, "clip_ratio_high": 1, "clip_ratio_c": 3, "entropy_coeff": -0.01,
    "max_grad_norm": None, "temperature": 2, "micro_batch_size": 1, "max_tokens_per_micro_batch": 4096,
    "ignore_index": -1, "pad_token_id": 0,
}  # fmt: skip
