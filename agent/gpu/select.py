"""Choosing the GPU backend: `nvml`, `fake`, or `auto` (NVML unless the host has no NVIDIA GPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.gpu.fake import FakeBackend
from agent.gpu.nvml import NvmlBackend
from agent.gpu.types import GpuBackend, NvmlUnavailable

BackendChoice = Literal["auto", "nvml", "fake"]
NVIDIA_VENDOR = "0x10de"
PCI_DEVICES = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class BackendSelection:
    """The backend in use, or why none could be used (then preflight fails and no engine starts)."""

    kind: Literal["nvml", "fake"]
    backend: GpuBackend | None
    warning: str | None = None
    error: str | None = None


def nvidia_pci_devices(root: Path = PCI_DEVICES) -> list[str]:
    """PCI addresses whose vendor is NVIDIA (0x10de)."""
    found = []
    for vendor in sorted(root.glob("*/vendor")):
        try:
            if vendor.read_text().strip().lower() == NVIDIA_VENDOR:
                found.append(vendor.parent.name)
        except OSError:
            continue  # a device that vanished mid-scan is not ours to report
    return found


def select_backend(
    choice: BackendChoice,
    fake_spec: str = "2xH200",
    pci_root: Path = PCI_DEVICES,
    open_nvml: Callable[[], GpuBackend] = NvmlBackend,
) -> BackendSelection:
    """Apply the selection rules; never raises for a missing NVML, reports it instead.

    The caller shows `warning` loudly: a host on the fake backend serves on CPU.
    """
    if choice == "fake":
        return BackendSelection("fake", FakeBackend(fake_spec))
    try:
        return BackendSelection("nvml", open_nvml())
    except NvmlUnavailable as exc:
        reason = str(exc)
    if choice == "nvml":
        return BackendSelection("nvml", None, error=reason)
    nvidia = nvidia_pci_devices(pci_root)
    if nvidia:
        # Hardware is there but the driver is not usable: serving from a fake would hide it.
        return BackendSelection(
            "nvml",
            None,
            error=f"NVIDIA device(s) {', '.join(nvidia)} present but {reason}",
        )
    warning = (
        f"no NVIDIA GPU on this host and NVML cannot load ({reason}); "
        f"using the FAKE GPU backend ({fake_spec}) - this host serves on CPU"
    )
    return BackendSelection("fake", FakeBackend(fake_spec), warning=warning)
