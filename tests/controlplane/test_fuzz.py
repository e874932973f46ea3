"""Property-based fuzzing of the API inputs: nothing a client sends produces a 5xx."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.controlplane.conftest import Api, deploy, gpu, manifest, register_version

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(
        [
            "",
            "..",
            "../x",
            "/abs",
            "demo:v1",
            "a" * 64,
            "gpu-1",
            "ready",
            "-1",
            "nul\x00byte",
            2**31,
            2**63,
            -(2**63),
        ]
    )
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


def mutated(valid: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with some fields replaced, dropped, or extra fields added."""
    keys = sorted(valid)
    return st.fixed_dictionaries(
        {},
        optional={k: json_values for k in keys},
    ).flatmap(
        lambda replaced: st.dictionaries(st.text(max_size=8), json_values, max_size=2).map(
            lambda extra: {**valid, **replaced, **extra}
        )
    )


def check(response: Any) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body["message"], str) and body["message"]


VERSION = {"version": "v2", "manifest": manifest("a.bin"), "source_uri": "/x",
           "line": "base", "parent": "demo:v1", "memory_plan": {"weights_bytes": 1,
           "kv_bytes_per_token": 1}, "notes": "", "digest": None}  # fmt: skip
DEPLOY = {"name": "fz", "model": "demo", "version": "v1", "placement": {"hosts": ["gpu-1"]},
          "instances_per_host": 1, "engine_config": {}}  # fmt: skip
HEARTBEAT = {"applied_generation": 1, "facts": {"hostname": "h", "gpu_backend": "fake"},
             "gpus": [gpu(0)], "instances": [{"instance_id": 1, "state": "ready"}],
             "snapshots": [], "metrics": [{"instance_id": 1, "counters": {"x": 1}}]}  # fmt: skip


def test_fuzzed_bodies_never_produce_5xx(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    boot = api.token("bootstrap")
    assert deploy(api, "web", ["gpu-1"]).status_code == 201

    @FUZZ
    @given(
        st.sampled_from(["version", "deploy", "patch", "token", "register", "heartbeat"]),
        st.data(),
    )
    def fuzz(target: str, data: st.DataObject) -> None:
        if target == "version":
            body = data.draw(mutated(VERSION) | json_values)
            check(api.as_admin("POST", "/api/v1/models/demo/versions", json=body))
        elif target == "deploy":
            body = data.draw(mutated(DEPLOY) | json_values)
            check(api.as_admin("POST", "/api/v1/deployments", json=body))
        elif target == "patch":
            body = data.draw(mutated({"instances_per_host": 1, "engine_config": {}}) | json_values)
            check(api.as_admin("PATCH", "/api/v1/deployments/web", json=body))
        elif target == "token":
            body = data.draw(mutated({"name": "fz", "role": "viewer", "uses": 1}))
            check(api.as_admin("POST", "/api/v1/tokens", json=body))
        elif target == "register":
            body = data.draw(mutated({"name": "gpu-2", "labels": {}, "port_range": [1, 2]}))
            check(api.call("POST", "/api/v1/agents/register", boot, json=body))
        else:
            body = data.draw(mutated(HEARTBEAT) | json_values)
            check(api.heartbeat(agent, **body) if isinstance(body, dict) else
                  api.call("POST", "/api/v1/agents/heartbeat", agent, json=body))  # fmt: skip

    fuzz()


def test_fuzzed_paths_and_queries_never_produce_5xx(api: Api) -> None:
    register_version(api)
    segment = st.text(
        alphabet=st.characters(blacklist_categories=["Cs", "Cc"], blacklist_characters="/?#%"),
        min_size=1,
        max_size=30,
    )

    @FUZZ
    @given(
        st.sampled_from(
            [
                "/api/v1/hosts/{}",
                "/api/v1/models/{}",
                "/api/v1/models/demo/versions/{}",
                "/api/v1/deployments/{}",
                "/api/v1/models/demo/versions/v1/files/{}",
                "/api/v1/tokens/{}",
            ]
        ),
        segment,
        st.sampled_from(["GET", "DELETE", "POST", "PATCH"]),
        st.dictionaries(
            st.sampled_from(["after", "limit", "kind", "since", "state", "subject"]),
            st.text(max_size=20),
            max_size=3,
        ),
    )
    def fuzz(template: str, value: str, method: str, params: dict[str, str]) -> None:
        check(api.as_admin(method, template.format(value), params=params))
        check(api.as_admin("GET", "/api/v1/events", params=params))
        check(api.as_admin("GET", "/api/v1/hosts", params=params))

    fuzz()
