"""What the heartbeat reply tells an agent: bind address, GPU indices and API key per instance."""

from __future__ import annotations

import json

import sqlalchemy as sa

from protocol.wire import HeartbeatReply
from tests.controlplane.conftest import Api, deploy, register_version


def reply(api: Api, token: str, **body: object) -> HeartbeatReply:
    response = api.heartbeat(token, **body)
    assert response.status_code == 200, response.text
    return HeartbeatReply(**response.json())


def set_instances(api: Api, host: str, key_prefix: str, gpus: list[int]) -> None:
    """Give the host's instances keys and GPUs, as the planner does, and bump its generation."""
    with api.engine.begin() as conn:
        host_id = conn.execute(sa.text("SELECT id FROM host WHERE name = :n"), {"n": host}).scalar()
        conn.execute(
            sa.text(
                "UPDATE instance SET api_key = :key || CAST(id AS VARCHAR), gpu_indices = :gpus "
                "WHERE host_id = :h"
            ),
            {"key": key_prefix, "gpus": json.dumps(gpus), "h": host_id},
        )
        conn.execute(
            sa.text("UPDATE host SET desired_generation = desired_generation + 1 WHERE id = :h"),
            {"h": host_id},
        )


def test_engines_bind_to_the_advertise_address_from_registration_then_heartbeats(
    api: Api,
) -> None:
    register_version(api)
    agent = api.register("gpu-1", advertise_address="10.1.2.3")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    first = reply(api, agent, advertise_address="10.1.2.3")
    assert [i.bind_address for i in first.instances] == ["10.1.2.3"]
    assert reply(api, agent, advertise_address="10.1.2.3").generation == first.generation
    moved = reply(api, agent, advertise_address="gpu-1.example")
    assert moved.generation > first.generation
    assert moved.instances[0].bind_address == "gpu-1.example"
    # An agent that reports no address: engines listen on loopback only.
    silent = reply(api, agent)
    assert silent.generation > moved.generation
    assert silent.instances[0].bind_address == "127.0.0.1"
    events = api.as_admin("GET", "/api/v1/events", params={"kind": "host.address_changed"})
    assert [e["data"]["current"] for e in events.json()["items"]] == ["gpu-1.example", None]


def test_reregistering_with_a_new_address_is_a_new_desired_state(api: Api) -> None:
    register_version(api)
    api.register("gpu-1", advertise_address="10.0.0.1")
    deploy(api, "web", ["gpu-1"])
    token = api.register("gpu-1", advertise_address="10.0.0.1")["agent_token"]
    before = reply(api, token, advertise_address="10.0.0.1")
    token = api.register("gpu-1", advertise_address="10.0.0.2")["agent_token"]
    after = reply(api, token, advertise_address="10.0.0.2")
    assert after.generation > before.generation
    assert after.instances[0].bind_address == "10.0.0.2"


def test_each_agent_gets_its_own_instances_keys_and_gpus_only(api: Api) -> None:
    register_version(api)
    agent_a = api.register("host-a")["agent_token"]
    agent_b = api.register("host-b")["agent_token"]
    deploy(api, "web", ["host-a", "host-b"], per_host=2)
    set_instances(api, "host-a", "key-a-", [0, 1])
    set_instances(api, "host-b", "key-b-", [2])
    raw_a = api.heartbeat(agent_a).content
    a = HeartbeatReply.model_validate_json(raw_a)
    assert [i.api_key for i in a.instances] == [f"key-a-{i.instance_id}" for i in a.instances]
    assert all(i.gpu_indices == [0, 1] for i in a.instances)
    assert b"key-b-" not in raw_a
    b = reply(api, agent_b)
    assert {i.api_key for i in b.instances} == {f"key-b-{i.instance_id}" for i in b.instances}
    assert all(i.gpu_indices == [2] for i in b.instances)
    # Keys never leave through the operators' API.
    for path in ("/api/v1/hosts/host-a", "/api/v1/deployments/web"):
        assert "key-a-" not in api.as_admin("GET", path).text


def test_an_instance_without_a_key_is_sent_without_one(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    with api.engine.begin() as conn:
        conn.execute(sa.text("UPDATE instance SET api_key = ''"))
        conn.execute(sa.text("UPDATE host SET desired_generation = desired_generation + 1"))
    [inst] = reply(api, agent).instances
    assert inst.api_key is None and inst.gpu_indices == []
