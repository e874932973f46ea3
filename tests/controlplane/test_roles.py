"""Role matrix: every route x every role gets exactly the access the role model grants."""

from __future__ import annotations

from typing import Any

from tests.controlplane.conftest import Api, deploy, register_version

Roles = set[str | None]
READ: Roles = {"viewer", "operator", "admin"}
OPERATE: Roles = {"operator", "admin"}
ADMIN: Roles = {"admin"}
BOOTSTRAP: Roles = {"bootstrap"}
AGENT: Roles = {"agent"}
# Gateways read routes and report traffic, nothing else; client tokens are for the gateway's
# OpenAI API and open no route of the control plane's (they are not viewers).
GATEWAY: Roles = {"gateway"}
PUBLIC: Roles = {"viewer", "operator", "admin", "bootstrap", "agent", "gateway", "client", None}
V = "/api/v1"

# (method, route template) -> roles allowed. A new route fails the test until it is listed here.
EXPECTED: dict[tuple[str, str], Roles] = {
    ("GET", f"{V}/hosts"): READ,
    ("GET", f"{V}/hosts/{{name}}"): READ,
    ("GET", f"{V}/hosts/{{name}}/samples"): READ,
    # Labels steer placement, as a deployment naming hosts does: operators.
    ("PATCH", f"{V}/hosts/{{name}}/labels"): OPERATE,
    ("POST", f"{V}/hosts/{{name}}/drain"): OPERATE,
    ("POST", f"{V}/hosts/{{name}}/undrain"): OPERATE,
    ("POST", f"{V}/hosts/{{name}}/rekey"): ADMIN,
    ("DELETE", f"{V}/hosts/{{name}}"): ADMIN,
    ("GET", f"{V}/models"): READ,
    ("GET", f"{V}/models/{{name}}"): READ,
    ("POST", f"{V}/models/{{name}}/versions"): OPERATE,
    ("GET", f"{V}/models/{{name}}/versions/{{version}}"): READ,
    ("POST", f"{V}/models/{{name}}/versions/{{version}}/deprecate"): OPERATE,
    # Weights go to the agents that run them (and admins); viewers and operators see manifests.
    ("GET", f"{V}/models/{{name}}/versions/{{version}}/files/{{path}}"): ADMIN | AGENT,
    ("POST", f"{V}/deployments"): OPERATE,
    ("GET", f"{V}/deployments"): READ,
    ("GET", f"{V}/deployments/{{name}}"): READ,
    ("PATCH", f"{V}/deployments/{{name}}"): OPERATE,
    ("DELETE", f"{V}/deployments/{{name}}"): OPERATE,
    ("PUT", f"{V}/deployments/{{name}}/canary"): OPERATE,
    ("DELETE", f"{V}/deployments/{{name}}/canary"): OPERATE,
    ("PUT", f"{V}/deployments/{{name}}/autoscale"): OPERATE,
    ("DELETE", f"{V}/deployments/{{name}}/autoscale"): OPERATE,
    ("POST", f"{V}/deployments/{{name}}/wake"): OPERATE | GATEWAY,
    ("GET", f"{V}/deployments/{{name}}/logs"): READ,
    ("GET", f"{V}/deployments/{{name}}/logs/follow"): READ,
    ("GET", f"{V}/deployments/{{name}}/requests"): READ,
    ("GET", f"{V}/audit"): ADMIN,
    ("GET", f"{V}/deployments/{{name}}/traffic"): READ,
    ("POST", f"{V}/deployments/{{name}}/rollout"): OPERATE,
    ("GET", f"{V}/deployments/{{name}}/rollout"): READ,
    ("POST", f"{V}/deployments/{{name}}/rollout/{{action}}"): OPERATE,
    ("GET", f"{V}/deployments/{{name}}/rollouts"): READ,
    ("GET", f"{V}/deployments/{{name}}/rollouts/{{rollout_id}}"): READ,
    ("POST", f"{V}/deployments/{{name}}/rollback"): OPERATE,
    ("POST", f"{V}/deployments/{{name}}/restart"): OPERATE,
    # Not even admins read the routing table: it holds every engine's API key.
    ("GET", f"{V}/routes"): GATEWAY,
    ("POST", f"{V}/traffic"): GATEWAY,
    # Gateways say where they serve; anyone who reads the fleet sees them and the targets.
    ("POST", f"{V}/gateways/heartbeat"): GATEWAY,
    ("GET", f"{V}/gateways"): READ,
    ("GET", f"{V}/metrics/targets"): READ,
    ("GET", f"{V}/events"): READ,
    ("POST", f"{V}/tokens"): ADMIN,
    ("GET", f"{V}/tokens"): ADMIN,
    ("DELETE", f"{V}/tokens/{{ref}}"): ADMIN,
    # A new host with a bootstrap token; the host's own agent token registers it again.
    ("POST", f"{V}/agents/register"): BOOTSTRAP | AGENT,
    ("POST", f"{V}/agents/heartbeat"): AGENT,
    ("GET", f"{V}/status"): READ,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): PUBLIC,
}

BODIES: dict[tuple[str, str], Any] = {
    ("POST", f"{V}/models/{{name}}/versions"): {
        "version": "v1",
        "manifest": {"files": [{"path": "config.json", "size": 10, "sha256": "0" * 63 + "1"}]},
        "source_uri": "/nonexistent",
    },
    ("POST", f"{V}/deployments"): {
        "name": "other",
        "model": "demo",
        "version": "v1",
        "placement": {"hosts": ["gpu-1"]},
    },
    ("PATCH", f"{V}/deployments/{{name}}"): {"instances_per_host": 1},
    ("PATCH", f"{V}/hosts/{{name}}/labels"): {"labels": {"rack": "r1"}},
    ("POST", f"{V}/tokens"): {"name": "made", "role": "viewer"},
    ("POST", f"{V}/agents/register"): {"name": "gpu-9"},  # the agent's own: gpu-1 (below)
    ("POST", f"{V}/agents/heartbeat"): {},
    ("PUT", f"{V}/deployments/{{name}}/canary"): {"version": "v2", "weight": 10},
    ("POST", f"{V}/deployments/{{name}}/rollout"): {"to": "v2", "canary": 10},
    ("POST", f"{V}/deployments/{{name}}/rollout/{{action}}"): {"reason": "role test"},
    ("POST", f"{V}/deployments/{{name}}/rollback"): {},
    ("POST", f"{V}/deployments/{{name}}/restart"): {},
    ("POST", f"{V}/gateways/heartbeat"): {"gateway": "gw-1", "address": "127.0.0.1", "port": 1},
    ("POST", f"{V}/traffic"): {
        "gateway": "gw-1",
        "started_at": "2026-01-01T11:59:55Z",
        "ended_at": "2026-01-01T12:00:00Z",
    },
}


def concrete(template: str, token_ref: str) -> str:
    """Fill a route template with objects that exist."""
    path = template.replace("{version}", "v1").replace("{path}", "config.json")
    path = path.replace("{ref}", token_ref).replace("{action}", "pause")
    path = path.replace("{rollout_id}", "1")
    if path.endswith("/logs/follow"):
        path += "?max_s=0.5"  # a stream: ended soon, as a client would reconnect
    if "/hosts/" in path:
        return path.replace("{name}", "gpu-1")
    if "/deployments/" in path:
        return path.replace("{name}", "web")
    return path.replace("{name}", "demo")


def test_every_route_enforces_its_roles(api: Api) -> None:
    register_version(api)
    register_version(api, version="v2")
    roles = ("viewer", "operator", "admin", "bootstrap", "gateway", "client")
    tokens: dict[str | None, str | None] = {role: api.token(role) for role in roles}
    tokens["agent"] = api.register("gpu-1")["agent_token"]
    tokens[None] = None
    assert deploy(api, "web", ["gpu-1"], per_host=2).status_code == 201
    victim = api.as_admin("POST", f"{V}/tokens", json={"name": "victim", "role": "viewer"})
    paths = api.client.get("/openapi.json").json()["paths"]
    routes = {(method.upper(), path) for path, ops in paths.items() for method in ops}
    assert routes == set(EXPECTED), "classify every route in EXPECTED"
    # Deletes last, and the host (which takes the agent token with it) very last.
    destructive_last = sorted(
        EXPECTED, key=lambda key: (key[0] == "DELETE", key == ("DELETE", f"{V}/hosts/{{name}}"))
    )
    for key in destructive_last:
        method, template = key
        path = concrete(template, victim.json()["id"])
        allowed = EXPECTED[key]
        # Refusals first: they must not change anything the allowed calls rely on.
        for role in sorted(set(tokens) - allowed, key=str):
            response = api.call(method, path, tokens[role], json=BODIES.get(key))
            expected = 401 if role is None else 403
            assert response.status_code == expected, (method, path, role, response.text)
            if expected == 403:
                message = response.json()["message"]
                assert "needs a token with role" in message and str(role) in message
        for role in sorted(allowed, key=str):
            body = BODIES.get(key)
            if key == ("POST", f"{V}/agents/register") and role == "agent":
                body = {"name": "gpu-1"}
            response = api.call(method, path, tokens[role], json=body)
            assert response.status_code not in (401, 403), (method, path, role, response.text)
            assert response.status_code < 500, (method, path, role, response.text)
            if body == {"name": "gpu-1"}:  # registered again: the old agent token is revoked
                tokens["agent"] = response.json()["agent_token"]


def test_missing_and_bad_tokens_get_401_with_json(api: Api) -> None:
    for header in [
        None,
        "Basic abc",
        "Bearer",
        "Bearer nope",
        "Bearer dctl_000000000000_" + "x" * 40,
    ]:
        headers = {"Authorization": header} if header else {}
        response = api.client.get(f"{V}/hosts", headers=headers)
        assert response.status_code == 401, header
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"] == "unauthorized"
