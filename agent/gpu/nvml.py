"""`NvmlBackend`: GPU facts from NVML through nvidia-ml-py (the `pynvml` module).

Every per-field call goes through `_optional`, so a field the driver does not support is N/A
(None) instead of an error, and a GPU that fell off the bus is reported as `lost` rather than
taking the whole sample down.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from agent.gpu.types import (
    EngineLoadSource,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuSnapshot,
    NvmlUnavailable,
)

T = TypeVar("T")


class _GpuLost(Exception):
    """Internal: NVML said this device is lost; the device is reported with health `lost`."""


def _import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:  # the `gpu` extra is not installed
        raise NvmlUnavailable(
            "the pynvml module is missing: install dctl with the `gpu` extra (nvidia-ml-py)"
        ) from exc
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cuda_version_text(encoded: int) -> str:
    """NVML encodes CUDA 12.4 as 12040."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


class NvmlBackend:
    """GPU backend on NVML. Raises `NvmlUnavailable` when the library cannot load."""

    name = "nvml"
    engine_device = "auto"  # torch sees the GPUs NVML sees

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml or _import_pynvml()
        self._lock = threading.Lock()
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise NvmlUnavailable(
                f"NVML cannot be initialised ({exc}): check that the NVIDIA driver is installed "
                "and loaded (`nvidia-smi` must work for this user)"
            ) from exc

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError_NotSupported:
            return None
        except nvml.NVMLError_GpuIsLost as exc:
            raise _GpuLost() from exc
        except nvml.NVMLError_NoPermission:
            return None

    def sample(self) -> GpuSnapshot:
        """Driver versions and every device; a lost device appears with health `lost`."""
        nvml = self._nvml
        with self._lock:
            try:
                driver = self._optional(nvml.nvmlSystemGetDriverVersion)
                cuda = self._optional(nvml.nvmlSystemGetCudaDriverVersion)
                count = nvml.nvmlDeviceGetCount()
                devices = tuple(self._device(i) for i in range(count))
            except (nvml.NVMLError, _GpuLost) as exc:
                raise GpuError(f"NVML failed to sample the GPUs: {exc}") from exc
        return GpuSnapshot(
            backend=self.name,
            driver_version=_text(driver) if driver is not None else None,
            cuda_driver_version=cuda_version_text(cuda) if cuda is not None else None,
            devices=devices,
        )

    def _device(self, index: int) -> GpuDevice:
        nvml = self._nvml
        uuid = name = "unknown"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(self._optional(nvml.nvmlDeviceGetUUID, handle) or "unknown")
            name = _text(self._optional(nvml.nvmlDeviceGetName, handle) or "unknown")
            memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            temp = self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = self._optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            ecc = self._optional(
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            persistence = self._optional(nvml.nvmlDeviceGetPersistenceMode, handle)
            capability = self._optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
            procs = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        except (_GpuLost, nvml.NVMLError_GpuIsLost):
            return _lost_device(index, uuid, name)
        return GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            utilization_ratio=util.gpu / 100.0 if util is not None else None,
            temperature_celsius=float(temp) if temp is not None else None,
            power_watts=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_watts=limit_mw / 1000.0 if limit_mw is not None else None,
            ecc_uncorrected_errors=int(ecc) if ecc is not None else None,
            persistence_mode=(persistence == nvml.NVML_FEATURE_ENABLED)
            if persistence is not None
            else None,
            compute_capability=f"{capability[0]}.{capability[1]}" if capability else None,
            processes=tuple(
                GpuProcess(
                    pid=int(p.pid),
                    used_memory_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None,
                )
                for p in procs
            ),
        )

    def observe_engines(self, engine_load: EngineLoadSource) -> None:
        """Nothing to do: NVML measures what the engines hold on the devices themselves."""

    def close(self) -> None:
        """Shut NVML down; later samples fail."""
        # Already shut down or never fully up: nothing left to release.
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def _lost_device(index: int, uuid: str, name: str) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_bytes=None,
        memory_used_bytes=None,
        utilization_ratio=None,
        temperature_celsius=None,
        power_watts=None,
        power_limit_watts=None,
        ecc_uncorrected_errors=None,
        persistence_mode=None,
        compute_capability=None,
        health="lost",
    )


__all__ = ["GpuError", "NvmlBackend", "NvmlUnavailable", "cuda_version_text"]
