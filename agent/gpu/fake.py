"""`FakeBackend`: scripted GPUs for hosts without NVIDIA hardware (laptops, CI, the demo).

Devices come from a spec such as `2xH200` or `1xA100,1xL4`. Their memory and utilisation follow
the engines the agent runs (`observe_engines` hands it what each engine holds), so a demo shows the
same movement a real host would. Faults can be injected to exercise the agent's failure paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.gpu.types import (
    EngineLoad,
    EngineLoadSource,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuSnapshot,
    NvmlUnavailable,
)

MIB = 1024 * 1024


@dataclass(frozen=True)
class FakeModel:
    """The fixed facts of one GPU model."""

    name: str
    memory_bytes: int
    compute_capability: str
    power_limit_watts: float


CATALOG: dict[str, FakeModel] = {
    "H200": FakeModel("NVIDIA H200", 143771 * MIB, "9.0", 700.0),
    "H100": FakeModel("NVIDIA H100 80GB HBM3", 81559 * MIB, "9.0", 700.0),
    "A100": FakeModel("NVIDIA A100-SXM4-80GB", 81920 * MIB, "8.0", 400.0),
    "L4": FakeModel("NVIDIA L4", 23034 * MIB, "8.9", 72.0),
    "RTX4090": FakeModel("NVIDIA GeForce RTX 4090", 24564 * MIB, "8.9", 450.0),
}
_IDLE_MEMORY = 512 * MIB
_IDLE_POWER = 60.0
_SPEC_PART = re.compile(r"^(\d+)x([A-Za-z0-9]+)$")


def parse_spec(spec: str) -> list[FakeModel]:
    """`2xH200` or `1xA100,1xL4` -> one model per device. Raises ValueError naming the bad part."""
    models: list[FakeModel] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        match = _SPEC_PART.match(part)
        if not match:
            raise ValueError(f"fake GPU spec {part!r}: write COUNTxMODEL, e.g. 2xH200")
        key = match.group(2).upper()
        if key not in CATALOG:
            known = ", ".join(sorted(CATALOG))
            raise ValueError(f"fake GPU spec {part!r}: unknown model {key!r} (known: {known})")
        models.extend([CATALOG[key]] * int(match.group(1)))
    if not models:
        raise ValueError("fake GPU spec is empty: write COUNTxMODEL, e.g. 2xH200")
    return models


class FakeBackend:
    """Scripted GPUs whose figures follow the engines the agent runs; faults can be injected."""

    name = "fake"
    engine_device = "cpu"  # no real GPU behind these: engines serve on the CPU
    driver_version = "550.54.15"
    cuda_driver_version = "12.4"

    def __init__(self, spec: str = "2xH200") -> None:
        self._models = parse_spec(spec)
        self._engine_load: EngineLoadSource = lambda: ()  # idle until `observe_engines`
        self._lost: set[int] = set()
        self._ecc: dict[int, int] = {}
        self._hot: dict[int, float] = {}
        self._nvml_loaded = True

    def observe_engines(self, engine_load: EngineLoadSource) -> None:
        """Make memory and utilisation follow what `engine_load` reports at each sample."""
        self._engine_load = engine_load

    def lose_gpu(self, index: int) -> None:
        """Fault: the device falls off the bus (NVML would raise GpuIsLost)."""
        self._lost.add(index)

    def set_ecc_errors(self, index: int, uncorrected: int) -> None:
        """Fault: the device reports uncorrectable ECC errors."""
        self._ecc[index] = uncorrected

    def set_temperature(self, index: int, celsius: float) -> None:
        """Fault: the device runs at CELSIUS whatever its load (a failing fan, blocked airflow)."""
        self._hot[index] = celsius

    def unload_nvml(self) -> None:
        """Fault: the driver library goes away; every sample fails as NVML would."""
        self._nvml_loaded = False

    def inject(self, faults: str) -> None:
        """Apply faults written as text: `lost:1,ecc:0=3,hot:1=92,no-nvml` (`--fake-faults`)."""
        for fault in (f.strip() for f in faults.split(",") if f.strip()):
            kind, _, arg = fault.partition(":")
            try:
                if kind == "lost":
                    self.lose_gpu(int(arg))
                elif kind == "ecc":
                    index, _, count = arg.partition("=")
                    self.set_ecc_errors(int(index), int(count or 1))
                elif kind == "hot":
                    index, _, celsius = arg.partition("=")
                    self.set_temperature(int(index), float(celsius or 95))
                elif kind == "no-nvml" and not arg:
                    self.unload_nvml()
                else:
                    raise ValueError(kind)
            except ValueError:
                raise ValueError(
                    f"fake fault {fault!r}: write lost:INDEX, ecc:INDEX=COUNT, hot:INDEX=CELSIUS "
                    "or no-nvml"
                ) from None

    def sample(self) -> GpuSnapshot:
        """Current figures: idle baseline plus whatever the engines hold on each device."""
        if not self._nvml_loaded:
            raise NvmlUnavailable("fake NVML is not loaded (injected fault)")
        loads = list(self._engine_load())
        devices = tuple(self._device(i, model, loads) for i, model in enumerate(self._models))
        return GpuSnapshot(
            backend=self.name,
            driver_version=self.driver_version,
            cuda_driver_version=self.cuda_driver_version,
            devices=devices,
        )

    def _device(self, index: int, model: FakeModel, loads: list[EngineLoad]) -> GpuDevice:
        uuid = f"GPU-fake-{index:04d}-{model.name.split()[-1].lower()}"
        if index in self._lost:
            return GpuDevice(
                index=index, uuid=uuid, name=model.name, memory_total_bytes=None,
                memory_used_bytes=None, utilization_ratio=None, temperature_celsius=None,
                power_watts=None, power_limit_watts=None, ecc_uncorrected_errors=None,
                persistence_mode=None, compute_capability=None, health="lost",
            )  # fmt: skip
        mine = [load for load in loads if index in load.device_indices]
        # An engine spread over k devices holds 1/k of its memory on each.
        held = sum(load.memory_bytes // max(len(load.device_indices), 1) for load in mine)
        used = min(_IDLE_MEMORY + held, model.memory_bytes)
        util = min(sum(load.busy_ratio for load in mine), 1.0)
        return GpuDevice(
            index=index,
            uuid=uuid,
            name=model.name,
            memory_total_bytes=model.memory_bytes,
            memory_used_bytes=used,
            utilization_ratio=util,
            temperature_celsius=self._hot.get(index, round(30.0 + 45.0 * util, 1)),
            power_watts=round(_IDLE_POWER + util * (model.power_limit_watts - _IDLE_POWER), 1),
            power_limit_watts=model.power_limit_watts,
            ecc_uncorrected_errors=self._ecc.get(index, 0),
            persistence_mode=True,
            compute_capability=model.compute_capability,
            processes=tuple(
                GpuProcess(load.pid, load.memory_bytes // max(len(load.device_indices), 1))
                for load in mine
            ),
        )

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["CATALOG", "EngineLoad", "FakeBackend", "GpuError", "parse_spec"]
