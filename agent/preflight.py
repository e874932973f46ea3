"""Preflight: can this host serve? Each check passes, warns or fails with an actionable reason.

A host whose preflight fails reports it in its heartbeat and starts no engine. Checks that need
torch run it in a subprocess: the agent itself never imports torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.gpu import BackendSelection, GpuError, GpuSnapshot
from protocol.plain_text import printable
from protocol.wire import CheckStatus, MemoryPlan, PreflightCheck

GIB = 1024**3
# The probe prints one JSON line; it must not import anything of dctl.
_TORCH_PROBE = (
    "import json, torch\n"
    "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda,"
    " 'devices': torch.cuda.device_count() if torch.cuda.is_available() else 0}))\n"
)


@dataclass(frozen=True)
class TorchInfo:
    """What the torch used by the engine sees; `error` is set when it cannot even be imported."""

    version: str | None = None
    cuda: str | None = None
    devices: int = 0
    error: str | None = None


TorchProbe = Callable[[], TorchInfo]


def probe_torch(python: str = sys.executable, timeout_s: float = 120.0) -> TorchInfo:
    """Import torch in a child interpreter and report its version, CUDA build and device count."""
    try:
        done = subprocess.run(
            [python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return TorchInfo(error=f"could not run {python}: {exc}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchInfo(error=last)
    try:
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return TorchInfo(error=f"unexpected torch probe output: {done.stdout[:200]!r}")
    return TorchInfo(version=data["version"], cuda=data["cuda"], devices=int(data["devices"]))


@dataclass(frozen=True)
class PreflightConfig:
    """What the host is expected to offer."""

    data_dir: Path
    min_driver_version: str = "535.0"
    expected_gpus: int | None = None
    memory_plan: MemoryPlan | None = None
    kv_tokens: int = 4096
    min_free_disk_bytes: int = 1 * GIB
    warn_free_disk_bytes: int = 20 * GIB


# Checks of the torch the dctl engine runs on (the agent's own environment): vLLM, SGLang or a
# command engine bring their own, so a host without a usable torch here may still run them.
DCTL_ENGINE_CHECKS = frozenset({"torch", "cuda_compat"})


@dataclass(frozen=True)
class PreflightReport:
    """All checks, in the order they ran."""

    checks: list[PreflightCheck]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return all(c.status != "fail" for c in self.checks)

    def failures(self, engine_kind: str = "dctl") -> list[PreflightCheck]:
        """The failed checks that keep an ENGINE_KIND instance from starting on this host."""
        return [
            c for c in self.checks
            if c.status == "fail" and (engine_kind == "dctl" or c.name not in DCTL_ENGINE_CHECKS)
        ]  # fmt: skip


def _check(name: str, status: CheckStatus, reason: str) -> PreflightCheck:
    # Reasons quote drivers, torch and exceptions: made printable, as the control plane wants.
    return PreflightCheck(name=name, status=status, reason=printable(reason))


def version_tuple(text: str) -> tuple[int, ...]:
    """`550.54.15` -> (550, 54, 15); non-numeric parts are ignored."""
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def run_preflight(
    selection: BackendSelection, config: PreflightConfig, torch_probe: TorchProbe = probe_torch
) -> PreflightReport:
    """Run every check and return the report; never raises for a host problem."""
    checks: list[PreflightCheck] = []
    sample: GpuSnapshot | None = None
    if selection.backend is None:
        checks.append(_check("nvml", "fail", selection.error or "no GPU backend"))
    else:
        try:
            sample = selection.backend.sample()
        except GpuError as exc:
            checks.append(_check("nvml", "fail", f"{exc}"))
        else:
            if selection.kind == "fake":
                reason = selection.warning or "fake GPU backend selected: engines run on CPU"
                checks.append(_check("nvml", "warn", reason))
            else:
                loaded = f"NVML loaded, driver {sample.driver_version}"
                checks.append(_check("nvml", "pass", loaded))
    torch = torch_probe()
    if sample is not None:
        fake = selection.kind == "fake"
        checks.append(_driver_check(sample, config))
        checks.append(_cuda_check(sample, torch, fake))
        checks.append(_count_check(sample, config))
        checks.append(_memory_check(sample, config))
        checks.append(_ecc_check(sample))
        checks.append(_persistence_check(sample))
    checks.append(_disk_check(config))
    checks.append(_torch_check(torch, sample, selection.kind == "fake"))
    return PreflightReport(checks)


def _driver_check(sample: GpuSnapshot, config: PreflightConfig) -> PreflightCheck:
    driver = sample.driver_version
    if driver is None:
        return _check("driver_version", "warn", "the driver does not report its version")
    if version_tuple(driver) < version_tuple(config.min_driver_version):
        return _check(
            "driver_version",
            "fail",
            f"driver {driver} is older than the required {config.min_driver_version}: "
            "upgrade the NVIDIA driver",
        )
    return _check("driver_version", "pass", f"driver {driver} >= {config.min_driver_version}")


def _cuda_check(sample: GpuSnapshot, torch: TorchInfo, fake: bool) -> PreflightCheck:
    if torch.error:
        return _check("cuda_compat", "fail", "torch cannot be imported (see the torch check)")
    if torch.cuda is None:
        status: CheckStatus = "warn" if fake else "fail"
        return _check(
            "cuda_compat",
            status,
            f"torch {torch.version} is a CPU-only build; install a CUDA build of torch "
            "into the engine's environment to use the GPUs",
        )
    driver_cuda = sample.cuda_driver_version
    if driver_cuda is None:
        return _check("cuda_compat", "warn", "the driver does not report its CUDA version")
    if version_tuple(driver_cuda)[:2] < version_tuple(torch.cuda)[:2]:
        return _check(
            "cuda_compat",
            "fail",
            f"driver supports CUDA {driver_cuda} but torch was built for CUDA {torch.cuda}: "
            f"upgrade the driver or install a torch build for CUDA <= {driver_cuda}",
        )
    return _check("cuda_compat", "pass", f"driver CUDA {driver_cuda} >= torch CUDA {torch.cuda}")


def _count_check(sample: GpuSnapshot, config: PreflightConfig) -> PreflightCheck:
    lost = [d.index for d in sample.devices if d.health == "lost"]
    if lost:
        return _check(
            "gpu_count",
            "fail",
            f"GPU(s) {lost} are lost (fell off the bus): reset them or reboot the host",
        )
    count = len(sample.devices)
    if count == 0:
        reason = "no GPU visible: check the driver and CUDA_VISIBLE_DEVICES"
        return _check("gpu_count", "fail", reason)
    if config.expected_gpus is not None and count != config.expected_gpus:
        return _check(
            "gpu_count",
            "fail",
            f"{count} GPU(s) visible, {config.expected_gpus} expected: check the hardware, "
            "CUDA_VISIBLE_DEVICES or the expected count",
        )
    return _check("gpu_count", "pass", f"{count} GPU(s) visible")


def _memory_check(sample: GpuSnapshot, config: PreflightConfig) -> PreflightCheck:
    if config.memory_plan is None:
        return _check("gpu_memory", "pass", "no memory plan to check against")
    return memory_check(sample, config.memory_plan, config.kv_tokens)


def memory_check(
    sample: GpuSnapshot,
    plan: MemoryPlan,
    kv_tokens: int,
    indices: tuple[int, ...] = (),
    ranks: int | None = None,
) -> PreflightCheck:
    """Does each GPU (INDICES, default all) have free memory for its rank: one of RANKS (default
    one per GPU) shares of the weights and of a KV cache of KV_TOKENS tokens, with the whole
    activation headroom (`MemoryPlan.rank_bytes`)?"""
    devices = [d for d in sample.devices if not indices or d.index in indices]
    free = {d.index: d.memory_free_bytes for d in devices if d.memory_free_bytes is not None}
    if not free:
        return _check("gpu_memory", "warn", "free GPU memory is not reported (N/A)")
    ranks = ranks or len(devices)
    need = plan.rank_bytes(kv_tokens, ranks)
    index = min(free, key=lambda i: free[i])
    what = f"weights + KV for {kv_tokens} tokens"
    if ranks > 1:
        what = f"on each of {ranks} GPUs, a rank's share of the {what}"
    if free[index] < need:
        return _check(
            "gpu_memory",
            "fail",
            f"model needs {need / GIB:.1f} GiB ({what}) but only {free[index] / GIB:.1f} GiB "
            f"is free on GPU {index}: stop other GPU processes or use a host with more memory",
        )
    return _check(
        "gpu_memory",
        "pass",
        f"{free[index] / GIB:.1f} GiB free on GPU {index} >= {need / GIB:.1f} GiB needed ({what})",
    )


def _ecc_check(sample: GpuSnapshot) -> PreflightCheck:
    bad = {d.index: d.ecc_uncorrected_errors for d in sample.devices if d.ecc_uncorrected_errors}
    if bad:
        return _check(
            "ecc",
            "fail",
            f"uncorrectable ECC errors on GPU(s) {bad}: drain the host and have the GPU(s) "
            "checked (a reset clears volatile counts)",
        )
    unknown = [d.index for d in sample.devices if d.ecc_uncorrected_errors is None]
    if unknown:
        return _check("ecc", "pass", f"no uncorrectable ECC errors (N/A on GPU(s) {unknown})")
    return _check("ecc", "pass", "no uncorrectable ECC errors")


def _persistence_check(sample: GpuSnapshot) -> PreflightCheck:
    off = [d.index for d in sample.devices if d.persistence_mode is False]
    if off:
        return _check(
            "persistence_mode",
            "warn",
            f"persistence mode is off on GPU(s) {off}: start nvidia-persistenced or run "
            "`nvidia-smi -pm 1` so engines start faster",
        )
    return _check("persistence_mode", "pass", "persistence mode on (or N/A)")


def _disk_check(config: PreflightConfig) -> PreflightCheck:
    probe = config.data_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    text = f"{free / GIB:.1f} GiB free under {config.data_dir}"
    need = config.min_free_disk_bytes
    if config.memory_plan is not None:
        need = max(need, config.memory_plan.weights_bytes)
    if free < need:
        return _check(
            "disk", "fail", f"{text}, {need / GIB:.1f} GiB needed for snapshots: free some space"
        )
    if free < config.warn_free_disk_bytes:
        return _check("disk", "warn", f"{text}: room for few snapshots")
    return _check("disk", "pass", text)


def _torch_check(torch: TorchInfo, sample: GpuSnapshot | None, fake: bool) -> PreflightCheck:
    if torch.error:
        return _check(
            "torch",
            "fail",
            f"torch cannot be imported ({torch.error}): install dctl with the `engine` extra",
        )
    visible = len(sample.devices) if sample is not None else 0
    if fake:
        return _check(
            "torch", "pass", f"torch {torch.version} imports; fake GPUs, engines run on CPU"
        )
    if torch.devices != visible:
        return _check(
            "torch",
            "fail",
            f"torch {torch.version} sees {torch.devices} CUDA device(s) but NVML sees {visible}: "
            "check CUDA_VISIBLE_DEVICES and the torch CUDA build",
        )
    return _check("torch", "pass", f"torch {torch.version} sees {torch.devices} device(s)")
