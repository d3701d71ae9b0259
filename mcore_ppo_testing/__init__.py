"""Harness of mcore_ppo's tests, demo and benchmarks: CPU shims for Megatron, THD and
context-parallel core attention, the sequence-parallel torch norm, a reference GPT, the logits
path and the PPO harness; the head's fp64 reference (``reference``), the tests' seeds
(``seeds``) and the GPU benchmarks' helpers (``bench``).

It is a separate top-level package, not part of the product: ``mcore_ppo`` and ``parallel``
never import it (an import-linter contract in ``.ci/run`` enforces that)."""

from mcore_ppo_testing.cpu_shims import cpu_shims, install_cpu_shims, shims_installed, uninstall_cpu_shims

__all__ = ["cpu_shims", "install_cpu_shims", "shims_installed", "uninstall_cpu_shims"]
