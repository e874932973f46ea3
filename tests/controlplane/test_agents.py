"""Agent protocol: registration, heartbeats, isolation between hosts, host health."""

from __future__ import annotations

import time

import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlmodel import col

from controlplane.app import create_app
from controlplane.models import ApiToken
from protocol.wire import HeartbeatReply, Manifest, RegisterResponse
from tests.controlplane.conftest import Api, deploy, gpu, manifest, register_version


def test_register_returns_agent_token_bound_to_host(api: Api) -> None:
    body = api.register(
        "gpu-1", stamp={"tier": "prod"}, labels={"zone": "a"}, port_range=[19000, 19009]
    )
    reply = RegisterResponse(**body)
    assert reply.host_name == "gpu-1" and reply.heartbeat_interval_s == 5.0
    assert reply.agent_token.startswith("dctl_")
    host = api.as_admin("GET", "/api/v1/hosts/gpu-1").json()
    # The bootstrap token's labels are the operator's; the agent's own are only reported.
    assert host["labels"] == {"tier": "prod"} and host["reported_labels"] == {"zone": "a"}
    assert host["port_range"] == [19000, 19009] and host["agent_token"] is True
    tokens = api.as_admin("GET", "/api/v1/tokens").json()
    agent = [t for t in tokens if t["role"] == "agent"]
    assert [(t["name"], t["host"]) for t in agent] == [("agent-gpu-1", "gpu-1")]


def test_bootstrap_token_uses_and_expiry_are_enforced(api: Api) -> None:
    boot = api.token("bootstrap", uses=1)
    ok = api.call("POST", "/api/v1/agents/register", boot, json={"name": "gpu-1"})
    assert ok.status_code == 200
    spent = api.call("POST", "/api/v1/agents/register", boot, json={"name": "gpu-2"})
    assert spent.status_code == 401 and "no uses left" in spent.json()["message"]
    # A rejected body does not spend a use.
    boot2 = api.token("bootstrap", uses=1)
    bad = api.call("POST", "/api/v1/agents/register", boot2, json={"name": "Bad_Name"})
    assert bad.status_code == 422
    assert api.call("POST", "/api/v1/agents/register", boot2, json={"name": "gpu-2"}).is_success
    timed = api.token("bootstrap", expires_in_s=60)
    api.clock.advance(61)
    late = api.call("POST", "/api/v1/agents/register", timed, json={"name": "gpu-3"})
    assert late.status_code == 401 and "expired" in late.json()["message"]


def test_reregistering_revokes_the_old_agent_token(api: Api) -> None:
    old = api.register("gpu-1")["agent_token"]
    new = api.register("gpu-1")["agent_token"]
    assert api.heartbeat(old).status_code == 401
    assert api.heartbeat(new).status_code == 200
    kinds = [e["kind"] for e in api.as_admin("GET", "/api/v1/events").json()["items"]]
    assert kinds.count("host.registered") == 1 and kinds.count("host.reregistered") == 1


def test_heartbeat_commits_observed_state_and_returns_desired_state(api: Api, tmp_path) -> None:  # type: ignore[no-untyped-def]
    register_version(
        api, source=str(tmp_path), memory_plan={"weights_bytes": 100, "kv_bytes_per_token": 8}
    )
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"], per_host=2, engine_config={"model": {"block_size": 4}})
    reply = HeartbeatReply(**api.heartbeat(agent, gpus=[gpu(i) for i in range(8)]).json())
    assert [i.port for i in reply.instances] == [18000, 18001]
    first = reply.instances[0]
    assert first.deployment == "web" and first.engine_config == {"model": {"block_size": 4}}
    assert first.model.digest == Manifest(**manifest("config.json", "model.safetensors")).digest()
    assert first.model.manifest.digest() == first.model.digest
    assert first.model.files_url is not None
    # A path, never a URL built from the request's Host header (which a client controls).
    assert first.model.files_url == "/api/v1/models/demo/versions/v1/files/"
    assert first.model.memory_plan is not None and first.model.memory_plan.weights_bytes == 100
    observed = [
        {"instance_id": first.instance_id, "state": "ready", "pid": 4242, "port": 18000,
         "restart_count": 2, "last_exit": {"code": 137, "reason": "killed"}},
    ]  # fmt: skip
    again = api.heartbeat(
        agent, instances=observed, applied_generation=reply.generation, gpus=[gpu(0), gpu(1)]
    )
    assert again.json()["generation"] == reply.generation  # nothing changed
    host = api.as_admin("GET", "/api/v1/hosts/gpu-1").json()
    assert len(host["gpus"]) == 2 and host["gpus"][0]["name"] == "NVIDIA H200"
    assert host["applied_generation"] == reply.generation
    inst = host["instances"][0]
    assert (inst["observed_state"], inst["pid"], inst["restart_count"]) == ("ready", 4242, 2)
    assert inst["last_exit"]["code"] == 137
    events = api.as_admin("GET", "/api/v1/events", params={"kind": "instance.*"}).json()["items"]
    assert [(e["kind"], e["data"]["previous"]) for e in events] == [("instance.ready", "pending")]
    assert events[0]["message"] == f"web instance {first.instance_id} on gpu-1: pending -> ready"
    config = {"engine_config": {"model": {"block_size": 8}}}
    api.as_admin("PATCH", "/api/v1/deployments/web", json=config)
    changed = HeartbeatReply(**api.heartbeat(agent).json())
    assert changed.generation > reply.generation
    assert changed.instances[0].engine_config == {"model": {"block_size": 8}}


def test_one_agent_cannot_touch_another_hosts_state(api: Api) -> None:
    register_version(api)
    agent_a = api.register("host-a")["agent_token"]
    agent_b = api.register("host-b")["agent_token"]
    deploy(api, "web", ["host-a", "host-b"])
    mine_a = api.heartbeat(agent_a).json()["instances"]
    mine_b = api.heartbeat(agent_b).json()["instances"]
    ids_a = {i["instance_id"] for i in mine_a}
    ids_b = {i["instance_id"] for i in mine_b}
    assert ids_a and ids_b and not ids_a & ids_b
    # Agent A reports B's instance as crashed: ignored.
    forged = [{"instance_id": next(iter(ids_b)), "state": "failed", "message": "forged"}]
    assert api.heartbeat(agent_a, instances=forged).status_code == 200
    b = api.as_admin("GET", "/api/v1/hosts/host-b").json()
    assert b["instances"][0]["observed_state"] == "pending" and b["instances"][0]["message"] == ""
    # Agent tokens read nothing else: hosts, deployments, events, tokens.
    for path in ["/api/v1/hosts/host-b", "/api/v1/deployments/web", "/api/v1/events"]:
        assert api.call("GET", path, agent_a).status_code == 403
    assert (
        api.call("POST", "/api/v1/agents/register", agent_a, json={"name": "host-b"}).status_code
        == 403
    )


def test_silent_hosts_go_not_ready_then_unreachable_and_back(api: Api) -> None:
    agent = api.register("gpu-1")["agent_token"]
    health = api.app.state.ctx.health
    api.clock.advance(14)
    assert health.sweep() == []
    api.clock.advance(1)  # 15 s = 3 intervals of 5 s
    assert [(t.previous, t.current) for t in health.sweep()] == [("ready", "not_ready")]
    assert health.sweep() == []  # no repeated transition
    api.clock.advance(35)  # 50 s = 10 intervals
    assert [(t.previous, t.current) for t in health.sweep()] == [("not_ready", "unreachable")]
    assert api.as_admin("GET", "/api/v1/hosts/gpu-1").json()["state"] == "unreachable"
    assert api.heartbeat(agent).json()["host_state"] == "ready"
    assert api.as_admin("GET", "/api/v1/hosts/gpu-1").json()["state"] == "ready"
    kinds = [e["kind"] for e in api.as_admin("GET", "/api/v1/events").json()["items"]]
    assert kinds[-3:] == ["host.not_ready", "host.unreachable", "host.ready"]
    metrics = api.client.get("/metrics").text
    assert 'dctl_hosts{state="ready"} 1.0' in metrics
    # Per host, so an alert can name it: just heard from, so its heartbeat is 0 s old.
    assert 'dctl_host_heartbeat_age_seconds{host="gpu-1",state="ready"} 0.0' in metrics
    api.clock.advance(20)
    health.sweep()
    metrics = api.client.get("/metrics").text
    assert 'dctl_host_heartbeat_age_seconds{host="gpu-1",state="not_ready"} 20.0' in metrics


def test_metric_samples_are_downsampled_to_one_row_per_series_per_10s(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    instance_id = api.heartbeat(agent).json()["instances"][0]["instance_id"]
    for _ in range(12):  # 12 heartbeats, 2.5 s apart = 30 s
        api.clock.advance(2.5)
        metrics = [{"instance_id": instance_id, "counters": {"requests": 1.0},
                    "gauges": {"queue_depth": 3.0}}]  # fmt: skip
        assert api.heartbeat(agent, gpus=[gpu(0), gpu(1)], metrics=metrics).status_code == 200
    with api.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT name, COUNT(*), SUM(value) FROM metricsample GROUP BY name")
        ).all()
    by_name = {name: (count, total) for name, count, total in rows}
    assert by_name["gpu0.utilization_percent"][0] == 3  # buckets closed in 30 s
    assert by_name["queue_depth"][0] == 3
    # Counter deltas are summed per bucket: 3 + 4 + 4 closed, the 12th is in the open bucket.
    assert by_name["requests"] == (3, 11.0)
    assert by_name["queue_depth"] == (3, 9.0)
    history = api.as_admin(
        "GET", "/api/v1/hosts/gpu-1/samples", params={"series": "gpu0.*", "minutes": 60}
    ).json()
    assert [s["name"] for s in history] == [
        "gpu0.memory_used_bytes", "gpu0.power_w", "gpu0.temperature_c", "gpu0.utilization_percent"
    ]  # fmt: skip
    times = [p[0] for p in history[0]["points"]]
    assert len(times) == 3 and times == sorted(times)
    assert history[3]["points"][0][1] == 40.0


def test_metrics_endpoint_counts_requests_by_route(api: Api) -> None:
    api.as_admin("GET", "/api/v1/hosts")
    api.client.get("/api/v1/hosts")
    text = api.client.get("/metrics").text
    assert 'dctl_http_requests_total{method="GET",route="/api/v1/hosts",status="200"} 1.0' in text
    assert 'dctl_http_requests_total{method="GET",route="/api/v1/hosts",status="401"} 1.0' in text
    assert "dctl_heartbeat_lag_seconds" in text


def test_metric_samples_older_than_24h_are_pruned(api: Api) -> None:
    agent = api.register("gpu-1")["agent_token"]
    for _ in range(3):
        api.heartbeat(agent, gpus=[gpu(0)])
        api.clock.advance(10)
    health = api.app.state.ctx.health
    assert health.prune_samples() == 0
    api.clock.advance(24 * 3600 - 25)  # now t0 + 24 h + 5 s: only the t0 bucket is older
    assert health.prune_samples() == 4  # one bucket: 4 GPU series
    with api.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT COUNT(*) FROM metricsample")).scalar()
    assert left == 4


def test_the_running_app_sweeps_host_health_by_itself(api: Api) -> None:
    api.register("gpu-1")
    api.clock.advance(60)
    app = create_app(api.settings, clock=api.clock, engine=api.engine, run_controllers=True)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        state = ""
        while time.monotonic() < deadline:
            host = client.get("/api/v1/hosts/gpu-1", headers=api.auth(api.admin)).json()
            state = host["state"]
            if state == "unreachable":
                break
            time.sleep(0.1)
    assert state == "unreachable"


def test_heartbeats_answered_in_the_fast_lane_keep_errors_and_metrics(api: Api) -> None:
    agent = api.register("gpu-1")["agent_token"]
    # The first heartbeat verifies the token in the store; later ones find it cached and take
    # the fast lane, which must give the same replies, errors and request counts.
    assert api.heartbeat(agent).status_code == 200
    fast = api.heartbeat(agent, applied_generation=1)
    assert fast.status_code == 200 and fast.headers["content-type"] == "application/json"
    assert HeartbeatReply(**fast.json()).host_state == "ready"
    bad = api.heartbeat(agent, gpus=[{"index": "zero"}])
    assert bad.status_code == 422 and "gpus" in bad.text
    text = api.client.get("/metrics").text
    route = 'method="POST",route="/api/v1/agents/heartbeat"'
    assert f'dctl_http_requests_total{{{route},status="200"}} 2.0' in text
    assert f'dctl_http_requests_total{{{route},status="422"}} 1.0' in text
    # Past the cache's lifetime the token is checked in the store again: still valid, then
    # revoked by another replica.
    api.clock.advance(6)
    assert api.heartbeat(agent).status_code == 200
    with api.engine.begin() as conn:
        conn.execute(
            sa.update(ApiToken)
            .where(col(ApiToken.host_id).is_not(None))
            .values(revoked_at=api.clock())
        )
    api.clock.advance(6)
    refused = api.heartbeat(agent)
    assert refused.status_code == 401 and "revoked" in refused.json()["message"]
    with api.engine.begin() as conn:
        conn.execute(sa.update(ApiToken).values(revoked_at=None))
    assert api.heartbeat(agent).status_code == 200
    # Another replica removed the host: its token is still cached here, the write finds no
    # host row, and the agent is told to register again.
    with api.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM apitoken WHERE host_id IS NOT NULL"))
        conn.execute(sa.text("DELETE FROM host"))
    gone = api.heartbeat(agent)
    assert gone.status_code == 404 and gone.json()["error"] == "host_removed"
