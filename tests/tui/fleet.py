"""Fake agents and a fake gateway that keep the TUI tests' control plane alive.

Each `FakeAgent` does what a real agent's heartbeat does, minus the engines: it reports its
GPUs (a slowly moving sample), its facts (the snapshots it holds, so a rollout's pre-staging
passes at once) and every instance it was told to run in the state it was told (`running` ->
ready on the desired digest, `stopped` -> stopped), so rollouts, restarts and drains converge
within a beat or two. `Ticker` beats every agent about twice a second from a background thread
(and posts a gateway traffic report now and then) until stopped; `nudge()` beats at once.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from client import ClientError, ControlPlaneClient, calls
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S

GIB = 2**30
BEAT_S = 0.5
TRAFFIC_EVERY = 4  # beats between two traffic reports


@dataclass
class FakeAgent:
    """One host's agent: its token, what it holds, and the last desired state it was sent."""

    name: str
    client: ControlPlaneClient
    snapshots: list[str]
    gpus: int = 2
    # Fields this host's driver does not support are reported None (the TUI shows N/A).
    unsupported: tuple[str, ...] = ()
    desired: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 0

    def gpu_samples(self, now: float) -> list[dict[str, Any]]:
        """The GPUs with samples that move a little, so sparklines have a shape."""
        samples = []
        for index in range(self.gpus):
            util = 45.0 + 35.0 * math.sin(now / 7.0 + index)
            sample = {
                "index": index,
                "uuid": f"GPU-{self.name}-{index}",
                "name": "NVIDIA H200",
                "memory_total_bytes": 141 * GIB,
                "memory_used_bytes": (30 + 10 * index) * GIB,
                "utilization_percent": round(util, 1),
                "temperature_c": 55.0 + index,
                "power_w": 310.0 + 20 * index,
                "power_limit_w": 700.0,
                "ecc_uncorrectable": 0,
                "persistence_mode": True,
                "compute_capability": "9.0",
            }
            samples.append({**sample, **dict.fromkeys(self.unsupported)})
        return samples

    def facts(self) -> dict[str, Any]:
        """Slow-changing facts, preflight included."""
        return {
            "hostname": self.name,
            "os": "Linux 6.8",
            "agent_version": "0.1.0",
            "gpu_backend": "fake",
            "driver_version": "550.54.15",
            "cuda_driver_version": "12.4",
            "cpu_count": 64,
            "memory_bytes": 512 * GIB,
            "disk_free_bytes": 2048 * GIB,
            "preflight": [
                {"name": "nvidia-driver", "status": "pass"},
                {"name": "disk-space", "status": "pass"},
            ],
            "snapshots": self.snapshots,
        }

    def observed(self) -> list[dict[str, Any]]:
        """Every desired instance in the state it should be in, on the digest it should run."""
        out = []
        for want in self.desired:
            running = want["desired_state"] == "running"
            out.append({
                "instance_id": want["instance_id"],
                "state": "ready" if running else "stopped",
                "pid": 1000 + want["instance_id"] if running else None,
                "port": want["port"],
                "version_digest": want["model"]["digest"],
            })  # fmt: skip
        return out

    def metrics(self) -> list[dict[str, Any]]:
        """Engine diffusion figures per running instance (steps per block, tokens per forward)."""
        return [
            {"instance_id": want["instance_id"], "histograms": {
                "dllm_denoising_steps_per_block": {"sum": 40.0, "count": 10},
                "dllm_tokens_per_forward": {"sum": 40.0, "count": 10},
            }}
            for want in self.desired if want["desired_state"] == "running"
        ]  # fmt: skip

    def beat(self) -> None:
        """One heartbeat; the reply's desired state is what the next one reports."""
        body = {
            "sent_at": datetime.now(UTC).isoformat(),
            "applied_generation": self.generation,
            "facts": self.facts(),
            "advertise_address": "127.0.0.1",
            "gpus": self.gpu_samples(time.time()),
            "instances": self.observed(),
            "metrics": self.metrics(),
        }
        reply = self.client.send(calls.request("POST", "/api/v1/agents/heartbeat", json=body))
        self.desired = list(reply["instances"])
        self.generation = int(reply["generation"])


def _buckets(seconds: float, n: int) -> list[int]:
    out = [0] * BUCKET_COUNT
    out[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= seconds)] = n
    return out


def traffic_report(deployment: str, versions: dict[str, int], now: datetime) -> dict[str, Any]:
    """A gateway's last 2 s of requests: VERSIONS maps pool -> version id."""
    windows = []
    for pool, version_id in versions.items():
        n, seconds = (8, 0.4) if pool == "canary" else (40, 0.3)
        windows.append({
            "deployment": deployment, "version_id": version_id, "pool": pool, "requests": n,
            "errors_5xx": 1 if pool == "stable" else 0, "output_tokens": 64 * n,
            "latency_buckets": _buckets(seconds, n), "latency_sum_s": seconds * n,
            "ttft_buckets": _buckets(seconds / 4, n), "ttft_sum_s": seconds / 4 * n,
        })  # fmt: skip
    return {
        "gateway": "gw-1",
        "started_at": (now - timedelta(seconds=2)).isoformat(),
        "ended_at": now.isoformat(),
        "windows": windows,
    }


class Ticker:
    """Beats every agent every `BEAT_S` (at once when nudged) and reports traffic of deployment
    `web` now and then, from a daemon thread; failures (a stopped server) are skipped.
    `start()` once, `stop()` once."""

    def __init__(self, agents: list[FakeAgent], gateway: ControlPlaneClient) -> None:
        self.agents = agents
        self.gateway = gateway  # reads the routes and posts traffic, as a gateway does
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fake-agents", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and wait for the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(10)

    def nudge(self) -> None:
        """Beat now rather than at the next period."""
        self._wake.set()

    def tick(self, count: int = 0) -> None:
        """One beat of every agent (and maybe a traffic report); serialised with the thread."""
        with self._lock:
            for agent in self.agents:
                # The server may be stopped, or the agent rate-limited: next beat.
                with contextlib.suppress(ClientError):
                    agent.beat()
            if count % TRAFFIC_EVERY == 0:
                self._report_traffic()

    def _report_traffic(self) -> None:
        try:
            table = self.gateway.routes()
            routes = table.deployments if table is not None else []
            web = next((d for d in routes if d.deployment == "web"), None)
            if web is None:  # not deployed yet
                return
            pools = {"stable": web.stable.version_id}
            if web.canary is not None and web.canary_weight:
                pools["canary"] = web.canary.version_id
            report = traffic_report("web", pools, datetime.now(UTC))
            self.gateway.send(calls.request("POST", "/api/v1/traffic", json=report))
        except ClientError:
            pass

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            self.tick(count)
            count += 1
            self._wake.wait(BEAT_S)
            self._wake.clear()
