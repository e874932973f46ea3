"""What the agent knows about a host's GPUs, independent of where it came from (NVML or fake)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

DeviceHealth = Literal["ok", "lost"]


class GpuError(Exception):
    """A GPU backend could not answer; the message says what to check on the host."""


class NvmlUnavailable(GpuError):
    """NVML (libnvidia-ml) cannot be loaded or initialised: no driver, or a broken install."""


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on one GPU."""

    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as sampled now. `None` means the driver reports the field as not supported (N/A)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_ratio: float | None
    temperature_celsius: float | None
    power_watts: float | None
    power_limit_watts: float | None
    ecc_uncorrected_errors: int | None
    persistence_mode: bool | None
    compute_capability: str | None
    health: DeviceHealth = "ok"
    processes: tuple[GpuProcess, ...] = field(default=())

    @property
    def memory_free_bytes(self) -> int | None:
        """Free memory, or None when either figure is not reported."""
        if self.memory_total_bytes is None or self.memory_used_bytes is None:
            return None
        return max(self.memory_total_bytes - self.memory_used_bytes, 0)


@dataclass(frozen=True)
class EngineLoad:
    """What one engine process holds on its devices, as the agent sees it."""

    pid: int
    device_indices: tuple[int, ...]
    memory_bytes: int
    busy_ratio: float


EngineLoadSource = Callable[[], Sequence[EngineLoad]]


@dataclass(frozen=True)
class GpuSnapshot:
    """Driver facts plus every device, taken in one pass."""

    backend: str
    driver_version: str | None
    cuda_driver_version: str | None
    devices: tuple[GpuDevice, ...]


class GpuBackend(Protocol):
    """Where GPU facts come from. Implementations: `NvmlBackend`, `FakeBackend`."""

    name: str
    # The `resources.device` engines on this host get unless their deployment sets one:
    # "auto" where torch finds the GPUs, "cpu" where the GPUs are scripted.
    engine_device: str

    def sample(self) -> GpuSnapshot:
        """Driver versions and every device with its current figures and processes."""
        ...

    def observe_engines(self, engine_load: EngineLoadSource) -> None:
        """Tell the backend how to learn what the agent's engines hold at each sample.

        NVML measures the devices themselves and ignores it; the fake backend has nothing else
        to go on, so its memory and utilisation follow what `engine_load` reports.
        """
        ...

    def close(self) -> None:
        """Release the library handle."""
        ...


def na(value: object) -> str:
    """How a not-supported (None) field is shown to a person."""
    return "N/A" if value is None else str(value)
