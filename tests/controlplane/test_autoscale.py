"""Autoscaling through the real API: the policy endpoints, and the autoscaler controller (the
app's own, ticked by the test) following the load an agent reports in its heartbeats."""

from __future__ import annotations

from typing import Any

from controlplane.autoscaler.controller import AutoscaleController
from controlplane.services.autoscale import RETIRE_DRAIN_S
from protocol.rest import DeploymentOut
from tests.controlplane.conftest import Api, deploy
from tests.controlplane.fleet import ADDRESS, V1_DIGEST, V2_DIGEST, beat, serving_fleet

V = "/api/v1"
FAST = {"min": 1, "max": 6, "target_queue": 4, "up_after_s": 10, "down_after_s": 60,
        "cooldown_s": 5}  # fmt: skip


def controller(api: Api) -> AutoscaleController:
    [found] = [c for c in api.app.state.controllers.controllers if c.name == "autoscaler"]
    assert isinstance(found, AutoscaleController)
    return found


def show(api: Api, name: str = "web") -> DeploymentOut:
    response = api.as_admin("GET", f"{V}/deployments/{name}")
    assert response.status_code == 200, response.text
    return DeploymentOut.model_validate(response.json())


def autoscale(api: Api, name: str = "web", **policy: Any) -> Any:
    return api.as_admin("PUT", f"{V}/deployments/{name}/autoscale", json={**FAST, **policy})


def load_beat(
    api: Api, agent: str, running: int = 0, waiting: int = 0, digests: dict[str, str] | None = None
) -> None:
    """Heartbeats reporting every desired instance ready, each with this load (and running the
    digest of its desired version, or DIGESTS[str(id)])."""
    digests = digests or {}
    # The agent holds both versions' snapshots (a rollout's pre-staging passes at once).
    facts = {"snapshots": sorted([V1_DIGEST, V2_DIGEST])}
    desired = beat(api, agent, advertise_address=ADDRESS, facts=facts)["instances"]
    observed = [
        {"instance_id": i["instance_id"], "state": "ready", "port": i["port"],
         "version_digest": digests.get(str(i["instance_id"]), i["model"]["digest"])}
        for i in desired
    ]  # fmt: skip
    metrics = [
        {"instance_id": i["instance_id"],
         "gauges": {"dllm_requests_running": running, "dllm_requests_waiting": waiting}}
        for i in desired
    ]  # fmt: skip
    beat(api, agent, instances=observed, metrics=metrics, advertise_address=ADDRESS, facts=facts)


def tick(api: Api, seconds: float = 0) -> None:
    api.clock.advance(seconds)
    controller(api).tick(api.clock())


def routed(api: Api, name: str = "web") -> list[int]:
    table = api.call("GET", f"{V}/routes", api.token("gateway")).json()
    [route] = [d for d in table["deployments"] if d["deployment"] == name]
    return sorted(i["id"] for i in route["stable"]["instances"])


def events(api: Api, kind: str) -> list[dict[str, Any]]:
    found = api.as_admin("GET", f"{V}/events", params={"kind": kind}).json()
    return list(found["items"])


def test_a_policy_takes_over_the_count_and_shows_where_it_stands(api: Api) -> None:
    serving_fleet(api, per_host=2)
    response = autoscale(api, min=3, standby=1, gpus_per_instance=None)
    assert response.status_code == 422  # a typo in the policy is refused, naming it
    assert "gpus_per_instance" in response.text
    assert autoscale(api, min=3, max=2).status_code == 422
    response = autoscale(api, min=3, standby=1)
    assert response.status_code == 200, response.text
    out = DeploymentOut.model_validate(response.json())
    assert out.autoscale is not None and out.autoscale_status is not None
    assert (out.autoscale_status.replicas, out.autoscale_status.standby) == (3, 1)
    assert len(out.instances) == 4 and sum(i.standby for i in out.instances) == 1
    # Instances per host is no longer the operator's to set while it autoscales.
    response = api.as_admin("PATCH", f"{V}/deployments/web", json={"instances_per_host": 5})
    assert response.status_code == 409 and "--off" in response.text
    # Off: it keeps its 3 serving instances; the standby one stops.
    response = api.as_admin("DELETE", f"{V}/deployments/web/autoscale")
    assert response.status_code == 200, response.text
    out = DeploymentOut.model_validate(response.json())
    assert out.autoscale is None and len(out.instances) == 3
    assert not any(i.standby for i in out.instances)


def test_a_burst_scales_up_after_up_after_and_the_event_says_why(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    assert autoscale(api).status_code == 200
    load_beat(api, agent, running=10, waiting=40)
    tick(api)
    tick(api, 9)
    assert show(api).autoscale_status.replicas == 1  # type: ignore[union-attr]
    tick(api, 1)
    status = show(api).autoscale_status
    assert status is not None and status.replicas == 6  # ceil(1 x 40 / 4) = 10, max 6
    assert status.last_decision is not None and status.last_decision.action == "up"
    [event] = events(api, "autoscale.up")
    assert event["data"]["figures"]["waiting"] == 40 and event["data"]["to"] == 6
    assert len(show(api).instances) == 6


def test_standby_is_out_of_the_pools_until_a_scale_up_promotes_it(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    assert autoscale(api, standby=1).status_code == 200
    load_beat(api, agent)
    first = show(api).instances
    [spare] = [i.id for i in first if i.standby]
    assert spare not in routed(api) and len(routed(api)) == 1
    load_beat(api, agent, running=10, waiting=6)  # 6 waiting on the one serving instance
    tick(api)
    tick(api, 10)
    # Promoted without a new heartbeat: it was loaded and ready already.
    assert spare in routed(api)
    after = show(api).instances
    # ceil(1 x 6 / 4) = 2 serving, and a new standby loading in the promoted one's place.
    assert len(after) == 3 and [i.id for i in after if i.standby] != [spare]
    assert sum(i.standby for i in after) == 1


def test_idle_scales_down_out_of_the_routes_first_then_stops(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    assert autoscale(api, min=1, max=4).status_code == 200
    api.as_admin("PUT", f"{V}/deployments/web/autoscale", json={**FAST, "min": 3, "max": 4})
    api.as_admin("PUT", f"{V}/deployments/web/autoscale", json={**FAST, "min": 1, "max": 4})
    load_beat(api, agent, running=0)
    assert len(routed(api)) == 3
    tick(api)
    tick(api, 60)
    retiring = [i for i in show(api).instances if i.retiring]
    assert len(retiring) == 2
    assert not {i.id for i in retiring} & set(routed(api))  # gateways stop sending first
    desired = {i["instance_id"] for i in beat(api, agent, advertise_address=ADDRESS)["instances"]}
    assert {i.id for i in retiring} <= desired  # ...while their engines still run
    tick(api, RETIRE_DRAIN_S)
    desired = {i["instance_id"] for i in beat(api, agent, advertise_address=ADDRESS)["instances"]}
    assert len(desired) == 1 and not {i.id for i in retiring} & desired
    [event] = events(api, "autoscale.down")
    assert event["data"]["to"] == 1 and sorted(event["data"]["retired"]) == sorted(
        i.id for i in retiring
    )


def test_scaled_to_zero_a_gateway_wakes_it(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    assert autoscale(api, min=0, cold_start_timeout_s=30).status_code == 200
    load_beat(api, agent)
    tick(api)
    tick(api, 60)
    tick(api, RETIRE_DRAIN_S)
    assert show(api).instances == [] and show(api).autoscale_status.replicas == 0  # type: ignore[union-attr]
    table = api.call("GET", f"{V}/routes", api.token("gateway")).json()
    [route] = table["deployments"]
    assert route["cold_start_timeout_s"] == 30 and route["stable"]["instances"] == []
    gateway = api.token("gateway")
    assert api.call("POST", f"{V}/deployments/web/wake", gateway).status_code == 202
    assert api.call("POST", f"{V}/deployments/nope/wake", gateway).status_code == 404
    tick(api, 1)
    assert len(show(api).instances) == 1
    [event] = events(api, "autoscale.wake")
    assert event["data"]["to"] == 1
    # With an instance, a wake is a no-op.
    assert api.call("POST", f"{V}/deployments/web/wake", gateway).status_code == 204


def test_a_rollout_keeps_its_share_while_the_count_grows(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    assert autoscale(api, min=4, max=8, standby=1).status_code == 200
    load_beat(api, agent)
    body = {"to": "v2", "steps": [25, 100], "policy": {"interval_s": 600}}
    response = api.as_admin("POST", f"{V}/deployments/web/rollout", json=body)
    assert response.status_code == 201, response.text
    rollouts = next(c for c in api.app.state.controllers.controllers if c.name == "rollouts")
    canary_digests: dict[str, str] = {}
    for _ in range(4):
        for inst in show(api).instances:
            if inst.version == "v2":
                canary_digests[str(inst.id)] = V2_DIGEST
        load_beat(api, agent, digests=canary_digests)
        rollouts.tick(api.clock())
    out = show(api)
    rollout = api.as_admin("GET", f"{V}/deployments/web/rollout").json()
    assert out.canary_weight == 25, rollout["message"]
    serving = [i for i in out.instances if not i.standby and not i.retiring]
    assert [i.version for i in serving].count("v2") == 1
    load_beat(api, agent, running=10, waiting=40, digests=canary_digests)
    tick(api)
    tick(api, 10)
    out = show(api)
    serving = [i for i in out.instances if not i.standby and not i.retiring]
    assert len(serving) == 8
    assert [i.version for i in serving].count("v2") == 2  # 25% of 8
    assert all(i.version == "v1" for i in out.instances if i.standby)
    assert out.canary_weight == 25  # the step's weight is the rollout's, untouched


def test_a_scale_up_that_does_not_fit_is_an_event_and_a_starved_status(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    # web holds 1 of the 8 GPUs; another deployment holds 6.
    assert api.as_admin("PATCH", f"{V}/deployments/web",
                        json={"gpus_per_instance": 1}).status_code == 200  # fmt: skip
    assert deploy(api, "batch", ["gpu-1"], per_host=6, gpus_per_instance=1).status_code == 201
    assert autoscale(api, max=4).status_code == 200
    load_beat(api, agent, running=10, waiting=40)
    tick(api)
    tick(api, 10)
    status = show(api).autoscale_status
    assert status is not None and status.replicas == 4 and status.placed == 2
    assert status.starved_since is not None and "room for 2" in status.starved_reason
    [event] = events(api, "autoscale.unplaced")
    assert "free GPUs" in event["message"]
    # The GPUs come free: the next placement round gives it the rest.
    assert api.as_admin("DELETE", f"{V}/deployments/batch").status_code == 204
    tick(api, 10)
    status = show(api).autoscale_status
    assert status is not None and status.placed == 4 and status.starved_since is None


def test_a_heartbeat_without_an_engines_figures_keeps_its_last_load_a_while(api: Api) -> None:
    # An agent's scrape of a busy engine can time out: its queue is not read as empty then.
    agent = serving_fleet(api, per_host=1)
    load_beat(api, agent, running=2, waiting=9)
    desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
    observed = [{"instance_id": i["instance_id"], "state": "ready", "port": i["port"],
                 "version_digest": i["model"]["digest"]} for i in desired]  # fmt: skip
    beat(api, agent, instances=observed, advertise_address=ADDRESS)  # no metrics at all
    [inst] = show(api).instances
    assert (inst.requests_running, inst.requests_waiting) == (2, 9)
    api.clock.advance(16)
    beat(api, agent, instances=observed, advertise_address=ADDRESS)
    [inst] = show(api).instances
    assert (inst.requests_running, inst.requests_waiting) == (None, None)  # too old to stand
