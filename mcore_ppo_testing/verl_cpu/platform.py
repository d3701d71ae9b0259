"""verl's platform layer answered for the CPU: devices, the gloo backend, Ray's logical GPUs.

verl 0.9.1 resolves one platform per process (``verl.plugin.platform.get_platform``, from
``VERL_PLATFORM`` or by probing) and registers CUDA, NPU and ROCm only; without a GPU it falls
back to CUDA. :class:`PlatformCPU` is registered under ``"cpu"`` through verl's own
``PlatformRegistry.register`` and picked with ``VERL_PLATFORM=cpu``. Ray still schedules verl's
workers by its ``GPU`` resource, so the driver declares logical GPUs (``ray_init.num_gpus``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["PLATFORM_NAME", "CpuDeviceModule", "PlatformCPU", "register_cpu_platform", "single_gloo_backend"]

PLATFORM_NAME = "cpu"


class CpuDeviceModule(ModuleType):
    """``torch.cpu`` with the ``torch.cuda`` calls verl makes answered as a CPU would answer them.

    verl calls its device module for memory statistics, cache flushes, RNG state and streams;
    on the CPU memory is the host's, there is nothing to flush, and there is one in-order stream.
    """

    def __init__(self) -> None:
        super().__init__("mcore_ppo_testing.verl_cpu.device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        # No accelerator: verl then skips seeding Megatron's CUDA RNG tracker (set_random_seed).
        return 0

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: object) -> None:
        return None

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "CPU"

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def synchronize(device: object = None) -> None:
        return None

    @staticmethod
    def memory_allocated(device: object = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: object = None) -> tuple[int, int]:
        import os

        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * size
        return pages * size, total

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: object = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device: object = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: object = None) -> None:
        torch.set_rng_state(state)


_DEVICE_MODULE = CpuDeviceModule()


def _platform_class() -> type:
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface on the CPU: device ``cpu``, collectives over gloo, Ray's
        ``GPU`` resource (logical GPUs declared by the driver), no profiler, no IPC."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return not torch.cuda.is_available()

        def current_device(self) -> torch.device:
            # verl's engines move tensors with `.to(get_device_id())`: an index would mean CUDA.
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


PlatformCPU: type | None = None


def single_gloo_backend() -> None:
    """``torch.distributed.init_process_group`` given verl's ``"cpu:gloo,<device>:<backend>"``
    with the CPU as the device (``"cpu:gloo,cpu:gloo"``, which torch refuses as a duplicate
    device) initialises ``"cpu:gloo"`` (idempotent)."""
    import torch.distributed as dist

    init = dist.init_process_group
    if getattr(init, "_mcore_ppo_single_gloo", False):
        return

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(backend, str) and "," in backend:
            backend = ",".join(dict.fromkeys(part.strip() for part in backend.split(",")))
        return init(backend, *args, **kwargs)

    init_process_group._mcore_ppo_single_gloo = True
    dist.init_process_group = init_process_group


def register_cpu_platform() -> type:
    """Register :class:`PlatformCPU` as verl's ``"cpu"`` platform (idempotent); returns it."""
    global PlatformCPU
    if PlatformCPU is None:
        from verl.plugin.platform import PlatformRegistry

        PlatformCPU = PlatformRegistry.register(platform=PLATFORM_NAME)(_platform_class())
        single_gloo_backend()
    return PlatformCPU
