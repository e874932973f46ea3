"""/metrics says where each deployment's rollout stands, as `dctl rollout status` does: its
versions, state and phase (`dctl_rollout_info`), step and canary weight."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from protocol.rollout_states import RolloutState
from tests.controlplane.conftest import Api, deploy
from tests.controlplane.fleet import serving_fleet

V = "/api/v1"


def rollout_series(api: Api) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The `dctl_rollout_*` samples of one scrape, by metric name."""
    text = api.client.get("/metrics").text
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
        if family.name.startswith("dctl_rollout_")
    }


def status_phase(api: Api) -> str:
    response = api.as_admin("GET", f"{V}/deployments/web/rollout")
    assert response.status_code == 200, response.text
    phase: str = response.json()["phase"]
    return phase


def test_each_deployments_latest_rollout_is_on_metrics_with_its_weight(api: Api) -> None:
    serving_fleet(api, per_host=4)
    assert deploy(api, "idle", ["gpu-1"]).status_code == 201
    # Deployments that never had a rollout have no series.
    assert rollout_series(api) == {
        "dctl_rollout_info": [], "dctl_rollout_step": [], "dctl_rollout_weight": [],
    }  # fmt: skip

    operator = api.token("operator")
    canary = {"version": "v2", "weight": 20, "instances": 2}
    put = api.call("PUT", f"{V}/deployments/web/canary", operator, json=canary)
    assert put.status_code == 200, put.text
    series = rollout_series(api)
    assert series["dctl_rollout_info"] == [(
        {"deployment": "web", "from": "demo:v1", "to": "demo:v2", "state": RolloutState.PROGRESSING,
         "phase": status_phase(api)},
        1.0,
    )]  # fmt: skip
    assert series["dctl_rollout_weight"] == [({"deployment": "web"}, 20.0)]
    assert series["dctl_rollout_step"] == [({"deployment": "web"}, 0.0)]

    # Ended, it is still the latest: state rolled_back, no traffic on the canary.
    assert api.call("DELETE", f"{V}/deployments/web/canary", operator).status_code == 200
    series = rollout_series(api)
    [(labels, _)] = series["dctl_rollout_info"]
    assert (labels["state"], labels["to"]) == (RolloutState.ROLLED_BACK, "demo:v2")
    assert series["dctl_rollout_weight"] == [({"deployment": "web"}, 0.0)]

    # A new rollout replaces it (one series per deployment); paused is what the alert reads.
    body = {"to": "v2", "canary": 25, "policy": {"interval_s": 60, "min_requests": 10}}
    assert api.as_admin("POST", f"{V}/deployments/web/rollout", json=body).status_code == 201
    paused = api.as_admin("POST", f"{V}/deployments/web/rollout/pause", json={})
    assert paused.status_code == 200, paused.text
    series = rollout_series(api)
    assert series["dctl_rollout_info"] == [(
        {"deployment": "web", "from": "demo:v1", "to": "demo:v2", "state": RolloutState.PAUSED,
         "phase": status_phase(api)},
        1.0,
    )]  # fmt: skip
    assert series["dctl_rollout_weight"] == [({"deployment": "web"}, 0.0)]
