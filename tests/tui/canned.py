"""Canned control-plane answers for the TUI's snapshot tests: fixed protocol objects behind an
`httpx.MockTransport`, and a frozen clock, so every SVG comes out the same on every run."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from client import AsyncControlPlaneClient
from protocol.rollout_states import RolloutPhase, RolloutState

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
GIB = 2**30


def at(seconds_ago: float) -> str:
    """NOW minus SECONDS_AGO, as the API writes times."""
    return (NOW - timedelta(seconds=seconds_ago)).isoformat()


def digest(n: int) -> str:
    return f"{n:064x}"


def gpu(index: int, util: float, used_gib: float, power: float | None) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": 80 * GIB,
        "memory_used_bytes": int(used_gib * GIB),
        "utilization_percent": util,
        "temperature_c": 61.0 + index,
        "power_w": power,
        "power_limit_w": 700.0 if power is not None else None,
        "ecc_uncorrectable": 0,
    }


def host(name: str, state: str, seen_ago: float, gpus: list[dict[str, Any]], **facts: Any) -> dict:
    return {
        "id": int(name[-1]),
        "name": name,
        "state": state,
        "draining": False,
        "labels": {"zone": "a"},
        "advertise_address": f"10.0.0.{name[-1]}",
        "registered_at": at(86400),
        "last_seen_at": at(seen_ago),
        "heartbeat_interval_s": 5.0,
        "port_range": [9000, 9100],
        "facts": {
            "hostname": name,
            "agent_version": "0.9.0",
            "driver_version": "550.54",
            "cuda_driver_version": "12.4",
            "cpu_count": 64,
            "memory_bytes": 512 * GIB,
            "disk_free_bytes": 900 * GIB,
            "preflight": [{"name": "nvidia-smi", "status": "pass", "reason": ""}],
            "snapshots": [digest(1), digest(2)],
            **facts,
        },
        "gpus": gpus,
        "desired_generation": 3,
        "applied_generation": 3,
    }


def instance(
    id_: int, host_name: str, version: str, state: str, restarts: int = 0, **extra: Any
) -> dict:
    return {
        "deployment": "web",
        **extra,
        "id": id_,
        "host": host_name,
        "version": version,
        "port": 9000 + id_,
        "gpu_indices": [],
        "desired_state": "running",
        "observed_state": state,
        "pid": 4000 + id_,
        "restart_count": restarts,
        "last_exit": None,
        "message": "",
        "observed_at": at(3),
    }


HOSTS = [
    host("gpu-1", "ready", 2, [gpu(0, 87.0, 61.5, 512.0), gpu(1, 35.0, 20.0, 300.0)]),
    host("gpu-2", "ready", 4, [gpu(0, 55.0, 78.0, None), gpu(1, 12.0, 8.0, None)]),
    host(
        "gpu-3",
        "not_ready",
        7200,
        [],
        preflight=[{"name": "disk", "status": "fail", "reason": "2 GiB free"}],
    ),
]
INSTANCES = [instance(1, "gpu-1", "v1", "ready"), instance(2, "gpu-2", "v2", "ready", 1)]
DEPLOYMENT = {
    "id": 1,
    "name": "web",
    "model": "demo",
    "version": "v1",
    "placement": {"hosts": ["gpu-1", "gpu-2"], "labels": {}},
    "instances_per_host": 1,
    "engine_config": {},
    "created_at": at(7200),
    "updated_at": at(600),
    "instances": INSTANCES,
    "canary_version": "v2",
    "canary_weight": 10,
}
# `chat` is autoscaled (min 1, max 4, one standby): two serving, one standby, one retiring.
CHAT_INSTANCES = [
    instance(3, "gpu-1", "v3", "ready", deployment="chat", requests_running=6, requests_waiting=1),
    instance(4, "gpu-2", "v3", "ready", deployment="chat", requests_running=5, requests_waiting=0),
    instance(5, "gpu-2", "v3", "ready", deployment="chat", standby=True),
    instance(6, "gpu-1", "v3", "ready", deployment="chat", retiring=True, requests_running=1),
]
CHAT = {
    **DEPLOYMENT,
    "id": 2,
    "name": "chat",
    "version": "v3",
    "instances": CHAT_INSTANCES,
    "canary_version": None,
    "canary_weight": 0,
    "autoscale": {"min": 1, "max": 4, "standby": 1},
    "autoscale_status": {
        "replicas": 2,
        "standby": 1,
        "serving_ready": 2,
        "standby_ready": 1,
        "placed": 3,
        "queue_per_instance": 0.5,
        "utilization": 0.34,
        "last_decision": {
            "time": at(240),
            "action": "down",
            "from_replicas": 3,
            "to_replicas": 2,
            "reason": "34% busy, under 80% for 10m",
        },
    },
}
METRICS = [
    ("error rate", "ratio", 0.001, 0.002, "<= stable + 0.01", "pass"),
    ("p95 latency", "seconds", 0.41, 0.47, "<= 1.25x stable", "pass"),
    ("tokens per forward", "number", 2.1, None, ">= 0.9x stable", "inconclusive"),
    ("canary restarts", "count", 0.0, 1.0, "<= 0", "fail"),
]
ANALYSIS = {
    "time": at(30),
    "step": 1,
    "weight": 10,
    "since": at(330),
    "verdict": "inconclusive",
    "stable_requests": 900,
    "canary_requests": 100,
    "metrics": [
        {"metric": m, "unit": u, "stable": s, "canary": c, "limit": lim, "verdict": v}
        for m, u, s, c, lim, v in METRICS
    ],
}


def rollout(id_: int, state: str, ago: float, reason: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": id_,
        "deployment": "web",
        "kind": "rollout",
        "state": state,
        "step": 1,
        "steps": [10, 50, 100],
        "weight": 10,
        "served": 0.095,
        "from": "demo:v1",
        "to": "demo:v2",
        "engine_config_changed": False,
        "phase": RolloutPhase.ANALYSING,
        "canary_instances": 1,
        "canary_ready": 1,
        "stable_ready": 1,
        "step_started_at": at(330),
        "time_left_s": 252.0,
        "policy": {},
        "analysis": None,
        "reason": reason,
        "actor": "admin",
        "created_at": at(ago),
        "updated_at": at(ago - 10),
        **extra,
    }


ROLLOUT = rollout(2, RolloutState.PROGRESSING, 400, "", analysis=ANALYSIS)
HISTORY = [ROLLOUT, rollout(1, RolloutState.ABORTED, 5000, "p95 latency 1.9x stable (limit 1.25x)")]


def version(tag: str, line: str, parent: str | None, n: int) -> dict[str, Any]:
    return {
        "model": "demo",
        "version": tag,
        "line": line,
        "parent": parent,
        "digest": digest(n),
        "total_bytes": 16 * GIB + n,
        "file_count": 2,
        "memory_plan": {"weights_bytes": 16 * GIB, "kv_bytes_per_token": 98304},
        "source_uri": f"/models/demo/{tag}",
        "notes": "",
        "deprecated": False,
        "created_at": at(90000 - n),
    }


MODEL = {
    "name": "demo",
    "created_at": at(90000),
    "versions": [
        version("v1", "base", None, 1),
        version("v2", "diffusion", "demo:v1", 2),
        version("v3", "finetune", "demo:v2", 3),
    ],
}
EVENTS = [
    {
        "id": i,
        "time": at(600 - 60 * i),
        "actor": a,
        "kind": k,
        "subject": s,
        "message": m,
        "data": {},
    }
    for i, (a, k, s, m) in enumerate(
        [
            ("admin", "host.registered", "gpu-1", "host gpu-1 registered"),
            ("admin", "host.registered", "gpu-2", "host gpu-2 registered"),
            ("admin", "deployment.created", "web", "deployment web created on demo:v1"),
            ("controller", "host.not_ready", "gpu-3", "no heartbeat for 3 intervals"),
            ("admin", "rollout.started", "web", "rollout of web to demo:v2 started"),
        ],
        start=1,
    )
]


def traffic() -> dict[str, Any]:
    def point(i: int, requests: int, p95: float) -> dict[str, Any]:
        return {
            "time": at(300 - 10 * i),
            "requests": requests,
            "errors": 0,
            "output_tokens": requests * 50,
            "latency_p95_s": p95,
            "ttft_p95_s": p95 / 4,
        }

    def totals(tag: str, pool: str, requests: int, p95: float, tpf: float) -> dict[str, Any]:
        return {
            "version_id": int(tag[1:]),
            "version": f"demo:{tag}",
            "pool": pool,
            "requests": requests,
            "errors_5xx": 1,
            "error_rate": 1 / requests,
            "latency_p95_s": p95,
            "ttft_p95_s": p95 / 4,
            "steps_per_block": 6.5,
            "tokens_per_forward": tpf,
        }

    return {
        "deployment": "web",
        "since": at(300),
        "until": at(0),
        "step_s": 10,
        "gateways": 1,
        "versions": [
            totals("v1", "stable", 900, 0.41, 2.1),
            totals("v2", "canary", 100, 0.47, 2.3),
        ],
        "series": [
            {
                "version_id": 1,
                "version": "demo:v1",
                "points": [point(i, 20 + (i * 7) % 15, 0.4) for i in range(30)],
            },
            {
                "version_id": 2,
                "version": "demo:v2",
                "points": [point(i, 2 + i % 3, 0.45) for i in range(30)],
            },
        ],
    }


def samples() -> list[dict[str, Any]]:
    return [
        {
            "name": f"gpu{index}.utilization_percent",
            "instance_id": None,
            "points": [[at(600 - 10 * i), float((i * 13 + index * 40) % 100)] for i in range(60)],
        }
        for index in (0, 1)
    ]


def answer(request: httpx.Request) -> Any:
    """The canned body for REQUEST's path, or None for a 404."""
    path = request.url.path.removeprefix("/api/v1")
    hosts_by_name = {h["name"]: h for h in HOSTS}
    routes: dict[str, Any] = {
        "/status": {
            "hosts_by_state": {"ready": 2, "not_ready": 1},
            "hosts_draining": 0,
            "gpus": 4,
            "models": 1,
            "versions": 3,
            "deployments": 2,
            "instances_by_state": {"ready": 6},
        },
        "/hosts": HOSTS,
        "/deployments": [DEPLOYMENT, CHAT],
        "/deployments/web": DEPLOYMENT,
        "/deployments/chat": CHAT,
        "/deployments/web/rollout": ROLLOUT,
        "/deployments/web/rollouts": HISTORY,
        "/deployments/web/traffic": traffic(),
        "/models": [MODEL],
        "/models/demo": MODEL,
        "/events": {"items": EVENTS, "next_cursor": len(EVENTS)},
    }
    for name, body in hosts_by_name.items():
        on_host = [i for i in INSTANCES + CHAT_INSTANCES if i["host"] == name]
        routes[f"/hosts/{name}"] = {**body, "instances": on_host}
        routes[f"/hosts/{name}/samples"] = samples() if body["gpus"] else []
    if path == "/events" and request.url.params.get("after"):
        return {"items": [], "next_cursor": len(EVENTS)}
    return routes.get(path)


def handler(request: httpx.Request) -> httpx.Response:
    """The MockTransport's handler."""
    body = answer(request)
    if body is None:
        return httpx.Response(404, json={"error": "not_found", "message": "not found"})
    return httpx.Response(
        200, content=json.dumps(body), headers={"content-type": "application/json"}
    )


def canned_client() -> AsyncControlPlaneClient:
    """A client whose control plane is the canned answers above."""
    return AsyncControlPlaneClient(
        "http://cp.test:8700", "token", transport=httpx.MockTransport(handler)
    )


def frozen() -> datetime:
    """The snapshot tests' clock."""
    return NOW
