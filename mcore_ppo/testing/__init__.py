"""Test and CPU-demo helpers; the library itself never imports this package."""

from mcore_ppo.testing.cpu_shims import cpu_shims, install_cpu_shims, shims_installed, uninstall_cpu_shims

__all__ = ["cpu_shims", "install_cpu_shims", "shims_installed", "uninstall_cpu_shims"]
