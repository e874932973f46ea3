"""Table columns that more than one command prints, defined once."""

from __future__ import annotations

from cli.output import Column

INSTANCE_COLUMNS: list[Column] = [
    ("id", "id"),
    ("deployment", "deployment"),
    ("host", "host"),
    ("version", "version"),
    ("port", "port"),
    # No indices: the instance sees every GPU of its host.
    ("gpus", lambda i: ",".join(map(str, i.get("gpu_indices") or [])) or "all"),
    ("desired", "desired_state"),
    ("observed", "observed_state"),
    ("restarts", "restart_count"),
    ("message", "message"),
]
# Under one deployment (`dctl deploy show`) its name would only repeat on every row.
DEPLOYMENT_INSTANCE_COLUMNS: list[Column] = [c for c in INSTANCE_COLUMNS if c[0] != "deployment"]
