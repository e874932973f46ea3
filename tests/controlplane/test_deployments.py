"""Deployments through the real API: GPU assignment, memory and engine-config checks with
messages a person can act on, instance keys kept from readers, listing cost."""

from __future__ import annotations

import json
from typing import Any

from sqlmodel import Session, select

from controlplane.models import Instance
from tests.controlplane.conftest import Api, deploy, register_version, statements
from tests.controlplane.fleet import beat, gpu_host, serving_fleet

GIB = 2**30


def indices(response: Any) -> list[list[int]]:
    """GPU indices of a deployment's instances, in id order."""
    return [i["gpu_indices"] for i in response.json()["instances"]]


def patch(api: Api, name: str, **body: Any) -> Any:
    """PATCH a deployment with the admin token."""
    return api.as_admin("PATCH", f"/api/v1/deployments/{name}", json=body)


def test_instances_get_disjoint_gpus_and_what_does_not_fit_is_refused(api: Api) -> None:
    register_version(api)
    agent = gpu_host(api)
    web = deploy(api, "web", ["gpu-1"], per_host=2, gpus_per_instance=2)
    assert web.status_code == 201, web.text
    assert web.json()["gpus_per_instance"] == 2
    assert indices(web) == [[0, 1], [2, 3]]
    desired = beat(api, agent)["instances"]
    assert [i["gpu_indices"] for i in desired] == [[0, 1], [2, 3]]

    refused = deploy(api, "api", ["gpu-1"], per_host=2, gpus_per_instance=4)
    assert refused.status_code == 422
    message = refused.json()["message"]
    assert "host gpu-1" in message and "8 GPU(s) asked" in message and "4 free of 8" in message
    assert api.as_admin("GET", "/api/v1/deployments/api").status_code == 404  # nothing written

    assert indices(patch(api, "web", gpus_per_instance=1)) == [[0], [1]]
    assert indices(deploy(api, "api", ["gpu-1"], per_host=2, gpus_per_instance=3)) == [
        [2, 3, 4],
        [5, 6, 7],
    ]
    all_gpus = patch(api, "web", gpus_per_instance=0)
    assert all_gpus.status_code == 422
    assert "asks all 8 GPUs, 2 are free" in all_gpus.json()["message"]
    assert indices(api.as_admin("GET", "/api/v1/deployments/web")) == [[0], [1]]  # unchanged


def test_memory_that_does_not_fit_is_refused_with_both_figures(api: Api) -> None:
    plan = {"weights_bytes": 150 * GIB, "kv_bytes_per_token": 16 * 1024}
    register_version(api, memory_plan=plan)
    gpu_host(api)
    one = deploy(api, "web", ["gpu-1"], gpus_per_instance=1)
    assert one.status_code == 422
    message = one.json()["message"]
    # 150 GiB of weights + 4096 × 32 tokens × 16 KiB = 2 GiB of KV reserve, on one 141 GiB GPU.
    assert "needs 152.0 GiB" in message and "its GPU has 141.0 GiB" in message
    assert "KV reserve 2.0 GiB for 131072 tokens" in message and "host gpu-1" in message
    two = deploy(api, "web", ["gpu-1"], gpus_per_instance=2)
    assert two.status_code == 201, two.text
    # A longer context for more requests is a bigger KV reserve: 8192 × 2048 tokens = 256 GiB,
    # of which each of the two ranks holds half, beside half the weights: 75 + 128 GiB.
    config = {"model": {"max_seq_len": 8192}, "service": {"max_concurrent_requests": 2048}}
    bigger = patch(api, "web", engine_config=config)
    assert bigger.status_code == 422
    assert (
        "needs 203.0 GiB on each GPU" in bigger.json()["message"]
        and "the smallest of its 2 GPUs has 141.0 GiB" in bigger.json()["message"]
    )


def test_hosts_without_gpus_reported_take_instances_without_indices(api: Api) -> None:
    register_version(api, memory_plan={"weights_bytes": 2**60, "kv_bytes_per_token": 0})
    agent = api.register("gpu-1")["agent_token"]  # no heartbeat yet: GPUs unknown
    created = deploy(api, "web", ["gpu-1"], per_host=2, gpus_per_instance=2)
    assert created.status_code == 201, created.text
    assert indices(created) == [[], []]
    assert api.heartbeat(agent).status_code == 200


def test_names_of_rollout_subcommands_are_refused(api: Api) -> None:
    register_version(api)
    gpu_host(api)
    for name in ("status", "history", "abort"):
        response = deploy(api, name, ["gpu-1"])
        assert response.status_code == 422
        assert f"'{name}' is a `dctl rollout` subcommand" in response.json()["message"]
    assert deploy(api, "status-page", ["gpu-1"]).status_code == 201


def test_engine_config_is_validated_naming_the_key_and_stored_normalised(api: Api) -> None:
    register_version(api)
    gpu_host(api)
    cases = {
        "unknown key 'service.max_batch'": {"service": {"max_batch": 8}},
        "service.api_key cannot be set: API keys are managed per instance": {
            "service": {"api_key": "secret"}
        },
        "model.threshold": {"model": {"threshold": 2}},
        "model.served_name cannot be set: engines serve their deployment's name": {
            "model": {"served_name": "alias"}
        },
    }
    for needle, config in cases.items():
        response = deploy(api, "web", ["gpu-1"], engine_config=config)
        assert response.status_code == 422, config
        assert needle in response.json()["message"]
    created = deploy(api, "web", ["gpu-1"], engine_config={"model": {"threshold": 0.5}})
    assert created.json()["engine_config"] == {"model": {"threshold": 0.5}}
    bad = patch(api, "web", engine_config={"resources": {"device": "tpu"}})
    assert bad.status_code == 422 and "resources.device" in bad.json()["message"]
    shown = api.as_admin("GET", "/api/v1/deployments/web").json()
    assert shown["engine_config"] == {"model": {"threshold": 0.5}}


def test_instance_api_keys_never_reach_viewers_or_operators(api: Api) -> None:
    register_version(api)
    agent = gpu_host(api, advertise_address="10.0.0.7")
    assert deploy(api, "web", ["gpu-1"], per_host=3).status_code == 201
    with Session(api.engine) as session:
        keys = list(session.exec(select(Instance.api_key)).all())
    assert len(keys) == len(set(keys)) == 3 and all(k.startswith("dctl_ik_") for k in keys)
    # The host's own agent gets them, with the address its engines bind to.
    desired = beat(api, agent, advertise_address="10.0.0.7")["instances"]
    assert sorted(i["api_key"] for i in desired) == sorted(keys)

    for role in ("viewer", "operator"):
        token = api.token(role)
        paths = ["/api/v1/deployments", "/api/v1/deployments/web", "/api/v1/hosts",
                 "/api/v1/hosts/gpu-1", "/api/v1/events?limit=1000", "/api/v1/status"]  # fmt: skip
        bodies = [api.call("GET", path, token) for path in paths]
        if role == "operator":
            bodies.append(api.call("PATCH", "/api/v1/deployments/web", token,
                                   json={"instances_per_host": 4}))  # fmt: skip
            bodies.append(api.call("POST", "/api/v1/hosts/gpu-1/drain", token))
        for response in bodies:
            assert response.status_code == 200, response.text
            text = json.dumps(response.json())
            assert not any(key in text for key in keys), response.url
            assert "dctl_ik_" not in text
    host = api.as_admin("GET", "/api/v1/hosts/gpu-1").json()
    assert host["advertise_address"] == "10.0.0.7"


def test_listing_deployments_costs_the_same_for_one_or_five(api: Api) -> None:
    register_version(api)
    gpu_host(api)
    viewer = api.token("viewer")

    def listing_statements(total: int) -> int:
        api.call("GET", "/api/v1/deployments", viewer)  # the token's last-use write, once
        with statements(api) as seen:
            listed = api.call("GET", "/api/v1/deployments", viewer).json()
        assert len(listed) == total and all(len(d["instances"]) == 2 for d in listed)
        return len(seen)

    assert deploy(api, "web-0", ["gpu-1"], per_host=2).status_code == 201
    one = listing_statements(1)
    for n in range(1, 5):
        assert deploy(api, f"web-{n}", ["gpu-1"], per_host=2).status_code == 201
    assert listing_statements(5) == one


def test_listing_models_costs_the_same_for_one_or_five(api: Api) -> None:
    viewer = api.token("viewer")

    def listing_statements(total: int) -> int:
        api.call("GET", "/api/v1/models", viewer)  # the token's last-use write, once
        with statements(api) as seen:
            listed = api.call("GET", "/api/v1/models", viewer).json()
        assert len(listed) == total and all(len(m["versions"]) == 2 for m in listed)
        return len(seen)

    def model_with_versions(name: str) -> None:
        register_version(api, name, "v1")
        register_version(api, name, "v2", parent=f"{name}:v1")

    model_with_versions("demo-0")
    one = listing_statements(1)
    for n in range(1, 5):
        model_with_versions(f"demo-{n}")
    assert listing_statements(5) == one
    # Same bodies as one model at a time (each version with its own model and parent).
    listed = api.call("GET", "/api/v1/models", viewer).json()
    assert listed == [api.call("GET", f"/api/v1/models/{m['name']}", viewer).json() for m in listed]
    assert [v["parent"] for v in listed[3]["versions"]] == [None, "demo-3:v1"]


def test_a_host_change_places_what_fits_and_says_what_does_not(api: Api) -> None:
    register_version(api)
    gpu_host(api, stamp={"pool": "a"})
    body = {"name": "web", "model": "demo", "version": "v1", "placement": {"labels": {"pool": "a"}},
            "instances_per_host": 2}  # fmt: skip
    assert api.as_admin("POST", "/api/v1/deployments", json=body).status_code == 201
    # A second host of the pool with room for one instance only: it registers all the same.
    api.register("gpu-2", stamp={"pool": "a"}, port_range=[18000, 18000])
    shown = api.as_admin("GET", "/api/v1/deployments/web").json()
    assert sorted(i["host"] for i in shown["instances"]) == ["gpu-1", "gpu-1"]
    events = api.as_admin("GET", "/api/v1/events", params={"kind": "deployment.unplaced"}).json()
    [event] = events["items"]
    assert event["subject"] == "deployment/web" and "no free port" in event["message"]
    assert event["data"] == {"host": "gpu-2", "reason": "ports"}


def test_drained_host_reports_its_new_generation(api: Api) -> None:
    register_version(api)
    agent = gpu_host(api)
    deploy(api, "web", ["gpu-1"])
    drained = api.as_admin("POST", "/api/v1/hosts/gpu-1/drain").json()
    assert drained["desired_generation"] == beat(api, agent)["generation"]
    assert [i["desired_state"] for i in drained["instances"]] == ["stopped"]


def test_gpus_reported_after_placement_are_assigned_and_the_host_is_told(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]  # no heartbeat yet: GPUs unknown
    created = deploy(api, "web", ["gpu-1"], per_host=2, gpus_per_instance=2)
    assert indices(created) == [[], []]
    before = api.heartbeat(agent).json()["generation"]
    beat(api, agent)  # the host now reports 8 GPUs
    web = api.as_admin("GET", "/api/v1/deployments/web")
    assigned = indices(web)
    assert all(len(i) == 2 for i in assigned) and not set(assigned[0]) & set(assigned[1])
    reply = beat(api, agent)
    assert reply["generation"] > before
    assert sorted(i["gpu_indices"] for i in reply["instances"]) == sorted(assigned)
    again = beat(api, agent)  # the same GPUs again: nothing moves
    assert again["generation"] == reply["generation"]


def test_a_patched_stable_version_is_what_a_rollback_goes_back_from(api: Api) -> None:
    # A PATCH of the version keeps the one it replaced as the rollback target, as a promotion
    # does, so `dctl rollback` afterwards returns to it (and not to an older target).
    serving_fleet(api, per_host=2)
    register_version(api, version="v3")
    for version in ("v2", "v3"):
        moved = api.as_admin("PATCH", "/api/v1/deployments/web", json={"version": version})
        assert moved.status_code == 200, moved.text
    back = api.as_admin("POST", "/api/v1/deployments/web/rollback", json={})
    assert back.status_code == 201, back.text
    assert (back.json()["from"], back.json()["to"]) == ("demo:v3", "demo:v2")
    shown = api.as_admin("GET", "/api/v1/deployments/web").json()
    assert shown["rollback_version"] == "v2"
