"""Two control-plane replicas on one database: an agent's heartbeats alternate between them.

Each replica remembers what it last wrote of a host to skip writes; these tests flip the
agent's reports A -> B -> A across the replicas (so the second A reaches a replica whose memory
says A is stored) and check the database ends with what the agent last said.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from controlplane.app import create_app
from controlplane.db import make_engine
from protocol.wire import HeartbeatReply
from tests.controlplane.conftest import Api, deploy, gpu, register_version

HEARTBEAT = "/api/v1/agents/heartbeat"


@pytest.fixture
def other(api: Api, db_url: str) -> Iterator[TestClient]:
    """A second replica: its own app, engine and caches, on the same database and clock."""
    engine = make_engine(db_url)
    app = create_app(api.settings, clock=api.clock, engine=engine, run_controllers=False)
    with TestClient(app) as client:
        yield client
    engine.dispose()


def beat(client: TestClient, token: str, **body: Any) -> HeartbeatReply:
    """One heartbeat through `client` (a replica); it must succeed."""
    response = client.post(HEARTBEAT, headers={"Authorization": f"Bearer {token}"}, json=body)
    assert response.status_code == 200, response.text
    return HeartbeatReply(**response.json())


def scalar(api: Api, sql: str) -> Any:
    with api.engine.connect() as conn:
        return conn.execute(sa.text(sql)).scalar()


def test_instance_state_flipping_across_replicas_ends_right(api: Api, other: TestClient) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    replicas = [api.client, other]
    [inst] = beat(api.client, agent).instances
    ready = {"instance_id": inst.instance_id, "state": "ready", "pid": 4242, "port": inst.port}
    failed = {**ready, "state": "failed", "pid": None, "message": "exit 1"}
    for step, report in enumerate([ready, failed, ready, failed, ready]):
        beat(replicas[step % 2], agent, instances=[report])
        state = scalar(api, f"SELECT observed_state FROM instance WHERE id = {inst.instance_id}")
        assert state == report["state"], f"step {step}"
    events = api.as_admin("GET", "/api/v1/events", params={"kind": "instance.*"}).json()["items"]
    assert [e["data"]["previous"] for e in events] == ["pending", "ready", "failed", "ready",
                                                        "failed"]  # fmt: skip


def test_facts_gpus_and_address_flipping_across_replicas_end_right(
    api: Api, other: TestClient
) -> None:
    agent = api.register("gpu-1")["agent_token"]
    replicas = [api.client, other]
    a = {"facts": {"hostname": "a", "agent_version": "1"}, "gpus": [gpu(0), gpu(1)],
         "advertise_address": "10.0.0.1"}  # fmt: skip
    b = {"facts": {"hostname": "b", "agent_version": "2"}, "gpus": [gpu(0)],
         "advertise_address": "10.0.0.2"}  # fmt: skip
    generations = []
    for step, report in enumerate([a, b, a, b, a]):
        generations.append(beat(replicas[step % 2], agent, **report).generation)
        host = api.as_admin("GET", "/api/v1/hosts/gpu-1").json()
        assert host["facts"]["hostname"] == report["facts"]["hostname"], f"step {step}"
        assert len(host["gpus"]) == len(report["gpus"]), f"step {step}"
        address = scalar(api, "SELECT advertise_address FROM host")
        assert address == report["advertise_address"], f"step {step}"
    # Engines bind to the advertise address: every change is a new desired state.
    assert generations == sorted(set(generations))
    changes = api.as_admin("GET", "/api/v1/events", params={"kind": "host.address_changed"})
    assert len(changes.json()["items"]) == 5


def test_registration_between_heartbeats_is_not_hidden_by_a_replica_memory(
    api: Api, other: TestClient
) -> None:
    first = api.register("gpu-1", facts={"hostname": "old"})["agent_token"]
    beat(other, first, facts={"hostname": "new"})
    # Re-registration writes facts outside a heartbeat; the replica that wrote "new" last must
    # write it again.
    token = api.register("gpu-1", facts={"hostname": "old"})["agent_token"]
    beat(other, token, facts={"hostname": "new"})
    assert api.as_admin("GET", "/api/v1/hosts/gpu-1").json()["facts"]["hostname"] == "new"


def test_samples_from_alternating_replicas_merge_into_one_row_per_series_and_bucket(
    api: Api, other: TestClient
) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    replicas = [api.client, other]
    instance_id = beat(api.client, agent).instances[0].instance_id
    for step in range(1, 14):  # 2.5 s apart, alternating; the last two close bucket 3 on both
        api.clock.advance(2.5)
        metrics = [{"instance_id": instance_id, "counters": {"requests": 1.0},
                    "gauges": {"queue_depth": float(step)}}]  # fmt: skip
        beat(replicas[step % 2], agent, gpus=[gpu(0)], metrics=metrics)
    with api.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT name, COUNT(*), COUNT(DISTINCT time), SUM(value) FROM metricsample "
                "GROUP BY name"
            )
        ).all()
    by_name = {name: (count, times, total) for name, count, times, total in rows}
    # Buckets [0, 10), [10, 20), [20, 30) closed: 3 + 4 + 4 requests, one row each.
    assert by_name["requests"] == (3, 3, 11.0)
    assert by_name["queue_depth"][:2] == (3, 3)
    assert by_name["gpu0.utilization_percent"][:2] == (3, 3)


def test_a_token_revoked_on_one_replica_fails_at_once_on_the_other(
    api: Api, other: TestClient
) -> None:
    agent = api.register("gpu-1")["agent_token"]
    beat(other, agent)  # the other replica now has the token cached
    key_id = agent.split("_")[1]
    assert api.as_admin("DELETE", f"/api/v1/tokens/{key_id}").status_code == 200
    refused = other.post(HEARTBEAT, headers={"Authorization": f"Bearer {agent}"}, json={})
    assert refused.status_code == 401 and "revoked" in refused.json()["message"]
    assert scalar(api, "SELECT last_seen_at FROM host") == scalar(
        api, "SELECT registered_at FROM host"
    )  # the refused heartbeat wrote nothing


def test_only_the_lease_holder_runs_the_controllers(api: Api, other: TestClient) -> None:
    leader, standby = api.app.state.controllers, other.app.state.controllers
    api.register("gpu-1")
    assert leader.step() and not standby.step()
    for _ in range(15):  # 15 s of silence = 3 intervals: the sweep marks the host not_ready
        api.clock.advance(1)
        assert not standby.step()
        assert api.as_admin("GET", "/api/v1/hosts/gpu-1").json()["state"] == "ready"
        assert leader.step()
    assert api.as_admin("GET", "/api/v1/hosts/gpu-1").json()["state"] == "not_ready"
    text = api.client.get("/metrics").text
    assert f'dctl_controller_leader{{holder="{leader.lease.holder}"}} 1.0' in text
    text = other.get("/metrics").text
    assert f'dctl_controller_leader{{holder="{standby.lease.holder}"}} 0.0' in text
