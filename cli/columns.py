"""Table columns that more than one command prints, defined once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cli.output import Column


def instance_role(instance: Mapping[str, Any]) -> str:
    """An instance's part in serving: `serving`, `standby` (loaded, out of the gateway's pools,
    for the autoscaler to promote) or `retiring` (out of the pools, finishing its requests)."""
    if instance.get("retiring"):
        return "retiring"
    return "standby" if instance.get("standby") else "serving"


def instance_load(instance: Mapping[str, Any]) -> str | None:
    """`running/waiting` requests as the instance's engine last said; None when it never did."""
    running, waiting = instance.get("requests_running"), instance.get("requests_waiting")
    if running is None and waiting is None:
        return None
    return f"{'-' if running is None else running}/{'-' if waiting is None else waiting}"


INSTANCE_COLUMNS: list[Column] = [
    ("id", "id"),
    ("deployment", "deployment"),
    ("host", "host"),
    ("version", "version"),
    ("port", "port"),
    # No indices: the instance sees every GPU of its host.
    ("gpus", lambda i: ",".join(map(str, i.get("gpu_indices") or [])) or "all"),
    ("role", instance_role),
    ("desired", "desired_state"),
    ("observed", "observed_state"),
    ("run/wait", instance_load),
    ("restarts", "restart_count"),
    ("message", "message"),
]
# Under one deployment (`dctl deploy show`) its name would only repeat on every row.
DEPLOYMENT_INSTANCE_COLUMNS: list[Column] = [c for c in INSTANCE_COLUMNS if c[0] != "deployment"]
