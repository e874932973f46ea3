"""Threat: a bootstrap token's holder labels its own host into a deployment.

Registration took the labels an agent sent as the host's, so a deployment placed by
`--label tier=prod` put an instance (its API key, its weights, and client prompts through the
gateway) on any host that registered itself with `tier=prod`. Placement now reads only the
operator's labels: those the bootstrap token carries (`dctl token create --role bootstrap
--labels ...`, stamped on the hosts it registers) or set with `dctl host label` (operator, an
Event each). What an agent reports is kept and shown, and counts for nothing until an operator
adopts it; registering again or heartbeating never changes the operator's labels. The advertise
address stays the agent's, but the gateway sends nothing to a host without a working agent token.

Every test talks to a real control plane on loopback (`live_controlplane`, SQLite and
PostgreSQL), or to a real `dctl server` through the CLI.
"""

# Fixtures imported from tests/controlplane, tests/cli and live_controlplane are named again by
# the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import json
from typing import Any

import httpx

from protocol.wire import HEARTBEAT_PATH, REGISTER_PATH
from tests.cli.conftest import Dctl, Server, dctl, server
from tests.controlplane.conftest import db_url, gpu, manifest, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live

PROD = {"tier": "prod"}


def serve_by_label(live: LiveControlPlane) -> str:
    """demo:v1 deployed as `web` on every host labelled tier=prod; the version's digest."""
    body = {"version": "v1", "manifest": manifest("config.json"), "source_uri": "/nonexistent"}
    version = live.call("POST", f"{V}/models/demo/versions", live.admin, json=body)
    assert version.status_code in (200, 201), version.text
    spec = {"name": "web", "model": "demo", "version": "v1", "placement": {"labels": PROD}}
    created = live.call("POST", f"{V}/deployments", live.admin, json=spec)
    assert created.status_code == 201, created.text
    return str(version.json()["digest"])


def join(live: LiveControlPlane, name: str, token: str, **body: Any) -> str:
    """Register NAME with TOKEN, as its agent would, and heartbeat its GPUs; its agent token."""
    request = {"name": name, "advertise_address": "127.0.0.1", **body}
    reply = live.call("POST", f"{V}/agents/register", token, json=request)
    assert reply.status_code == 200, reply.text
    agent = str(reply.json()["agent_token"])
    beat(live, agent)
    return agent


def beat(live: LiveControlPlane, agent: str, **body: Any) -> Any:
    """One heartbeat of a host with one GPU at 127.0.0.1; the reply."""
    reply = live.heartbeat(agent, gpus=[gpu(0)], advertise_address="127.0.0.1", **body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def placed_on(live: LiveControlPlane) -> list[str]:
    """The hosts `web` has an instance on that should run."""
    shown = live.call("GET", f"{V}/deployments/web", live.admin).json()
    return sorted(i["host"] for i in shown["instances"] if i["desired_state"] == "running")


def host(live: LiveControlPlane, name: str) -> dict[str, Any]:
    shown: dict[str, Any] = live.call("GET", f"{V}/hosts/{name}", live.admin).json()
    return shown


def relabel(live: LiveControlPlane, name: str, token: str, **change: Any) -> httpx.Response:
    return live.call("PATCH", f"{V}/hosts/{name}/labels", token, json=change)


def test_an_agent_cannot_label_itself_into_a_deployment(live: LiveControlPlane) -> None:
    serve_by_label(live)
    agent = join(live, "evil", live.token("bootstrap"), labels=PROD)
    assert placed_on(live) == []
    # Registering again with its own agent token, still claiming the label, changes nothing.
    again = live.call("POST", f"{V}/agents/register", agent, json={"name": "evil", "labels": PROD})
    assert again.status_code == 200, again.text
    assert placed_on(live) == []
    shown = host(live, "evil")
    assert shown["labels"] == {} and shown["reported_labels"] == PROD


def test_placement_labels_are_the_bootstrap_tokens_and_the_operators(
    live: LiveControlPlane,
) -> None:
    serve_by_label(live)
    agent = join(live, "gpu-1", live.token("bootstrap", labels=PROD), labels={"tier": "dev"})
    assert placed_on(live) == ["gpu-1"]
    assert host(live, "gpu-1")["reported_labels"] == {"tier": "dev"}
    # The agent registers again and heartbeats: the operator's labels stay.
    again = live.call("POST", f"{V}/agents/register", agent, json={"name": "gpu-1"})
    agent = again.json()["agent_token"]
    beat(live, agent)
    assert host(live, "gpu-1")["labels"] == PROD and placed_on(live) == ["gpu-1"]

    # Only operators (and admins) change them: not a viewer, not the host's own agent.
    for token in (live.token("viewer"), agent):
        assert relabel(live, "gpu-1", token, remove=["tier"]).status_code == 403
    operator = live.token("operator")
    removed = relabel(live, "gpu-1", operator, remove=["tier"])
    assert removed.status_code == 200, removed.text
    assert removed.json()["labels"] == {} and placed_on(live) == []
    events = live.call("GET", f"{V}/events", live.admin, params={"kind": "host.labeled"}).json()
    [event] = events["items"]
    assert event["subject"] == "host/gpu-1" and event["actor"].startswith("token:t-operator")
    assert event["data"] == {"labels": {}, "before": PROD}

    # An operator who trusts what the agent reports adopts it; then it counts.
    other = join(live, "gpu-2", live.token("bootstrap"), labels=PROD)
    adopted = relabel(live, "gpu-2", operator, adopt=True)
    assert adopted.status_code == 200 and adopted.json()["labels"] == PROD
    assert placed_on(live) == ["gpu-2"]
    beat(live, other)

    # A bad change names what to fix.
    bad = relabel(live, "gpu-2", operator, labels={"bad key": "x"})
    assert bad.status_code == 422 and bad.json()["message"].startswith("labels")
    assert relabel(live, "gpu-2", operator).status_code == 422  # nothing to change
    viewer_with_labels = {"name": "v", "role": "viewer", "labels": PROD}
    refused = live.call("POST", f"{V}/tokens", live.admin, json=viewer_with_labels)
    assert refused.status_code == 422 and refused.json()["message"].startswith("labels")


def test_the_gateway_sends_nothing_to_a_host_whose_agent_token_is_revoked(
    live: LiveControlPlane,
) -> None:
    digest = serve_by_label(live)
    agent = join(live, "gpu-1", live.token("bootstrap", labels=PROD))
    [desired] = beat(live, agent)["instances"]
    ready = {"instance_id": desired["instance_id"], "state": "ready", "port": desired["port"],
             "version_digest": digest}  # fmt: skip
    beat(live, agent, instances=[ready])
    gateway = live.token("gateway")

    def routed() -> list[str]:
        table = live.call("GET", f"{V}/routes", gateway).json()
        return [i["address"] for d in table["deployments"] for i in d["stable"]["instances"]]

    assert routed() == ["127.0.0.1"]
    assert host(live, "gpu-1")["agent_token"] is True
    revoked = live.call("DELETE", f"{V}/tokens/{agent.split('_')[1]}", live.admin)
    assert revoked.status_code == 200, revoked.text
    # At once: no wait for the host's heartbeats to be missed.
    assert routed() == []
    assert host(live, "gpu-1")["agent_token"] is False


def test_dctl_host_label_and_what_host_show_says(dctl: Dctl, server: Server) -> None:
    created = dctl("token", "create", "boot-lab", "--role", "bootstrap", "--labels", "tier=prod")
    assert created.code == 0, created.stderr
    listed = dctl("token", "list", "--json")
    assert {"tier": "prod"} in [t["labels"] for t in json.loads(listed.stdout)]
    body = {"name": "lab-1", "labels": {"zone": "a"}, "advertise_address": "10.0.0.7",
            "port_range": [19000, 19009]}  # fmt: skip
    secret = created.stdout.strip()
    reply = httpx.post(server.url + REGISTER_PATH, json=body,
                       headers={"Authorization": f"Bearer {secret}"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    agent = reply.json()["agent_token"]
    beat = httpx.post(server.url + HEARTBEAT_PATH, json={"advertise_address": "10.0.0.7"},
                      headers={"Authorization": f"Bearer {agent}"})  # fmt: skip
    assert beat.status_code == 200, beat.text

    shown = dctl("host", "show", "lab-1").stdout
    assert "labels:          tier=prod" in shown
    assert "reported labels: zone=a (not adopted: dctl host label lab-1 --adopt)" in shown
    assert "address:         10.0.0.7" in shown and "ports:           19000-19009" in shown
    assert "agent token:     valid: the gateway sends to the address and ports above" in shown

    adopted = dctl("host", "label", "lab-1", "--adopt", "rack=r7")
    assert adopted.code == 0 and "rack=r7, tier=prod, zone=a" in adopted.stdout
    removed = dctl("host", "label", "lab-1", "--remove", "rack", "--remove", "zone")
    assert removed.code == 0 and "labels: tier=prod" in removed.stdout
    assert dctl("host", "label", "lab-1").code == 2  # nothing to change
    assert dctl("host", "label", "lab-1", "novalue").code == 2
    assert dctl("token", "create", "v", "--role", "viewer", "--labels", "a=b").code == 2
    events = dctl("events", "--kind", "host.labeled", "--subject", "host/lab-1").stdout
    assert events.count("host.labeled") == 2
