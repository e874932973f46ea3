"""GPU access for the agent: one small protocol, an NVML implementation and a scripted fake."""

from agent.gpu.fake import FakeBackend, parse_spec
from agent.gpu.nvml import NvmlBackend
from agent.gpu.select import BackendSelection, nvidia_pci_devices, select_backend
from agent.gpu.types import (
    EngineLoad,
    EngineLoadSource,
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuSnapshot,
    NvmlUnavailable,
    na,
)

__all__ = [
    "BackendSelection",
    "EngineLoad",
    "EngineLoadSource",
    "FakeBackend",
    "GpuBackend",
    "GpuDevice",
    "GpuError",
    "GpuProcess",
    "GpuSnapshot",
    "NvmlBackend",
    "NvmlUnavailable",
    "na",
    "nvidia_pci_devices",
    "parse_spec",
    "select_backend",
]
