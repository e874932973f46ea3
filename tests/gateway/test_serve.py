"""The gateway as a whole: its own process under `run()` (serving, draining on SIGTERM), and
its link to a control plane (routes polled, traffic reported, outages ridden out)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from client.errors import ClientError
from gateway import GatewaySettings
from protocol.gateway import RouteTable, TrafficAccepted, TrafficReport
from protocol.monitoring import GatewayHeartbeat, GatewayOut
from tests.gateway.canned_engine import refused_port
from tests.gateway.conftest import VERSION_IDS, Fleet, served, until

ROOT = Path(__file__).resolve().parents[2]
_RUN = (
    "import sys; from pathlib import Path; "
    "from gateway import load_gateway_settings, run; "
    "sys.exit(run(load_gateway_settings(None, routes_file=Path(sys.argv[1]), "
    "port=int(sys.argv[2]), log_format='json', shutdown_grace_s=10)))"
)


def test_importing_the_gateway_loads_no_database_or_web_framework() -> None:
    code = (
        "import sys, gateway; heavy = ('sqlmodel', 'sqlalchemy', 'fastapi', 'torch'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_run_serves_then_drains_on_sigterm(fleet: Fleet, tmp_path: Path) -> None:
    port = refused_port()
    env = {**os.environ, "DCTL_CONFIG": str(tmp_path / "absent.toml")}
    log = tmp_path / "gateway.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUN, str(fleet.routes_file), str(port)],
            cwd=ROOT, env=env, stderr=stderr,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    token = fleet.tokens["full"]
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become ready"
            time.sleep(0.05)

        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "solo-model", "prompt": "hi", "canned": "slow", "chunks": 15}
            headers = {"authorization": f"Bearer {token}", "x-request-id": "draining-1"}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                              timeout=30) as answer:  # fmt: skip
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert events[-1] == "data: [DONE]" and len(events) == 16, "the in-flight stream finished"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (request,) = [r for r in lines if r.get("request_id") == "draining-1"]
    assert (request["status"], request["deployment"], request["version"], request["instance"]) == (
        200, "solo", "solo-model:v1", 4,
    )  # fmt: skip
    assert any(r["msg"] == "listening" for r in lines)
    text = log.read_text()
    assert token not in text and "key-of-d" not in text, "secrets stay out of the log"


class ControlPlane:
    """Stands in for the control plane's two gateway endpoints (the coordinator's end-to-end
    tests use the real one): routes by ETag, and traffic reports kept."""

    def __init__(self, table: RouteTable | None) -> None:
        self.table = table
        self.down = False
        self.reports: list[TrafficReport] = []
        self.beats: list[GatewayHeartbeat] = []
        self.closed = False

    async def routes(self, etag: str | None = None) -> RouteTable | None:
        if self.down or self.table is None:
            raise ClientError("cannot reach the control plane at http://cp:8700")
        return None if etag == self.table.etag else self.table

    async def report_traffic(self, report: TrafficReport) -> TrafficAccepted:
        if self.down:
            raise ClientError("cannot reach the control plane at http://cp:8700")
        self.reports.append(report)
        return TrafficAccepted(accepted=len(report.windows))

    async def gateway_heartbeat(self, beat: GatewayHeartbeat) -> GatewayOut:
        if self.down:
            raise ClientError("cannot reach the control plane at http://cp:8700")
        self.beats.append(beat)
        now = datetime.now(UTC)
        return GatewayOut(**beat.model_dump(exclude={"gateway"}), gateway=beat.gateway,
                          first_seen_at=now, last_seen_at=now, live=True)  # fmt: skip

    async def aclose(self) -> None:
        self.closed = True


def _served_requests(reports: list[TrafficReport], deployment: str) -> int:
    return sum(w.requests for r in reports for w in r.windows if w.deployment == deployment)


def test_routes_come_from_the_control_plane_and_traffic_goes_back(fleet: Fleet) -> None:
    link = ControlPlane(None)
    settings = GatewaySettings(
        control_plane="http://cp.invalid:8700", token="dctl_gw_token", port=0,
        routes_poll_s=0.05, report_interval_s=0.2,
    )  # fmt: skip
    with served(settings, fleet, control_plane=link, port=18800) as live:
        # No table yet: not ready, and requests are refused rather than lost.
        assert live.http.get("/health/ready").status_code == 503
        assert live.post("solo-model").json()["error"]["code"] == "not_ready"
        link.table = RouteTable.model_validate_json(fleet.routes_file.read_text())
        until(lambda: live.http.get("/health/ready").status_code == 200)
        for _ in range(3):
            assert live.post("solo-model").status_code == 200
        until(lambda: _served_requests(link.reports, "solo") == 3)
        report = link.reports[-1]
        assert report.port == 18800 and report.address == "127.0.0.1"
        # Windows go back by the version id the routing table gave the pool.
        assert {w.version_id for w in report.windows} == {VERSION_IDS["solo-model:v1"]}
        assert report.gateway.count("-") >= 2  # hostname-pid-random
        # It heartbeats too, over the same link: where it serves and where its /metrics is.
        beat = link.beats[-1]
        assert (beat.gateway, beat.address, beat.port) == (report.gateway, "127.0.0.1", 18800)
        assert beat.metrics_url == "http://127.0.0.1:18800/metrics"
        assert beat.interval_s == 0.2 and beat.version

        # The control plane goes away: the gateway routes on and keeps what it served.
        link.down = True
        for _ in range(2):
            assert live.post("solo-model").status_code == 200
        time.sleep(0.5)
        sent_before = len(link.reports)
        link.down = False
        until(lambda: _served_requests(link.reports, "solo") == 5)
        assert len(link.reports) == sent_before + 1, "the outage's windows came in one report"

        assert live.post("solo-model").status_code == 200  # reported on the way out
    assert _served_requests(link.reports, "solo") == 6
    assert link.closed
