"""Preflight: each check passes, warns or fails with an actionable reason; torch in a subprocess."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.gpu import BackendSelection, FakeBackend, GpuDevice, GpuSnapshot
from agent.preflight import PreflightConfig, TorchInfo, memory_check, probe_torch, run_preflight
from protocol.wire import MemoryPlan

GIB = 1024**3
CUDA_TORCH = TorchInfo(version="2.13.0+cu124", cuda="12.4", devices=2)


def _statuses(report: object) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}  # type: ignore[attr-defined]


def _nvml_like(fake: FakeBackend) -> BackendSelection:
    # A fake presented as NVML exercises the strict (real-host) rules.
    return BackendSelection("nvml", fake)


def test_healthy_gpu_host_passes(tmp_path: Path) -> None:
    report = run_preflight(
        _nvml_like(FakeBackend("2xH100")),
        PreflightConfig(data_dir=tmp_path, expected_gpus=2, warn_free_disk_bytes=0),
        torch_probe=lambda: CUDA_TORCH,
    )
    assert report.ok, report.failures()
    assert set(_statuses(report).values()) == {"pass"}


@pytest.mark.parametrize(
    ("setup", "check", "needle"),
    [
        (lambda f: f.set_ecc_errors(1, 2), "ecc", "uncorrectable ECC errors on GPU(s) {1: 2}"),
        (lambda f: f.lose_gpu(0), "gpu_count", "lost"),
        (lambda f: f.unload_nvml(), "nvml", "not loaded"),
    ],
)
def test_faults_fail_preflight(tmp_path: Path, setup: object, check: str, needle: str) -> None:
    fake = FakeBackend("2xH100")
    setup(fake)  # type: ignore[operator]
    report = run_preflight(
        _nvml_like(fake), PreflightConfig(data_dir=tmp_path), torch_probe=lambda: CUDA_TORCH
    )
    assert not report.ok
    failed = {c.name: c.reason for c in report.failures()}
    assert needle in failed[check]


def test_old_driver_and_newer_torch_cuda_fail_with_the_fix(tmp_path: Path) -> None:
    fake = FakeBackend("1xH100")
    fake.driver_version = "470.1"
    fake.cuda_driver_version = "11.4"
    report = run_preflight(
        _nvml_like(fake),
        PreflightConfig(data_dir=tmp_path, expected_gpus=2),
        torch_probe=lambda: TorchInfo(version="2.13", cuda="12.4", devices=1),
    )
    failed = {c.name: c.reason for c in report.failures()}
    assert "upgrade the NVIDIA driver" in failed["driver_version"]
    assert "CUDA 11.4" in failed["cuda_compat"] and "12.4" in failed["cuda_compat"]
    assert "1 GPU(s) visible, 2 expected" in failed["gpu_count"]


def test_memory_plan_larger_than_free_memory_fails(tmp_path: Path) -> None:
    plan = MemoryPlan(weights_bytes=200 * GIB, kv_bytes_per_token=1024)
    report = run_preflight(
        _nvml_like(FakeBackend("2xH100")),
        PreflightConfig(data_dir=tmp_path, memory_plan=plan, min_free_disk_bytes=0),
        torch_probe=lambda: CUDA_TORCH,
    )
    failed = {c.name: c.reason for c in report.failures()}
    assert "needs 100.0 GiB (on each of 2 GPUs, a rank's share" in failed["gpu_memory"]
    assert "79.1 GiB is free on GPU 0" in failed["gpu_memory"]


def test_each_gpu_must_hold_its_rank_whatever_the_others_have_free() -> None:
    def device(index: int, free_gib: int) -> GpuDevice:
        return GpuDevice(
            index=index, uuid=f"GPU-{index}", name="H100", memory_total_bytes=80 * GIB,
            memory_used_bytes=(80 - free_gib) * GIB, utilization_ratio=None,
            temperature_celsius=None, power_watts=None, power_limit_watts=None,
            ecc_uncorrected_errors=None, persistence_mode=None, compute_capability="9.0",
        )  # fmt: skip

    sample = GpuSnapshot("nvml", "550.1", "12.4", (device(0, 70), device(1, 10), device(2, 80)))
    plan = MemoryPlan(weights_bytes=40 * GIB, kv_bytes_per_token=0)
    # 80 GiB free in all on GPUs 0 and 1 would hold the 40 GiB, but GPU 1's rank needs 20.
    check = memory_check(sample, plan, 4096, indices=(0, 1))
    assert check.status == "fail" and "only 10.0 GiB is free on GPU 1" in check.reason
    assert memory_check(sample, plan, 4096, indices=(0, 2)).status == "pass"
    # One rank (parallel.size 1) holds it all: each GPU it may run on has room for it.
    assert memory_check(sample, plan, 4096, indices=(0, 2), ranks=1).status == "pass"
    assert memory_check(sample, plan, 4096, indices=(1,)).status == "fail"


def test_missing_backend_and_broken_torch_fail(tmp_path: Path) -> None:
    report = run_preflight(
        BackendSelection("nvml", None, error="NVIDIA device(s) 0000:3b:00.0 present but ..."),
        PreflightConfig(data_dir=tmp_path),
        torch_probe=lambda: TorchInfo(error="ModuleNotFoundError: No module named 'torch'"),
    )
    failed = {c.name: c.reason for c in report.failures()}
    assert "0000:3b:00.0" in failed["nvml"]
    assert "`engine` extra" in failed["torch"]


def test_fake_backend_with_cpu_torch_only_warns(tmp_path: Path) -> None:
    report = run_preflight(
        BackendSelection("fake", FakeBackend("2xH200"), warning="FAKE backend"),
        PreflightConfig(data_dir=tmp_path, warn_free_disk_bytes=0),
        torch_probe=lambda: TorchInfo(version="2.13.0+cpu", cuda=None, devices=0),
    )
    assert report.ok
    assert _statuses(report)["nvml"] == "warn"
    assert _statuses(report)["cuda_compat"] == "warn"


def test_real_torch_probe_runs_in_a_subprocess() -> None:
    info = probe_torch()
    assert info.error is None
    assert info.version and info.version.startswith("2.")
    broken = probe_torch(python=sys.executable + "-does-not-exist")
    assert broken.error is not None
