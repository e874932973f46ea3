"""Small builders of the REST objects a `FleetSnapshot` holds, for the doctor's rule tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from doctor.findings import FleetSnapshot, Points
from protocol.autoscale import AutoscalePolicy, AutoscaleStatus
from protocol.rest import DeploymentOut, HostOut, InstanceOut, Placement, VersionOut
from protocol.wire import ExitInfo, GpuStatus, HostFacts, MemoryPlan

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
GIB = 2**30


def points(*values: float) -> Points:
    """One point per 10 s bucket."""
    return [(T0 + timedelta(seconds=10 * i), float(v)) for i, v in enumerate(values)]


def gpu(index: int, **extra: Any) -> GpuStatus:
    """An 80 GiB GPU at 50 °C, 40 % busy unless told otherwise."""
    fields: dict[str, Any] = {
        "index": index, "uuid": f"GPU-{index}", "memory_total_bytes": 80 * GIB,
        "memory_used_bytes": GIB, "utilization_percent": 40.0, "temperature_c": 50.0,
    }  # fmt: skip
    return GpuStatus(**{**fields, **extra})


def host(
    name: str = "gpu-1", gpus: int = 2, facts: HostFacts | None = None, **extra: Any
) -> HostOut:
    """A ready host with GPUS healthy GPUs."""
    fields: dict[str, Any] = {
        "id": 1, "name": name, "state": "ready", "draining": False, "labels": {},
        "registered_at": T0, "last_seen_at": T0, "heartbeat_interval_s": 5.0,
        "port_range": (18000, 18099), "facts": facts or HostFacts(),
        "gpus": [gpu(i) for i in range(gpus)], "desired_generation": 1, "applied_generation": 1,
    }  # fmt: skip
    return HostOut(**{**fields, **extra})


def instance(iid: int, host_name: str = "gpu-1", **extra: Any) -> InstanceOut:
    """A ready instance of deployment `web`."""
    fields: dict[str, Any] = {
        "id": iid, "deployment": "web", "host": host_name, "version": "v1", "port": 18000 + iid,
        "desired_state": "running", "observed_state": "ready", "pid": 100 + iid,
        "restart_count": 0, "last_exit": None, "message": "", "observed_at": T0,
    }  # fmt: skip
    return InstanceOut(**{**fields, **extra})


def deployment(*instances: InstanceOut, **extra: Any) -> DeploymentOut:
    """Deployment `web` of demo:v1 with INSTANCES."""
    fields: dict[str, Any] = {
        "id": 1, "name": "web", "model": "demo", "version": "v1",
        "placement": Placement(hosts=["gpu-1"]), "instances_per_host": 1,
        "engine_config": {}, "created_at": T0, "updated_at": T0, "instances": list(instances),
    }  # fmt: skip
    return DeploymentOut(**{**fields, **extra})


def version(plan: MemoryPlan | None = None, digest: str = "a" * 64) -> VersionOut:
    """demo:v1 with PLAN."""
    return VersionOut(
        model="demo", version="v1", line="base", parent=None, digest=digest, total_bytes=1,
        file_count=1, memory_plan=plan, source_uri="/src", notes="", deprecated=False,
        created_at=T0,
    )  # fmt: skip


def fleet(
    dep: DeploymentOut,
    *hosts: HostOut,
    series: dict[int, dict[str, Points]] | None = None,
    **extra: Any,
) -> FleetSnapshot:
    """A snapshot of DEP on HOSTS (default one 2-GPU host), demo:v1 without a memory plan."""
    snap = FleetSnapshot(
        deployments=[dep], hosts=list(hosts) or [host()], instance_series=series or {},
        versions={"demo:v1": version()},
    )  # fmt: skip
    for key, value in extra.items():
        setattr(snap, key, value)
    return snap


def exited(reason: str, code: int | None = 1) -> ExitInfo:
    """How an engine last ended."""
    return ExitInfo(code=code, reason=reason, at=T0)


def autoscaled(
    *instances: InstanceOut, policy: AutoscalePolicy | None = None, **status: Any
) -> DeploymentOut:
    """Deployment `web` with INSTANCES, autoscaled by POLICY (min 1, max 8 unless told), the
    autoscaler reporting STATUS (as many serving instances wanted and ready as it has)."""
    serving = sum(1 for i in instances if not i.standby and not i.retiring)
    fields: dict[str, Any] = {"replicas": serving, "serving_ready": serving, "placed": serving}
    return deployment(
        *instances,
        autoscale=policy or AutoscalePolicy(min=1, max=8),
        autoscale_status=AutoscaleStatus(**{**fields, **status}),
    )
