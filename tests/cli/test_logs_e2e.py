"""`dctl logs`, `dctl requests`, `dctl audit` and `dctl doctor`'s `access.audit` against a real
`dctl server` (the CLI tests' session server): log lines shipped in an agent's heartbeats, a
gateway's traffic report with request summaries and a revoked token's refusals, and
`dctl logs --follow` as a process that prints a line shipped after it started and exits 0 on
Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from cli.exits import OK
from client import ControlPlaneClient
from protocol.gateway import TrafficReport
from protocol.logs import LogBatch, RequestSummary, ShippedLine, TokenRefusal, TokenUsage
from protocol.wire import HEARTBEAT_PATH, GpuStatus, Heartbeat, Manifest
from tests.cli.conftest import DCTL, Dctl, Server
from tests.cli.hosts import register_host

HOST = "logs-1"
DEPLOYMENT = "logsweb"


def ship(server: Server, agent_token: str, *lines: ShippedLine) -> None:
    """One heartbeat of HOST carrying LINES, the way its agent sends them."""
    gpus = [GpuStatus(index=i, uuid=f"GPU-{HOST}-{i}", name="H100", memory_total_bytes=80 << 30)
            for i in range(2)]  # fmt: skip
    beat = Heartbeat(gpus=gpus, logs=LogBatch(lines=list(lines)))
    reply = httpx.post(
        server.url + HEARTBEAT_PATH,
        json=beat.model_dump(mode="json"),
        headers={"Authorization": f"Bearer {agent_token}"},
    )
    assert reply.status_code == 200, reply.text


def line(text: str, instance: int | None, at: datetime, **extra: Any) -> ShippedLine:
    source = "engine" if instance is not None else "agent"
    return ShippedLine(source=source, instance_id=instance, time=at, seq=0, line=text, **extra)


def report_traffic(server: Server, dctl: Dctl, revoked_key: str) -> None:
    """What a gateway reports: two summaries (one a 502), every request of token `app`, and 9
    refusals of a revoked token."""
    made = dctl("token", "create", "logs-gw", "--role", "gateway", "--json")
    assert made.code == OK, made.stderr
    now = datetime.now(UTC)
    summaries = [
        RequestSummary(request_id="e2e-req-1", time=now, token="app", deployment=DEPLOYMENT,
                       version="logsm:v1", pool="stable", status=200, prompt_tokens=12,
                       completion_tokens=64, steps_per_block=4.0, tokens_per_forward=2.5,
                       ttft_s=0.05, latency_s=0.8),
        RequestSummary(request_id="e2e-req-2", time=now, token="app", deployment=DEPLOYMENT,
                       version="logsm:v1", pool="stable", status=502, latency_s=2.0),
    ]  # fmt: skip
    report = TrafficReport(
        gateway="gw-e2e", started_at=now - timedelta(seconds=5), ended_at=now,
        requests=summaries,
        usage=[TokenUsage(token="app", deployment=DEPLOYMENT, requests=2, errors=1)],
        refusals=[TokenRefusal(key_id=revoked_key, reason="unknown", count=9)],
    )  # fmt: skip
    with ControlPlaneClient(server.url, json.loads(made.stdout)["secret"]) as gateway:
        gateway.report_traffic(report)


def test_logs_requests_and_the_audit_on_a_real_control_plane(dctl: Dctl, server: Server) -> None:
    agent_token = register_host(server, dctl, HOST, gpus=2)
    made = Manifest.model_validate(
        {"files": [{"path": "config.json", "size": 100, "sha256": "cd" * 32}]}
    )
    with ControlPlaneClient(server.url, server.admin_token) as admin:
        admin.register_version("logsm", "v1", made, source_uri="/models/logsm")
    created = dctl("deploy", "create", DEPLOYMENT, "--model", "logsm:v1", "--hosts", HOST,
                   "--gpus-per-instance", "1", "--instances-per-host", "2")  # fmt: skip
    assert created.code == OK, created.stderr
    try:
        shown = json.loads(dctl("deploy", "show", DEPLOYMENT, "--json").stdout)
        first, second = sorted(i["id"] for i in shown["instances"])
        t0 = datetime.now(UTC) - timedelta(seconds=30)
        # Shipped out of time order (the agent reads its files in turn): printed in time order.
        ship(server, agent_token,
             line("loading experts", second, t0 + timedelta(seconds=2)),
             line("engine ready \x1b]0;owned\x07on :8001", first, t0 + timedelta(seconds=1)),
             line("e2e-req-1 finished block 4", second, t0 + timedelta(seconds=3),
                  request_id="e2e-req-1"),
             line("heartbeat ok", None, t0 + timedelta(seconds=4)))  # fmt: skip

        logs = dctl("logs", DEPLOYMENT)
        assert logs.code == OK, logs.stderr
        assert logs.stdout.splitlines() == [
            f"{HOST} i{first} | engine ready on :8001",
            f"{HOST} i{second} | loading experts",
            f"{HOST} i{second} | e2e-req-1 finished block 4",
        ]
        with_agent = dctl("logs", DEPLOYMENT, "--agent", "--since", "10m").stdout.splitlines()
        assert with_agent[-1] == f"{HOST} agent | heartbeat ok"
        only = dctl("logs", DEPLOYMENT, "--instance", str(first), "--json").stdout.splitlines()
        assert [json.loads(x)["line"] for x in only] == ["engine ready \x1b]0;owned\x07on :8001"]

        old = dctl("token", "create", "logs-old-app", "--role", "client", "--json")
        revoked_key = json.loads(old.stdout)["secret"].split("_")[1]
        assert dctl("token", "revoke", "logs-old-app").code == OK
        report_traffic(server, dctl, revoked_key)

        request = dctl("logs", DEPLOYMENT, "--request", "e2e-req-1")
        assert request.code == OK, request.stderr
        summary, _, lines = request.stdout.partition("\n\n")
        assert "request:           e2e-req-1" in summary and "status:            200" in summary
        assert "gateway:           gw-e2e" in summary
        assert lines == f"{HOST} i{second} | e2e-req-1 finished block 4\n"

        errors = dctl("requests", DEPLOYMENT, "--errors")
        assert errors.code == OK, errors.stderr
        [_header, row] = errors.stdout.splitlines()
        assert "e2e-req-2" in row and " 502 " in row
        as_csv = dctl("requests", DEPLOYMENT, "--csv").stdout.splitlines()
        assert as_csv[0].startswith("request_id,time,token,deployment,version,pool,")
        assert len(as_csv) == 3

        audit = dctl("audit", "--since", "1h")
        assert audit.code == OK, audit.stderr
        assert "  logs-old-app: revoked, still tried: refused 9 time(s)" in audit.stdout
        doctor = json.loads(dctl("doctor", "--json").stdout)
        [warned] = [f for f in doctor if f["subject"] == "token/logs-old-app"]
        assert warned["rule"] == "access.audit" and warned["severity"] == "warning"
        assert "a client still sends revoked token logs-old-app" in warned["fix"]

        follow_until_ctrl_c(server, agent_token, first)
    finally:
        dctl("deploy", "delete", DEPLOYMENT, "--yes")
        dctl("host", "remove", HOST, "--yes")


def follow_until_ctrl_c(server: Server, agent_token: str, instance: int) -> None:
    """`dctl logs --follow` prints what is kept, then a line shipped after it started; Ctrl-C
    ends it with exit 0."""
    proc = subprocess.Popen(
        [*DCTL, "logs", DEPLOYMENT, "--follow", "--instance", str(instance)],
        env=server.env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"{HOST} i{instance} | engine ready on :8001\n"
        ship(server, agent_token, line("a new line", instance, datetime.now(UTC)))
        assert proc.stdout.readline() == f"{HOST} i{instance} | a new line\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (OK, "", "")
