"""PPO steps of a small Megatron GPT with the fused head, and what they prove (the README's main command).

Run it through ``scripts/launch.sh`` (torchrun). The demo itself (the steps, the parity lines,
the PASS/FAIL verdict) is :mod:`mcore_ppo_testing.ppo_demo`; the config is read by
:func:`mcore_ppo_testing.demo_config.load_demo_config`. A parity failure exits 1, a bad config
or argument 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcore_ppo_testing.demo_config import DemoConfig, load_demo_config

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "ppo_demo.yaml"


def parse_config(argv: list[str] | None = None) -> DemoConfig:
    """The config file named on the command line (default ``configs/ppo_demo.yaml``) with the
    command-line overrides applied; a bad config or argument exits 2 (argparse's error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's)")
    parser.add_argument("--cp", type=int, help="context-parallel size (default: the config's)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default: the config's)")
    parser.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallelism on")
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    parser.add_argument("--cp-mode", choices=["model", "head"], help="where CP runs (default: the config's)")
    parser.add_argument("--steps", type=int, help="PPO steps (default: the config's)")
    parser.add_argument("--backend", help="head backend (default: the config's)")
    args = parser.parse_args(argv)
    try:
        config = load_demo_config(args.config).with_overrides(
            tp=args.tp,
            cp=args.cp,
            pp=args.pp,
            sequence_parallel=args.sp,
            cp_mode=args.cp_mode,
            steps=args.steps,
            backend=args.backend,
        )
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 = every parity check passed)."""
    config = parse_config(argv)
    from mcore_ppo_testing.ppo_demo import run_demo

    return run_demo(config)


if __name__ == "__main__":
    sys.exit(main())
