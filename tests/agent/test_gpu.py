"""GPU backends: NVML through patched pynvml functions, the fake backend, and `auto` selection."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.gpu import (
    EngineLoad,
    FakeBackend,
    GpuError,
    NvmlBackend,
    NvmlUnavailable,
    na,
    parse_spec,
    select_backend,
)

GIB = 1024**3


def _raise(code: int) -> Any:
    def fn(*args: Any) -> Any:
        raise pynvml.NVMLError(code)

    return fn


@pytest.fixture()
def nvml(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Two H100s as NVML would describe them; tests override single functions."""
    handles = {0: "h0", 1: "h1"}
    calls: dict[str, Any] = {"init": 0, "shutdown": 0}

    def init() -> None:
        calls["init"] += 1

    def shutdown() -> None:
        calls["shutdown"] += 1

    patches: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlSystemGetDriverVersion": lambda: "550.54.15",
        "nvmlSystemGetCudaDriverVersion": lambda: 12040,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: handles[i],
        "nvmlDeviceGetUUID": lambda h: f"GPU-uuid-{h}",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 * GIB, used=2 * GIB),
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=37, memory=10),
        "nvmlDeviceGetTemperature": lambda h, sensor: 41,
        "nvmlDeviceGetPowerUsage": lambda h: 123456,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700000,
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: 0,
        "nvmlDeviceGetPersistenceMode": lambda h: pynvml.NVML_FEATURE_ENABLED,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [
            SimpleNamespace(pid=4242, usedGpuMemory=GIB)
        ],
    }
    for name, fn in patches.items():
        monkeypatch.setattr(pynvml, name, fn)
    calls["patch"] = lambda name, fn: monkeypatch.setattr(pynvml, name, fn)
    return calls


def test_nvml_backend_reports_devices_in_base_units(nvml: dict[str, Any]) -> None:
    backend = NvmlBackend()
    sample = backend.sample()
    assert sample.driver_version == "550.54.15"
    assert sample.cuda_driver_version == "12.4"
    first = sample.devices[0]
    assert first.uuid == "GPU-uuid-h0"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_free_bytes == 78 * GIB
    assert first.utilization_ratio == pytest.approx(0.37)
    assert first.power_watts == pytest.approx(123.456)
    assert first.power_limit_watts == pytest.approx(700.0)
    assert first.persistence_mode is True
    assert first.compute_capability == "9.0"
    assert first.processes[0].pid == 4242
    backend.close()
    assert nvml["shutdown"] == 1


def test_not_supported_fields_are_na_not_errors(nvml: dict[str, Any]) -> None:
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage",
                 "nvmlDeviceGetPersistenceMode", "nvmlSystemGetCudaDriverVersion"):  # fmt: skip
        nvml["patch"](name, _raise(pynvml.NVML_ERROR_NOT_SUPPORTED))
    sample = NvmlBackend().sample()
    device = sample.devices[1]
    assert device.ecc_uncorrected_errors is None
    assert device.power_watts is None
    assert device.persistence_mode is None
    assert sample.cuda_driver_version is None
    assert na(device.power_watts) == "N/A"
    assert device.memory_total_bytes == 80 * GIB  # the rest is still reported


def test_a_lost_gpu_is_reported_lost_and_the_others_still_sampled(nvml: dict[str, Any]) -> None:
    def memory(handle: str) -> Any:
        if handle == "h1":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(total=80 * GIB, used=0)

    nvml["patch"]("nvmlDeviceGetMemoryInfo", memory)
    sample = NvmlBackend().sample()
    assert [d.health for d in sample.devices] == ["ok", "lost"]
    assert sample.devices[1].uuid == "GPU-uuid-h1"
    assert sample.devices[1].memory_total_bytes is None


def test_nvml_that_cannot_load_raises_unavailable_with_a_hint(nvml: dict[str, Any]) -> None:
    nvml["patch"]("nvmlInit", _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NvmlUnavailable, match="driver is installed"):
        NvmlBackend()


def test_listing_devices_failing_is_a_gpu_error(nvml: dict[str, Any]) -> None:
    nvml["patch"]("nvmlDeviceGetCount", _raise(pynvml.NVML_ERROR_UNKNOWN))
    with pytest.raises(GpuError, match="NVML failed"):
        NvmlBackend().sample()


def test_fake_spec_parsing_and_errors() -> None:
    assert [m.name for m in parse_spec("1xA100,2xl4")] == [
        "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA L4"]  # fmt: skip
    with pytest.raises(ValueError, match="unknown model 'B200'"):
        parse_spec("2xB200")
    with pytest.raises(ValueError, match="COUNTxMODEL"):
        parse_spec("two H200")


def test_nvml_measures_the_devices_and_ignores_reported_engines(nvml: dict[str, Any]) -> None:
    backend = NvmlBackend()
    before = backend.sample()
    backend.observe_engines(lambda: [EngineLoad(pid=1, device_indices=(0,), memory_bytes=GIB,
                                                busy_ratio=1.0)])  # fmt: skip
    assert backend.sample() == before
    assert backend.engine_device == "auto" and FakeBackend().engine_device == "cpu"


def test_fake_memory_and_utilisation_follow_the_engines() -> None:
    loads: list[EngineLoad] = []
    fake = FakeBackend("2xH200")
    fake.observe_engines(lambda: loads)
    idle = fake.sample().devices
    assert all(d.utilization_ratio == 0 for d in idle)
    loads.append(EngineLoad(pid=10, device_indices=(0, 1), memory_bytes=20 * GIB, busy_ratio=0.5))
    busy = fake.sample().devices
    for before, after in zip(idle, busy, strict=True):
        assert after.memory_used_bytes - before.memory_used_bytes == 10 * GIB
        assert after.utilization_ratio == 0.5
        assert after.processes[0].pid == 10
        assert after.power_watts > before.power_watts


def test_fake_faults() -> None:
    fake = FakeBackend("2xH100")
    fake.lose_gpu(1)
    fake.set_ecc_errors(0, 3)
    sample = fake.sample()
    assert sample.devices[1].health == "lost"
    assert sample.devices[0].ecc_uncorrected_errors == 3
    fake.unload_nvml()
    with pytest.raises(NvmlUnavailable):
        fake.sample()


def _pci(root: Path, vendors: dict[str, str]) -> Path:
    for address, vendor in vendors.items():
        (root / address).mkdir(parents=True)
        (root / address / "vendor").write_text(vendor + "\n")
    return root


def _no_nvml() -> Any:
    raise NvmlUnavailable("libnvidia-ml.so not found")


def test_auto_falls_back_to_fake_only_without_nvidia_hardware(tmp_path: Path) -> None:
    pci = _pci(tmp_path / "pci", {"0000:00:01.0": "0x8086"})
    chosen = select_backend("auto", "1xL4", pci_root=pci, open_nvml=_no_nvml)
    assert chosen.kind == "fake"
    assert chosen.backend is not None
    assert "FAKE" in (chosen.warning or "")


def test_auto_with_nvidia_hardware_and_broken_nvml_is_an_error(tmp_path: Path) -> None:
    pci = _pci(tmp_path / "pci", {"0000:00:01.0": "0x8086", "0000:3b:00.0": "0x10de"})
    chosen = select_backend("auto", pci_root=pci, open_nvml=_no_nvml)
    assert chosen.backend is None
    assert chosen.kind == "nvml"
    assert "0000:3b:00.0" in (chosen.error or "")


def test_auto_prefers_nvml_when_it_loads(tmp_path: Path, nvml: dict[str, Any]) -> None:
    chosen = select_backend("auto", pci_root=tmp_path)
    assert chosen.kind == "nvml"
    assert isinstance(chosen.backend, NvmlBackend)


def test_explicit_nvml_never_falls_back(tmp_path: Path) -> None:
    chosen = select_backend("nvml", pci_root=tmp_path, open_nvml=_no_nvml)
    assert chosen.backend is None
    assert "libnvidia-ml" in (chosen.error or "")


def test_faults_written_as_text() -> None:
    fake = FakeBackend("2xL4")
    fake.inject("lost:1, ecc:0=4")
    devices = fake.sample().devices
    assert devices[1].health == "lost" and devices[0].ecc_uncorrected_errors == 4
    fake.inject("no-nvml")
    with pytest.raises(NvmlUnavailable):
        fake.sample()
    with pytest.raises(ValueError, match="lost:INDEX"):
        fake.inject("lost:one")
