"""The fleet's scrape targets: a real control plane (uvicorn on loopback, SQLite, a clock the
test moves), real heartbeats of agents and of the gateway's own heartbeat code, `GET
/api/v1/metrics/targets` and `dctl metrics targets` (in-process and, for `--watch`, as a process
a signal stops), and a real `dctl agent` whose /metrics binds port 0."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from client.http import AsyncControlPlaneClient
from controlplane import migrate
from controlplane.app import create_app
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings
from gateway.presence import GatewayPresence
from tests.clock import FakeClock
from tests.controlplane.conftest import gpu, manifest
from tests.uvicorn_thread import serve_in_thread

V = "/api/v1"
PUBLIC_URL = "http://cp.example.net:8700"
ADDRESS = "10.0.0.5"
AGENT_METRICS = f"http://{ADDRESS}:9401/metrics"


@dataclass
class Plane:
    """A served control plane, its clock and tokens."""

    url: str
    clock: FakeClock
    admin: str
    http: httpx.Client

    def call(self, method: str, path: str, token: str, **kwargs: Any) -> httpx.Response:
        """One request with TOKEN."""
        headers = {"Authorization": f"Bearer {token}"}
        return self.http.request(method, f"{self.url}{path}", headers=headers, **kwargs)

    def token(self, role: str) -> str:
        """A fresh token of ROLE."""
        body = {"name": f"t-{role}-{time.monotonic_ns() % 10**8}", "role": role}
        response = self.call("POST", f"{V}/tokens", self.admin, json=body)
        assert response.status_code == 201, response.text
        secret: str = response.json()["secret"]
        return secret

    def targets(self, token: str | None = None) -> list[dict[str, Any]]:
        """`GET /api/v1/metrics/targets` as a viewer (or TOKEN)."""
        response = self.call("GET", f"{V}/metrics/targets", token or self.token("viewer"))
        assert response.status_code == 200, response.text
        groups: list[dict[str, Any]] = response.json()
        return groups


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once; each test gets a copy."""
    path = tmp_path_factory.mktemp("targets") / "dctl.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def plane(template: Path, tmp_path: Path) -> Iterator[Plane]:
    """A control plane on a fresh database, served on a free loopback port."""
    path = tmp_path / "dctl.db"
    shutil.copy(template, path)
    url = f"sqlite:///{path}"
    clock = FakeClock.on_real_time()
    engine = make_engine(url)
    admin = ensure_admin_token(engine, clock())
    assert admin is not None
    settings = ControlPlaneSettings(database_url=url, public_url=PUBLIC_URL)
    app = create_app(settings, clock=clock, engine=engine, run_controllers=False)
    with serve_in_thread(app, log_level="warning") as base, httpx.Client(timeout=10) as http:
        yield Plane(base, clock, admin, http)
    engine.dispose()


def register_host(plane: Plane, name: str, metrics_url: str | None = AGENT_METRICS) -> str:
    """Register host NAME advertising ADDRESS and heartbeat once with 8 GPUs; its agent token."""
    bootstrap = plane.token("bootstrap")
    body = {"name": name, "advertise_address": ADDRESS}
    response = plane.call("POST", f"{V}/agents/register", bootstrap, json=body)
    assert response.status_code == 200, response.text
    agent: str = response.json()["agent_token"]
    heartbeat(plane, agent, metrics_url)
    return agent


def heartbeat(
    plane: Plane, agent: str, metrics_url: str | None = AGENT_METRICS, **body: Any
) -> dict[str, Any]:
    """One heartbeat of a host with 8 GPUs whose agent serves /metrics at METRICS_URL."""
    beat = {"advertise_address": ADDRESS, "gpus": [gpu(i) for i in range(8)],
            "facts": {"metrics_url": metrics_url}, **body}  # fmt: skip
    response = plane.call("POST", f"{V}/agents/heartbeat", agent, json=beat)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def serve_web(plane: Plane, agent: str) -> list[dict[str, Any]]:
    """demo:v1 deployed as web, two instances on gpu-1: the first reported ready, the second
    starting; returns the desired instances."""
    version = {"version": "v1", "manifest": manifest("config.json", "model.safetensors"),
               "source_uri": "/nonexistent"}  # fmt: skip
    response = plane.call("POST", f"{V}/models/demo/versions", plane.admin, json=version)
    assert response.status_code in (200, 201), response.text
    spec = {"name": "web", "model": "demo", "version": "v1", "placement": {"hosts": ["gpu-1"]},
            "instances_per_host": 2}  # fmt: skip
    response = plane.call("POST", f"{V}/deployments", plane.admin, json=spec)
    assert response.status_code == 201, response.text
    desired: list[dict[str, Any]] = heartbeat(plane, agent)["instances"]
    observed = [
        {"instance_id": d["instance_id"], "state": state, "port": d["port"],
         "version_digest": d["model"]["digest"]}
        for d, state in zip(desired, ["ready", "starting"], strict=True)
    ]  # fmt: skip
    heartbeat(plane, agent, instances=observed)
    return desired


def gateway_beats(plane: Plane, token: str, port: int = 18800) -> Callable[[], bool]:
    """The gateway's own heartbeat code (`GatewayPresence`) over the real REST client: a
    function that sends one beat."""

    def beat() -> bool:
        async def once() -> bool:
            async with AsyncControlPlaneClient(plane.url, token) as link:
                presence = GatewayPresence(link, gateway_id=f"gw-{port}", address="127.0.0.1",
                                           port=port, scheme="http", interval_s=5.0)  # fmt: skip
                return await presence.beat_once()

        return asyncio.run(once())

    return beat


def by_role(groups: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [g for g in groups if g["labels"]["role"] == role]


def test_live_targets_with_their_labels_and_silent_ones_left_out(plane: Plane) -> None:
    agent = register_host(plane, "gpu-1")
    first, _starting = serve_web(plane, agent)
    beat = gateway_beats(plane, plane.token("gateway"))
    assert beat()

    groups = plane.targets()
    # The control plane at its public_url, not at the address this caller happened to use.
    assert by_role(groups, "controlplane") == [
        {"targets": ["cp.example.net:8700"],
         "labels": {"role": "controlplane", "__scheme__": "http", "__metrics_path__": "/metrics"}}
    ]  # fmt: skip
    assert by_role(groups, "agent") == [
        {"targets": [f"{ADDRESS}:9401"],
         "labels": {"role": "agent", "host": "gpu-1", "__scheme__": "http",
                    "__metrics_path__": "/metrics"}}
    ]  # fmt: skip
    # Only the ready instance; the starting one is not a target yet.
    assert by_role(groups, "engine") == [
        {"targets": [f"{ADDRESS}:{first['port']}"],
         "labels": {"role": "engine", "host": "gpu-1", "deployment": "web", "version": "demo:v1",
                    "instance_id": str(first["instance_id"]), "__scheme__": "http",
                    "__metrics_path__": "/metrics"}}
    ]  # fmt: skip
    assert by_role(groups, "gateway") == [
        {"targets": ["127.0.0.1:18800"],
         "labels": {"role": "gateway", "host": "127.0.0.1", "__scheme__": "http",
                    "__metrics_path__": "/metrics"}}
    ]  # fmt: skip
    assert all(value for g in groups for value in g["labels"].values()), "no empty labels"
    listed = plane.call("GET", f"{V}/gateways", plane.token("viewer")).json()
    assert [(g["gateway"], g["port"], g["live"], g["metrics_url"]) for g in listed] == [
        ("gw-18800", 18800, True, "http://127.0.0.1:18800/metrics")
    ]

    # 16 s on (3 intervals of 5 s and a bit): the host heartbeats on, the gateway fell silent.
    plane.clock.advance(16)
    heartbeat(plane, agent)
    roles = [g["labels"]["role"] for g in plane.targets()]
    assert roles == ["controlplane", "agent", "engine"]
    assert plane.call("GET", f"{V}/gateways", plane.token("viewer")).json()[0]["live"] is False

    # Another 16 s: now the gateway beats again and the host is the silent one (no sweep ran:
    # silence is judged by the clock), so its agent and its engines are left out.
    plane.clock.advance(16)
    assert beat()
    roles = [g["labels"]["role"] for g in plane.targets()]
    assert roles == ["controlplane", "gateway"]


def test_an_agent_that_reports_no_metrics_url_has_no_target(plane: Plane) -> None:
    register_host(plane, "gpu-1", metrics_url=None)
    assert [g["labels"]["role"] for g in plane.targets()] == ["controlplane"]
    # A URL that is not one is refused with the heartbeat, not stored.
    agent = register_host(plane, "gpu-2")
    beat = {"facts": {"metrics_url": "ftp://x/metrics"}}
    response = plane.call("POST", f"{V}/agents/heartbeat", agent, json=beat)
    assert response.status_code == 422


def test_who_may_read_and_who_may_heartbeat(plane: Plane) -> None:
    agent = register_host(plane, "gpu-1")
    assert plane.call("GET", f"{V}/metrics/targets", agent).status_code == 403
    assert plane.call("GET", f"{V}/gateways", agent).status_code == 403
    assert plane.call("GET", f"{V}/metrics/targets", plane.token("gateway")).status_code == 403
    no_token = plane.http.get(f"{plane.url}{V}/metrics/targets")
    assert no_token.status_code == 401
    beat = {"gateway": "gw-1", "address": "127.0.0.1", "port": 18800}
    for token in (plane.token("viewer"), plane.admin, agent):
        response = plane.call("POST", f"{V}/gateways/heartbeat", token, json=beat)
        assert response.status_code == 403, response.text
    assert plane.targets(plane.admin)[0]["labels"]["role"] == "controlplane"


def dctl(plane: Plane, *args: str) -> Any:
    """`dctl ARGS` in-process, as a viewer of PLANE."""
    from cli.app import app

    env = {"DCTL_URL": plane.url, "DCTL_TOKEN": plane.token("viewer")}
    return CliRunner().invoke(app, list(args), env=env)


def test_cli_writes_file_sd_atomically_and_static_yaml(plane: Plane, tmp_path: Path) -> None:
    agent = register_host(plane, "gpu-1")
    serve_web(plane, agent)
    out = tmp_path / "sd" / "dctl.json"
    out.parent.mkdir()
    result = dctl(plane, "metrics", "targets", "-o", str(out))
    assert result.exit_code == 0, result.output
    groups = json.loads(out.read_text())
    assert groups == plane.targets()
    assert all(set(g) == {"targets", "labels"} for g in groups)
    assert all(isinstance(v, str) for g in groups for v in g["labels"].values())
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in out.parent.iterdir()] == ["dctl.json"], "no temporary file left"

    printed = dctl(plane, "metrics", "targets", "--format", "static")
    assert printed.exit_code == 0, printed.output
    jobs = {job["job_name"]: job for job in yaml.safe_load(printed.stdout)["scrape_configs"]}
    assert set(jobs) == {"dctl-controlplane", "dctl-agent", "dctl-engine"}
    engine = jobs["dctl-engine"]
    assert (engine["scheme"], engine["metrics_path"]) == ("http", "/metrics")
    [static] = engine["static_configs"]
    assert static["labels"]["deployment"] == "web" and static["labels"]["version"] == "demo:v1"
    assert not any(k.startswith("__") for k in static["labels"])

    for args, option in [
        (["--format", "prom"], "--format"),
        (["--watch"], "--watch"),
        (["--interval", "0s", "-o", str(out)], "--interval"),
        (["-o", str(tmp_path / "missing" / "x.json")], "-o"),
    ]:
        bad = dctl(plane, "metrics", "targets", *args)
        assert bad.exit_code == 2, (args, bad.output)
        assert option in bad.output


def test_watch_rewrites_the_file_only_when_the_targets_change(plane: Plane, tmp_path: Path) -> None:
    register_host(plane, "gpu-1")
    out = tmp_path / "dctl.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(DCTL_URL=plane.url, DCTL_TOKEN=plane.token("viewer"),
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip
    watcher = subprocess.Popen(
        [sys.executable, "-m", "cli", "metrics", "targets", "-o", str(out), "--watch",
         "--interval", "1s"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(out.exists, "the first write")
        first = out.stat().st_ino
        time.sleep(2.5)  # two polls that found nothing new
        assert out.stat().st_ino == first, "rewritten although nothing changed"

        assert gateway_beats(plane, plane.token("gateway"))()
        wait_for(lambda: "gateway" in out.read_text(), "the gateway to appear in the file")
        assert out.stat().st_ino != first
        assert json.loads(out.read_text()) == plane.targets()
    finally:
        watcher.send_signal(signal.SIGINT)
        _, err = watcher.communicate(timeout=15)
    assert watcher.returncode == 0, err
    # At least the first write and the gateway's; a host or gateway that fell silent meanwhile
    # (slow machine) is a change too. No rewrite without a change is the inode check above.
    assert err.count("wrote") >= 2, err


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_agent_reports_the_port_its_metrics_bound(plane: Plane, tmp_path: Path) -> None:
    data = tmp_path / "agent"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(DCTL_BOOTSTRAP_TOKEN=plane.token("bootstrap"), DCTL_LOG_LEVEL="warning",
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip
    args = [sys.executable, "-m", "cli", "agent", "--control-plane", plane.url, "--data-dir",
            str(data), "--name", "gpu-9", "--gpu-backend", "fake", "--fake-gpus", "1xH200",
            "--metrics-port", "0", "--metrics-host", "0.0.0.0", "--advertise-address",
            "127.0.0.1"] + (["--allow-root"] if os.geteuid() == 0 else [])  # fmt: skip
    agent = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        found: list[dict[str, Any]] = []

        def listed() -> bool:
            assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
            found[:] = by_role(plane.targets(), "agent")
            return bool(found)

        wait_for(listed, "the agent's metrics target", timeout_s=60)
        bound = int((data / "agent" / "metrics-port").read_text())
        assert bound != 0
        # Bound to every interface, so reported at the advertise address.
        assert found == [
            {"targets": [f"127.0.0.1:{bound}"],
             "labels": {"role": "agent", "host": "gpu-9", "__scheme__": "http",
                        "__metrics_path__": "/metrics"}}
        ]  # fmt: skip
        scraped = httpx.get(f"http://127.0.0.1:{bound}/metrics", timeout=5)
        assert "dctl_agent_heartbeats_total" in scraped.text
    finally:
        agent.terminate()
        agent.wait(30)


def test_denoise_step_histograms_reach_the_samples_as_sum_and_count(plane: Plane) -> None:
    agent = register_host(plane, "gpu-1")
    first, _ = serve_web(plane, agent)
    series = 'dllm_denoise_step_seconds{block_size="4"}'
    histogram = {"buckets": {"0.01": 3.0, "+Inf": 4.0}, "sum": 0.05, "count": 4.0}
    metrics = [{"instance_id": first["instance_id"], "histograms": {series: histogram}}]
    heartbeat(plane, agent, metrics=metrics)
    plane.clock.advance(11)  # the next 10 s bucket: the previous one is written
    heartbeat(plane, agent)
    response = plane.call("GET", f"{V}/hosts/gpu-1/samples", plane.admin)
    assert response.status_code == 200, response.text
    rows = {
        s["name"]: [value for _, value in s["points"]]
        for s in response.json()
        if s["name"].startswith("dllm_denoise") and s["instance_id"] == first["instance_id"]
    }
    assert rows == {
        'dllm_denoise_step_seconds_sum{block_size="4"}': [0.05],
        'dllm_denoise_step_seconds_count{block_size="4"}': [4.0],
    }


def test_an_engine_is_labelled_with_the_version_it_reports_running(plane: Plane) -> None:
    agent = register_host(plane, "gpu-1")
    first, _ = serve_web(plane, agent)
    v2 = {"version": "v2", "manifest": manifest("config.json", "model.safetensors", seed=7),
          "source_uri": "/nonexistent"}  # fmt: skip
    response = plane.call("POST", f"{V}/models/demo/versions", plane.admin, json=v2)
    assert response.status_code in (200, 201), response.text
    # Mid-rollout: the engine still runs v2's snapshot while the store says otherwise (or the
    # other way round); the label follows what the engine serves.
    running = {"instance_id": first["instance_id"], "state": "ready", "port": first["port"],
               "version_digest": response.json()["digest"]}  # fmt: skip
    heartbeat(plane, agent, instances=[running])
    [engine] = by_role(plane.targets(), "engine")
    assert engine["labels"]["version"] == "demo:v2"
