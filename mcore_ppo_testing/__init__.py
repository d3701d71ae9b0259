"""Harness of mcore_ppo's tests, demo and benchmarks: CPU shims for Megatron, THD and
context-parallel core attention, the sequence-parallel torch norm, a reference GPT, the logits
path and the PPO harness; the head's fp64 reference (``reference``), the tests' seeds
(``seeds``) and the GPU benchmarks' helpers (``bench``).

It is a separate top-level package, not part of the product: ``mcore_ppo`` and ``parallel``
never import it (an import-linter contract in ``.ci/run`` enforces that).

Importing it on a machine without CUDA leaves Megatron's ``jit_fuser`` helpers undecorated
(:mod:`mcore_ppo_testing.megatron_jit`): they never run on the CPU paths, and decorating them
costs each process an inductor import."""

from mcore_ppo_testing.cpu_shims import cpu_shims, install_cpu_shims, shims_installed, uninstall_cpu_shims
from mcore_ppo_testing.megatron_jit import skip_megatron_jit_on_cpu

skip_megatron_jit_on_cpu()

__all__ = ["cpu_shims", "install_cpu_shims", "shims_installed", "uninstall_cpu_shims"]
