"""Logs through the control plane, over the real API: lines agents ship in heartbeats, the
gateways' request summaries and per-token use, the access audit, and the bounds on all three."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from controlplane.logs.retention import LogRetention
from controlplane.settings import ControlPlaneSettings
from protocol.logs import AuditReport, LogEntry, LogPage, RequestOut
from tests.controlplane.conftest import Api
from tests.controlplane.fleet import ADDRESS, beat, gpu_host, report, serving_fleet

V = "/api/v1"


def ship(api: Api, agent: str, *lines: dict[str, Any], dropped: int = 0) -> None:
    """One heartbeat carrying LINES (time: the test clock's now unless given)."""
    now = api.clock().isoformat()
    batch = {"lines": [{"time": now, "seq": n, **line} for n, line in enumerate(lines)],
             "dropped": dropped}  # fmt: skip
    beat(api, agent, advertise_address=ADDRESS, logs=batch)


def logs(api: Api, name: str = "web", token: str | None = None, **params: Any) -> LogPage:
    response = api.call("GET", f"{V}/deployments/{name}/logs", token or api.admin, params=params)
    assert response.status_code == 200, response.text
    return LogPage.model_validate(response.json())


def test_shipped_lines_are_found_by_deployment_instance_text_and_request(api: Api) -> None:
    agent = serving_fleet(api, per_host=2)
    first, second = (i["instance_id"] for i in report(api, agent))
    ship(
        api, agent,
        {"instance_id": first, "line": "INFO ready model=demo"},
        {"instance_id": second, "line": '{"message": "request", "request_id": "req-7"}',
         "request_id": "req-7"},
        {"instance_id": second, "line": "WARNING Slow step"},
        {"source": "agent", "line": "agent: heartbeat ok"},
    )  # fmt: skip
    page = logs(api)
    assert [(e.instance_id, e.host, e.deployment) for e in page.items] == [
        (first, "gpu-1", "web"), (second, "gpu-1", "web"), (second, "gpu-1", "web"),
    ]  # fmt: skip
    assert [e.line for e in logs(api, instance=first).items] == ["INFO ready model=demo"]
    assert [e.line for e in logs(api, grep="slow STEP").items] == ["WARNING Slow step"]
    [found] = logs(api, request="req-7").items
    assert found.request_id == "req-7"
    # The agent's own lines only when asked for.
    with_agent = logs(api, agent=True).items
    assert [e.line for e in with_agent if e.source == "agent"] == ["agent: heartbeat ok"]
    # Viewers read them; a page continues after its cursor.
    viewer = api.token("viewer")
    assert logs(api, token=viewer, after=page.next_cursor).items == []
    assert len(logs(api, token=viewer, limit=2).items) == 2


def test_an_agent_cannot_write_another_hosts_instances_lines(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    [mine] = [i["instance_id"] for i in report(api, agent)]
    other = gpu_host(api, "gpu-2")
    ship(api, other, {"instance_id": mine, "line": "forged"})
    assert logs(api).items == []


def test_lines_the_agent_dropped_are_counted_and_said(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    [inst] = [i["instance_id"] for i in report(api, agent)]
    ship(api, agent, {"instance_id": inst, "line": "after the flood"}, dropped=1234)
    page = logs(api, agent=True)
    assert page.dropped == 1234
    assert any("dropped 1234 log line(s)" in e.line for e in page.items)


def test_follow_streams_lines_after_the_cursor_as_server_sent_events(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    [inst] = [i["instance_id"] for i in report(api, agent)]
    ship(api, agent, {"instance_id": inst, "line": "old"})
    cursor = logs(api).next_cursor
    ship(api, agent, {"instance_id": inst, "line": "new one"}, {"instance_id": inst, "line": "2"})
    params = {"after": cursor, "max_s": 0.5}
    with api.client.stream("GET", f"{V}/deployments/web/logs/follow", params=params,
                           headers=api.auth(api.admin)) as stream:  # fmt: skip
        assert stream.headers["content-type"].startswith("text/event-stream")
        body = "".join(stream.iter_text())
    events = [block for block in body.split("\n\n") if block.startswith("event: line")]
    lines = [LogEntry.model_validate_json(e.split("data: ", 1)[1]).line for e in events]
    assert lines == ["new one", "2"]
    missing = api.as_admin("GET", f"{V}/deployments/nope/logs/follow", params={"max_s": 0.5})
    assert missing.status_code == 404


def traffic(api: Api, gateway: str, start_s: float, **parts: Any) -> Any:
    start = api.clock() + timedelta(seconds=start_s)
    body = {"gateway": "gw-1", "started_at": start.isoformat(),
            "ended_at": (start + timedelta(seconds=5)).isoformat(), **parts}  # fmt: skip
    return api.call("POST", f"{V}/traffic", gateway, json=body)


def summary(request_id: str, status: int = 200, latency: float = 0.5, **extra: Any) -> Any:
    return {"request_id": request_id, "time": "2026-01-01T12:00:00Z", "token": "app",
            "deployment": "web", "version": "demo:v1", "pool": "stable", "status": status,
            "latency_s": latency, **extra}  # fmt: skip


def test_request_summaries_answer_the_slowest_and_the_errors_once(api: Api) -> None:
    serving_fleet(api, per_host=1)
    gateway = api.token("gateway")
    requests = [summary("a", latency=0.2), summary("b", latency=3.0, tokens_per_forward=1.4),
                summary("c", status=502, latency=1.0), summary("d", deployment="gone")]  # fmt: skip
    usage = [{"token": "app", "deployment": "web", "requests": 3, "errors": 1}]
    assert traffic(api, gateway, -5, requests=requests, usage=usage).status_code == 200
    # The same report again (a retry after a lost answer) stores nothing twice.
    assert traffic(api, gateway, -5, requests=requests, usage=usage).status_code == 200

    def ask(**params: Any) -> list[RequestOut]:
        response = api.as_admin("GET", f"{V}/deployments/web/requests",
                                params={"since": "2025-12-31T00:00:00Z", **params})  # fmt: skip
        assert response.status_code == 200, response.text
        return [RequestOut.model_validate(r) for r in response.json()]

    assert sorted(r.request_id for r in ask()) == ["a", "b", "c"]
    assert [r.request_id for r in ask(slowest=2)] == ["b", "c"]
    assert [r.request_id for r in ask(errors=True)] == ["c"]
    [one] = ask(request="b")
    assert (one.tokens_per_forward, one.gateway, one.token) == (1.4, "gw-1", "app")


def test_the_audit_counts_every_request_and_says_what_a_refused_key_is(api: Api) -> None:
    serving_fleet(api, per_host=1)
    gateway = api.token("gateway")
    made = api.as_admin("POST", f"{V}/tokens", json={"name": "old-app", "role": "client"}).json()
    key_id = made["key_id"] if "key_id" in made else made["secret"].split("_")[1]
    assert api.as_admin("DELETE", f"{V}/tokens/{made['id']}").status_code in (200, 204)
    # A steady week for "app", then a day ten times busier with errors.
    for day in range(6, 0, -1):
        usage = [{"token": "app", "deployment": "web", "requests": 100, "errors": 1}]
        traffic(api, gateway, -day * 86_400, usage=usage)
    api.clock.advance(100)  # the refusals below come after the revocation
    usage = [{"token": "app", "deployment": "web", "requests": 1000, "errors": 400,
              "rate_limited": 7}]  # fmt: skip
    refusals = [{"key_id": key_id, "reason": "unknown", "count": 12},
                {"key_id": "zzzz", "reason": "unknown", "count": 3},
                {"token": "app", "reason": "rate_limited", "count": 5}]  # fmt: skip
    traffic(api, gateway, -60, usage=usage, refusals=refusals)
    response = api.as_admin("GET", f"{V}/audit")
    assert response.status_code == 200, response.text
    report = AuditReport.model_validate(response.json())
    by_name = {t.token: t for t in report.tokens}
    app = by_name["app"]
    assert (app.requests, app.errors, app.rate_limited) == (1600, 406, 7 + 5)
    assert app.refused == {}
    assert app.deployments == ["web"]
    assert any("request rate jumped" in a for a in app.anomalies)
    assert any("error share jumped" in a for a in app.anomalies)
    revoked = by_name["old-app"]
    assert revoked.refused == {"revoked": 12}
    assert any("revoked, still tried: refused 12" in a for a in revoked.anomalies)
    assert by_name["(unknown key zzzz)"].refused == {"unknown": 3}
    # Admin only.
    assert api.call("GET", f"{V}/audit", api.token("operator")).status_code == 403


def test_retention_keeps_a_window_and_a_cap_per_instance(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    [inst] = [i["instance_id"] for i in report(api, agent)]
    ship(api, agent, {"instance_id": inst, "line": "yesterday"})
    api.clock.advance(86_400 + 60)
    ship(api, agent, *({"instance_id": inst, "line": f"line {n}"} for n in range(150)))
    settings = ControlPlaneSettings(database_url="sqlite://", log_max_lines_per_instance=100)
    gone = LogRetention(api.engine, settings).prune(api.clock())
    assert gone == 51
    kept = logs(api, since=(api.clock() - timedelta(days=3)).isoformat(), limit=1000).items
    assert [e.line for e in kept] == [f"line {n}" for n in range(50, 150)]
