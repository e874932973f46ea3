"""Manual canary: exactly N instances run the canary version (and their agents may fetch it), the
routing table carries its pool and weight, DELETE puts everything back; bad requests are named."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx

from protocol.gateway import CanaryOut, RouteTable
from protocol.rollout_states import RolloutState
from tests.controlplane.conftest import Api, deploy, manifest, register_version
from tests.controlplane.fleet import ADDRESS, V2_DIGEST, beat, gpu_host, report, serving_fleet

V = "/api/v1"


def put(api: Api, token: str | None = None, name: str = "web", **body: Any) -> httpx.Response:
    response: httpx.Response = api.call(
        "PUT", f"{V}/deployments/{name}/canary", token or api.admin, json=body
    )
    return response


def versions(api: Api, name: str = "web") -> Counter[str]:
    """How many of the deployment's instances run each version tag."""
    body = api.as_admin("GET", f"{V}/deployments/{name}").json()
    return Counter(i["version"] for i in body["instances"])


def test_a_canary_runs_on_exactly_n_instances_and_delete_puts_them_back(api: Api) -> None:
    agent = serving_fleet(api, per_host=4)
    operator = api.token("operator")
    started = put(api, operator, version="v2", weight=20, instances=2)
    assert started.status_code == 200, started.text
    assert CanaryOut.model_validate(started.json()) == CanaryOut(
        deployment="web", stable="demo:v1", canary="demo:v2", weight=20, instances=2,
        state=RolloutState.PROGRESSING,
    )  # fmt: skip
    assert versions(api) == {"v1": 2, "v2": 2}
    shown = api.as_admin("GET", f"{V}/deployments/web").json()
    assert (shown["version"], shown["canary_version"], shown["canary_weight"]) == ("v1", "v2", 20)
    # The agent is told: two of its instances now run demo:v2.
    desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
    assert Counter(i["model"]["version"] for i in desired) == {"v1": 2, "v2": 2}
    assert {i["model"]["digest"] for i in desired if i["model"]["version"] == "v2"} == {V2_DIGEST}

    # Fewer canary instances: the others return to stable; the weight follows.
    changed = put(api, operator, version="v2", weight=50, instances=1)
    assert changed.status_code == 200 and changed.json()["weight"] == 50
    assert versions(api) == {"v1": 3, "v2": 1}
    # The same again changes nothing and records nothing.
    assert put(api, operator, version="v2", weight=50, instances=1).status_code == 200

    ended = api.call("DELETE", f"{V}/deployments/web/canary", operator)
    assert ended.status_code == 200, ended.text
    assert CanaryOut.model_validate(ended.json()) == CanaryOut(
        deployment="web", stable="demo:v1", canary="demo:v2", weight=0, instances=0,
        state=RolloutState.ROLLED_BACK,
    )  # fmt: skip
    assert versions(api) == {"v1": 4}
    shown = api.as_admin("GET", f"{V}/deployments/web").json()
    assert (shown["canary_version"], shown["canary_weight"]) == (None, 0)
    desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
    assert {i["model"]["version"] for i in desired} == {"v1"}
    again = api.call("DELETE", f"{V}/deployments/web/canary", operator)
    assert again.status_code == 404
    assert again.json()["message"] == "active canary of deployment 'web' not found"

    events = api.as_admin("GET", f"{V}/events", params={"kind": "canary.*"}).json()["items"]
    assert [e["kind"] for e in events] == ["canary.started", "canary.updated", "canary.ended"]
    assert events[0]["message"] == (
        "canary demo:v2 of deployment web started: 20% of requests, 2 instance(s)"
    )
    assert all(e["subject"] == "deployment/web" for e in events)
    assert all(e["actor"].startswith("token:t-operator") for e in events)


def test_the_routing_table_follows_the_canary(api: Api) -> None:
    agent = serving_fleet(api, per_host=3)
    gateway = api.token("gateway")
    report(api, agent)
    assert put(api, version="v2", weight=20, instances=1).status_code == 200

    def table() -> RouteTable:
        return RouteTable.model_validate(api.call("GET", f"{V}/routes", gateway).json())

    moved = table()
    [web] = moved.deployments
    assert web.canary is not None and web.canary.version == "demo:v2" and web.canary_weight == 20
    # The instance moved to v2 still runs v1 until its agent restarted it: in neither pool.
    assert web.canary.instances == [] and len(web.stable.instances) == 2
    desired = report(api, agent)
    [canary_id] = [i["instance_id"] for i in desired if i["model"]["version"] == "v2"]
    restarted = table()
    assert restarted.etag != moved.etag
    canary_pool = restarted.deployments[0].canary
    assert canary_pool is not None and [i.id for i in canary_pool.instances] == [canary_id]

    assert put(api, version="v2", weight=60, instances=1).status_code == 200
    reweighted = table()
    assert reweighted.deployments[0].canary_weight == 60 and reweighted.etag != restarted.etag

    assert api.as_admin("DELETE", f"{V}/deployments/web/canary").status_code == 200
    ended = table().deployments[0]
    assert ended.canary is None and ended.canary_weight == 0


def test_bad_canaries_are_refused_with_what_to_do(api: Api) -> None:
    serving_fleet(api, per_host=2)
    register_version(api, version="v3", manifest=manifest("config.json", seed=3))
    register_version(api, version="old", manifest=manifest("config.json", seed=4))
    assert api.as_admin("POST", f"{V}/models/demo/versions/old/deprecate").status_code == 200

    def refused(status: int, **body: Any) -> str:
        response = put(api, **body)
        assert response.status_code == status, response.text
        message: str = response.json()["message"]
        return message

    assert refused(404, version="v9", weight=10) == "version 'v9' of model 'demo' not found"
    assert refused(404, name="nope", version="v2", weight=10) == "deployment 'nope' not found"
    assert "stable version of deployment web" in refused(409, version="v1", weight=10)
    deprecated = refused(422, version="old", weight=10)
    assert deprecated == "demo:old is deprecated: deploy a newer version"
    too_many = refused(422, version="v2", weight=10, instances=2)
    assert "runs 2 instance(s); a canary may take at most 1" in too_many and "scale" in too_many
    assert "weight" in refused(422, version="v2", weight=101)
    assert "version" in refused(422, version="demo:v2", weight=10)
    assert versions(api) == {"v1": 2}  # nothing of it written

    assert put(api, version="v2", weight=10).status_code == 200
    other = refused(409, version="v3", weight=10)
    assert "already has a canary of demo:v2: end it first" in other
    assert "DELETE /api/v1/deployments/web/canary" in other
    # The stable version cannot move under a running canary; scaling keeps the canary.
    patch = api.as_admin("PATCH", f"{V}/deployments/web", json={"version": "v3"})
    assert patch.status_code == 409 and "active canary" in patch.json()["message"]
    assert api.as_admin("PATCH", f"{V}/deployments/web", json={"version": "v1"}).is_success
    scaled = api.as_admin("PATCH", f"{V}/deployments/web", json={"instances_per_host": 5})
    assert scaled.status_code == 200
    assert versions(api) == {"v1": 4, "v2": 1}
    assert api.as_admin("GET", f"{V}/deployments/web").json()["canary_version"] == "v2"


def test_a_host_joining_the_fleet_keeps_the_canary_count(api: Api) -> None:
    register_version(api)
    register_version(api, version="v2", manifest=manifest("config.json", seed=2))
    gpu_host(api, "gpu-1", stamp={"pool": "a"})
    body = {"name": "web", "model": "demo", "version": "v1", "placement": {"labels": {"pool": "a"}},
            "instances_per_host": 2}  # fmt: skip
    assert api.as_admin("POST", f"{V}/deployments", json=body).status_code == 201
    assert put(api, version="v2", weight=10, instances=1).status_code == 200
    gpu_host(api, "gpu-2", stamp={"pool": "a"})  # placed by the fleet planner
    assert versions(api) == {"v1": 3, "v2": 1}


def test_the_agent_running_a_canary_may_fetch_its_files(api: Api, tmp_path: Any) -> None:
    register_version(api)
    register_version(api, version="v2", manifest=manifest("w.bin", seed=2), source=str(tmp_path))
    agent = gpu_host(api)
    assert deploy(api, "web", ["gpu-1"], per_host=2).status_code == 201
    path = f"{V}/models/demo/versions/v2/files/config.json"
    before = api.call("GET", path, agent)
    assert before.status_code == 403 and "may fetch only" in before.json()["message"]
    assert put(api, version="v2", weight=10).status_code == 200
    desired = beat(api, agent)["instances"]
    [canary] = [i for i in desired if i["model"]["version"] == "v2"]
    assert canary["model"]["files_url"] == "/api/v1/models/demo/versions/v2/files/"
    allowed = api.call("GET", path, agent)
    # Allowed now: what remains is that the manifest names no such file.
    assert allowed.status_code == 404 and allowed.json()["error"] == "not_found"
    assert api.as_admin("DELETE", f"{V}/deployments/web/canary").status_code == 200
    assert api.call("GET", path, agent).status_code == 403
