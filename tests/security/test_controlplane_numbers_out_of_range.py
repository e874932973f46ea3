"""Threat: a client stores numbers no part of the fleet can use.

Python's JSON parser reads `NaN`, `Infinity` and `1e309` (past a float's range) as floats. A
deployment's engine config took `"request_timeout_s": Infinity`, stored it as null, and every
agent then refused the deployment; a heartbeat's `power_w` and a rollout policy's ratios took
them too. Integers had no upper bound in engine configs and heartbeats.

Every request body is now held to one rule, wherever a number sits (nested in a free-form
engine_config too): non-finite numbers are refused, 422 naming the field; the heartbeat, parsed
by pydantic from its bytes, gets it from the wire models; and every integer a request carries
has an upper bound (the last test finds any that has none).

The requests an attacker sends, as raw JSON, to a real control plane on loopback (SQLite and
PostgreSQL).
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import httpx
import pytest
from annotated_types import Le, Lt
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from controlplane.app import ROUTERS
from protocol.engine_config import DeploymentEngineConfig, ServeConfigError, load_serve_config
from protocol.wire import Heartbeat
from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live

NOT_FINITE = ["Infinity", "-Infinity", "NaN", "1e309"]
TOO_BIG = str(2**63)
SHA = "ab" * 32


def send(live: LiveControlPlane, method: str, path: str, token: str, raw: str) -> httpx.Response:
    """RAW as the body, exactly as written: no client would encode these numbers so."""
    headers = {"Content-Type": "application/json"}
    return live.call(method, path, token, content=raw, headers=headers)


def refused(response: httpx.Response, field: str) -> None:
    """A 422 whose message starts with FIELD, the way the user must fix it."""
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "invalid_request"
    assert body["message"].startswith(f"{field}: "), body["message"]


@pytest.fixture
def deployed(live: LiveControlPlane) -> Iterator[tuple[LiveControlPlane, str]]:
    """A host, a version demo:v1 and a deployment `web` of it (no instances); an operator."""
    live.register("gpu-1")
    operator = live.token("operator")
    files = [{"path": "w.safetensors", "size": 1, "sha256": SHA}]
    version = {"version": "v1", "source_uri": "/srv/models/demo", "manifest": {"files": files}}
    assert live.call("POST", f"{V}/models/demo/versions", operator, json=version).is_success
    deployment = {"name": "web", "model": "demo", "version": "v1", "instances_per_host": 0,
                  "placement": {"hosts": ["gpu-1"]}}  # fmt: skip
    created = live.call("POST", f"{V}/deployments", operator, json=deployment)
    assert created.status_code == 201, created.text
    yield live, operator


@pytest.mark.parametrize("number", NOT_FINITE)
def test_an_engine_config_number_that_is_not_finite_is_refused_naming_its_key(
    deployed: tuple[LiveControlPlane, str], number: str
) -> None:
    live, operator = deployed
    create = ('{"name": "api", "model": "demo", "version": "v1", "instances_per_host": 0, '
              '"placement": {"hosts": ["gpu-1"]}, '
              f'"engine_config": {{"service": {{"request_timeout_s": {number}}}}}}}')  # fmt: skip
    refused(send(live, "POST", f"{V}/deployments", operator, create),
            "engine_config.service.request_timeout_s")  # fmt: skip
    # Nested in what no field types: found all the same, with its place.
    patch = f'{{"engine_config": {{"model": {{"threshold": 0.5}}, "x": {{"y": [1, {number}]}}}}}}'
    refused(send(live, "PATCH", f"{V}/deployments/web", operator, patch), "engine_config.x.y.1")
    stored = live.call("GET", f"{V}/deployments/web", operator).json()
    assert stored["engine_config"] == {}
    assert live.call("GET", f"{V}/deployments/api", operator).status_code == 404


def test_engine_config_integers_have_upper_bounds(deployed: tuple[LiveControlPlane, str]) -> None:
    live, operator = deployed
    for key in ("service.max_queue", "service.max_body_bytes", "model.max_seq_len",
                "model.steps", "resources.threads"):  # fmt: skip
        section, name = key.split(".")
        patch = f'{{"engine_config": {{"{section}": {{"{name}": {TOO_BIG}}}}}}}'
        response = send(live, "PATCH", f"{V}/deployments/web", operator, patch)
        assert response.status_code == 422, response.text
        assert (
            f"engine_config: {key}: Input should be less than or equal to"
            in (response.json()["message"])
        )


@pytest.mark.parametrize("number", NOT_FINITE)
def test_a_rollout_with_numbers_that_are_not_finite_is_refused(
    deployed: tuple[LiveControlPlane, str], number: str
) -> None:
    live, operator = deployed
    path = f"{V}/deployments/web/rollout"
    config = '"engine_config": {"model": {"threshold": 0.5}}'
    policy = f'{{{config}, "policy": {{"max_latency_ratio": {number}}}}}'
    refused(send(live, "POST", path, operator, policy), "policy.max_latency_ratio")
    steps = f'{{{config}, "steps": [10, {number}, 100]}}'
    refused(send(live, "POST", path, operator, steps), "steps.1")
    nested = f'{{"engine_config": {{"model": {{"threshold": {number}}}}}}}'
    refused(send(live, "POST", path, operator, nested), "engine_config.model.threshold")
    for field in ("canary", "surge"):
        refused(send(live, "POST", path, operator, f'{{{config}, "{field}": {TOO_BIG}}}'), field)
    assert live.call("GET", f"{V}/deployments/web/rollouts", operator).json() == []


@pytest.mark.parametrize("number", [*NOT_FINITE, TOO_BIG])
def test_a_token_with_numbers_out_of_range_is_refused(live: LiveControlPlane, number: str) -> None:
    for field in ("expires_in_s", "uses"):
        body = f'{{"name": "ci", "role": "operator", "{field}": {number}}}'
        refused(send(live, "POST", f"{V}/tokens", live.admin, body), field)
    assert [t["name"] for t in live.tokens()] == ["admin"]


@pytest.mark.parametrize("number", NOT_FINITE)
def test_a_heartbeat_with_numbers_that_are_not_finite_is_refused_naming_the_field(
    live: LiveControlPlane, number: str
) -> None:
    agent = live.register("gpu-1")
    path = f"{V}/agents/heartbeat"
    gpu = f'{{"index": 0, "uuid": "GPU-0", "power_w": {number}}}'
    refused(send(live, "POST", path, agent, f'{{"gpus": [{gpu}]}}'), "gpus.0.power_w")
    metrics = f'{{"metrics": [{{"instance_id": 1, "counters": {{"tokens_total": {number}}}}}]}}'
    refused(send(live, "POST", path, agent, metrics), "metrics.0.counters.tokens_total")
    assert live.heartbeat(agent).status_code == 200
    host = live.call("GET", f"{V}/hosts/gpu-1", live.admin).json()
    assert host["gpus"] == []


def test_heartbeat_integers_have_upper_bounds(live: LiveControlPlane) -> None:
    agent = live.register("gpu-1")
    path = f"{V}/agents/heartbeat"
    exited = (f'{{"instances": [{{"instance_id": 1, "state": "backoff", '
              f'"last_exit": {{"code": {TOO_BIG}}}}}]}}')  # fmt: skip
    refused(send(live, "POST", path, agent, exited), "instances.0.last_exit.code")
    ecc = f'{{"gpus": [{{"index": 0, "uuid": "GPU-0", "ecc_uncorrectable": {TOO_BIG}}}]}}'
    refused(send(live, "POST", path, agent, ecc), "gpus.0.ecc_uncorrectable")
    facts = f'{{"facts": {{"memory_bytes": {TOO_BIG}}}}}'
    refused(send(live, "POST", path, agent, facts), "facts.memory_bytes")


def test_an_engine_config_file_with_an_infinite_setting_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {{path: {checkpoint}}}\nservice: {{request_timeout_s: .inf}}\n")
    with pytest.raises(ServeConfigError, match=r"service\.request_timeout_s: .*finite number"):
        load_serve_config(config)


# --- the rule that every integer of a request has an upper bound ------------------------------


def unbounded_integers(root: Any) -> list[str]:
    """Every integer field reachable from the body type ROOT that has no `le` or `lt`."""
    found: list[str] = []
    seen: set[type] = set()

    def bounded(metadata: list[Any]) -> bool:
        return any(
            isinstance(m, Le | Lt) or (isinstance(m, FieldInfo) and bounded(m.metadata))
            for m in metadata
        )

    def walk(kind: Any, metadata: list[Any], where: str) -> None:
        origin = get_origin(kind)
        if origin is Annotated:
            base, *extra = get_args(kind)
            walk(base, [*metadata, *extra], where)
        elif kind is int:
            if not bounded(metadata):
                found.append(where)
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            if kind not in seen:
                seen.add(kind)
                for name, info in kind.model_fields.items():
                    walk(info.annotation, list(info.metadata), f"{kind.__name__}.{name}")
        elif origin in (Union, types.UnionType):  # the field's bounds hold for each branch
            for branch in get_args(kind):
                walk(branch, metadata, where)
        elif origin in (list, tuple, set, frozenset):  # a length bound bounds no item
            for item in get_args(kind):
                if item is not Ellipsis:
                    walk(item, [], f"{where}[]")
        elif origin is dict:
            walk(get_args(kind)[1], [], f"{where}{{}}")

    walk(root, [], getattr(root, "__name__", str(root)))
    return found


def request_bodies() -> set[Any]:
    """The body type of every route, the heartbeat (parsed by its route itself) and the engine
    config deployments and rollouts carry as a free-form mapping."""
    routes = [route for module in ROUTERS for route in module.router.routes]
    bodies: set[Any] = {Heartbeat, DeploymentEngineConfig}
    for route in routes:
        if isinstance(route, APIRoute) and route.body_field is not None:
            bodies.add(route.body_field.field_info.annotation)
    return bodies


def test_every_integer_a_request_carries_has_an_upper_bound() -> None:
    bodies = request_bodies()
    assert len(bodies) > 10  # the routes were found
    assert [where for body in bodies for where in unbounded_integers(body)] == []


def test_the_rule_finds_an_integer_without_an_upper_bound() -> None:
    class Inner(BaseModel):
        ok: Annotated[int, Field(ge=0, le=9)] = 0
        loose: int | None = Field(default=None, ge=1)

    class Body(BaseModel):
        count: int = Field(default=0, lt=10)
        items: list[int] = Field(default_factory=list, max_length=3)
        by_name: dict[str, Inner] = Field(default_factory=dict)
        flag: bool = False

    assert unbounded_integers(Body) == ["Body.items[]", "Inner.loose"]
