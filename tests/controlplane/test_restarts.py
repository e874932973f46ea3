"""Rolling restarts beside re-plans: a `deploy scale`, a drain or a GPU change while a restart is
under way re-plans the deployment, and neither may undo the other. The planner is the one writer
of desired states; the restart is one of its inputs (the instance it holds stopped)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from controlplane.rollouts.controller import RolloutController
from protocol.rollout_states import RestartStage, RolloutState
from protocol.rollouts import RolloutOut
from tests.controlplane.conftest import Api, gpu
from tests.controlplane.fleet import ADDRESS, serving_fleet

V = "/api/v1"


def controller(api: Api) -> RolloutController:
    found = [c for c in api.app.state.controllers.controllers if c.name == "rollouts"]
    assert len(found) == 1
    rollouts: RolloutController = found[0]
    return rollouts


def status(api: Api) -> RolloutOut:
    response = api.as_admin("GET", f"{V}/deployments/web/rollout")
    assert response.status_code == 200, response.text
    return RolloutOut.model_validate(response.json())


def desired_states(api: Api, agent: str, gpus: int = 8) -> dict[int, str]:
    """What the host is told to run, by instance id."""
    reply = api.heartbeat(agent, gpus=[gpu(i) for i in range(gpus)], advertise_address=ADDRESS)
    assert reply.status_code == 200, reply.text
    return {i["instance_id"]: i["desired_state"] for i in reply.json()["instances"]}


def faithful_agent(api: Api, agent: str, gpus: int = 8) -> dict[int, str]:
    """An agent doing what it is told: every instance desired stopped reported stopped, every
    other ready on its desired version. Returns the desired states it acted on."""
    reply = api.heartbeat(agent, gpus=[gpu(i) for i in range(gpus)], advertise_address=ADDRESS)
    desired = reply.json()["instances"]
    observed = [
        {"instance_id": i["instance_id"], "port": i["port"],
         "state": "stopped" if i["desired_state"] == "stopped" else "ready",
         "version_digest": i["model"]["digest"]}
        for i in desired
    ]  # fmt: skip
    response = api.heartbeat(
        agent, gpus=[gpu(i) for i in range(gpus)], instances=observed, advertise_address=ADDRESS
    )
    assert response.status_code == 200, response.text
    return {i["instance_id"]: i["desired_state"] for i in desired}


def scale_to_five(api: Api, agent: str) -> int:
    response = api.as_admin("PATCH", f"{V}/deployments/web", json={"instances_per_host": 5})
    assert response.status_code == 200, response.text
    return 8  # GPUs the host keeps reporting


def drain(api: Api, agent: str) -> int:
    response = api.as_admin("POST", f"{V}/hosts/gpu-1/drain")
    assert response.status_code == 200, response.text
    return 8


def lose_gpus(api: Api, agent: str) -> int:
    # The host reports 6 GPUs of its 8: placement re-plans the fleet.
    desired_states(api, agent, gpus=6)
    return 6


INTERFERENCES: dict[str, Callable[[Api, str], int]] = {
    "scale": scale_to_five,
    "drain": drain,
    "gpu change": lose_gpus,
}


@pytest.mark.parametrize("interference", sorted(INTERFERENCES))
@pytest.mark.parametrize("when", list(RestartStage))
def test_a_restart_and_a_replan_both_finish_in_either_order(
    api: Api, interference: str, when: RestartStage
) -> None:
    agent = serving_fleet(api, per_host=4)
    faithful_agent(api, agent)
    controller(api).leaderless_gap = timedelta(hours=1)
    made = api.as_admin("POST", f"{V}/deployments/web/restart", json={})
    assert made.status_code == 201, made.text
    controller(api).tick(api.clock())
    held = [i for i, state in desired_states(api, agent).items() if state == "stopped"]
    assert len(held) == 1  # the first instance is held stopped
    if when == RestartStage.STARTING:
        faithful_agent(api, agent)  # it stopped; the restart starts it again
        controller(api).tick(api.clock())
    gpus = INTERFERENCES[interference](api, agent)

    for _ in range(30):
        api.clock.advance(5)
        faithful_agent(api, agent, gpus)
        controller(api).tick(api.clock())
        if status(api).state != RolloutState.PROGRESSING:
            break
    out = status(api)
    assert out.state == RolloutState.COMPLETED, (out.phase, out.reason)

    # What the re-plan asked for holds once the restart is over: the planner's word stands.
    final = faithful_agent(api, agent, gpus)
    if interference == "drain":
        assert set(final.values()) == {"stopped"}
    else:
        assert set(final.values()) == {"running"}
        assert len(final) == (5 if interference == "scale" else 4)
