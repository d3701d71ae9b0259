"""``scripts/launch.sh``'s pre-flight: the demo config check and the GPU count, in one interpreter.

    python scripts/launch_preflight.py [--nproc N] CONFIG [ppo_step.py's overrides: --tp N, ...]

Prints two lines: ``tp cp pp nproc gpus``, the layout (the config's, or the sizes given: those
not given are then 1), the ranks (``--nproc``, default tp*cp*pp) and the number of GPUs the ranks
would see; then ``launch: ...``, the run's layout and ranks and where each came from (flag or
config), which ``launch.sh`` prints first. A bad config,
size or option is one line on stderr and exit 2: the config's and the overrides' from
:func:`mcore_ppo_testing.demo_config.main` (the demo's own loader, ``demo_config: ...``), a
``--nproc`` that is not a multiple of tp*cp*pp from here.

torch is imported only to count the GPUs, once everything else has passed, and not at all when
``CUDA_VISIBLE_DEVICES`` is set and empty (no GPU can be visible): a refusal costs a Python
start-up and a YAML read, not a torch import. The loader is imported without the harness
package's ``__init__`` (which imports torch for the CPU shims); its own imports
(``mcore_ppo.actor.config``, PyYAML) need no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _demo_config() -> ModuleType:
    """``mcore_ppo_testing.demo_config``, loaded from its file (the package's ``__init__`` not run)."""
    name = "mcore_ppo_testing.demo_config"
    spec = importlib.util.spec_from_file_location(name, ROOT / "mcore_ppo_testing" / "demo_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the dataclasses' type hints are resolved through sys.modules
    spec.loader.exec_module(module)
    return module


def visible_gpus() -> int:
    """How many GPUs a rank started from here would see (0 without CUDA)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    """Check the config, the overrides and ``--nproc``; print ``tp cp pp nproc gpus`` (exit 0), or
    one line on stderr (exit 2)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # mcore_ppo from the checkout, as scripts/ppo_step.py imports it
    ranks = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ranks.add_argument("--nproc", type=int)
    known, rest = ranks.parse_known_args(sys.argv[1:] if argv is None else argv)
    layout = io.StringIO()
    with contextlib.redirect_stdout(layout):
        status = _demo_config().main([*rest, "--layout"])
    if status != 0:
        return status
    sizes, origin = layout.getvalue().splitlines()
    tp, cp, pp = map(int, sizes.split())
    nproc = tp * cp * pp if known.nproc is None else known.nproc
    if nproc < 1 or nproc % (tp * cp * pp):
        print(f"--nproc {nproc} is not a multiple of tp*cp*pp = {tp * cp * pp}", file=sys.stderr)
        return 2
    replicas = nproc // (tp * cp * pp)
    ranks = f"{nproc} rank{'s' * (nproc > 1)}"
    if known.nproc is not None:
        ranks += f" (--nproc: {replicas} data-parallel replica{'s' * (replicas > 1)})"
    print(tp, cp, pp, nproc, visible_gpus())
    print(f"launch: {ranks}, {origin}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
