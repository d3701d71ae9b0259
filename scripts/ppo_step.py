"""PPO steps of a small Megatron GPT with the fused head, and what they prove (the README's main command).

Run it through ``scripts/launch.sh`` (torchrun). The demo itself (the steps, the parity lines,
the PASS/FAIL verdict) is :mod:`mcore_ppo_testing.ppo_demo`; the config is read by
:func:`mcore_ppo_testing.demo_config.load_demo_config`. A parity failure exits 1, a bad config
or argument 2.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `python scripts/ppo_step.py` (torchrun's way) puts scripts/ first on sys.path: the harness
# (mcore_ppo_testing) is not installed with the wheel, it is imported from the checkout.
sys.path.insert(0, str(ROOT))

from mcore_ppo_testing.demo_config import (  # noqa: E402
    DemoConfig,
    add_override_arguments,
    apply_overrides,
    load_demo_config,
)

DEFAULT_CONFIG = ROOT / "configs" / "ppo_demo.yaml"


def parse_config(argv: list[str] | None = None) -> DemoConfig:
    """The config file named on the command line (default ``configs/ppo_demo.yaml``) with the
    command-line overrides applied; a bad config or argument exits 2 (argparse's error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the demo's YAML config (default: %(default)s)")
    add_override_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = apply_overrides(load_demo_config(args.config), args)
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 = every parity check passed)."""
    config = parse_config(argv)
    from mcore_ppo_testing.ppo_demo import run_demo

    return run_demo(config)


if __name__ == "__main__":
    status = main()
    # The rank is done: its interpreter's shutdown would walk every object torch and Megatron left
    # in its garbage collections (~1.5 s of CPU per rank, measured); frozen, they are skipped.
    gc.freeze()
    sys.exit(status)
