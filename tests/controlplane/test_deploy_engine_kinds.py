"""`engine: {kind: ...}` in a deployment's engine config through the real API: a bad kind, a bad
template, a missing placeholder or a key the kind would ignore is a 422 naming the key at create
and at configure, and nothing is written; good ones are stored as given."""

from __future__ import annotations

from typing import Any

import pytest

from tests.controlplane.conftest import Api, deploy, register_version
from tests.controlplane.fleet import gpu_host

MOCK = ["/usr/bin/mock-server", "--host", "{host}", "--port", "{port}", "--model", "{served_name}"]


def refused(response: Any, *needles: str) -> None:
    """A 422 whose message holds every needle."""
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert all(needle in message for needle in needles), message


@pytest.mark.parametrize(
    ("engine_config", "needles"),
    [
        ({"engine": {"kind": "triton"}}, ["engine.kind must be one of dctl, vllm, sglang, command",
                                          "'triton'"]),
        ({"engine": {"kind": "command"}}, ["engine.command is required"]),
        ({"engine": {"kind": "command", "command": ["srv", "--host", "{host}"]}},
         ["engine.command", "must pass {port}"]),
        ({"engine": {"kind": "command", "command": [*MOCK, "--gpu", "{gpu}"]}},
         ["engine.command", "command[8]: unknown placeholder {gpu}", "{gpus}"]),
        ({"engine": {"kind": "command", "command": [*MOCK, "{port"]}},
         ["engine.command", "unbalanced brace"]),
        ({"engine": {"kind": "command", "command": ["{model_path}", "{host}", "{port}"]}},
         ["command[0] is the program"]),
        ({"engine": {"kind": "command", "command": MOCK, "drain_signal": "SIGSTOP"}},
         ["engine.drain_signal"]),
        ({"engine": {"kind": "command", "command": MOCK, "ready_path": "health"}},
         ["engine.ready_path", "must be a URL path"]),
        ({"engine": {"kind": "command", "command": MOCK, "api_key_env": "MY-KEY"}},
         ["engine.api_key_env"]),
        ({"engine": {"kind": "command", "command": MOCK}, "model": {"threshold": 0.7}},
         ["model.threshold is a setting of the dctl engine", "engine.command"]),
        ({"engine": {"kind": "vllm", "extra_args": ["--api-key", "x"]}},
         ["engine.extra_args", "--api-key"]),
        ({"engine": {"kind": "sglang"}, "parallel": {"size": 2}}, ["parallel.size", "sglang"]),
        ({"engine": {"kind": "vllm", "python": "venv/bin/python"}},
         ["engine.python", "absolute path"]),
        ({"engine": {"kind": "vllm", "cuda_graphs": True}}, ["unknown key 'engine.cuda_graphs'"]),
    ],
)  # fmt: skip
def test_a_bad_engine_is_a_422_naming_the_key_and_nothing_is_written(
    api: Api, engine_config: dict[str, Any], needles: list[str]
) -> None:
    register_version(api)
    gpu_host(api)
    refused(deploy(api, "web", ["gpu-1"], engine_config=engine_config), *needles)
    assert api.as_admin("GET", "/api/v1/deployments/web").status_code == 404
    assert deploy(api, "web", ["gpu-1"]).status_code == 201
    patched = api.as_admin(
        "PATCH", "/api/v1/deployments/web", json={"engine_config": engine_config}
    )
    refused(patched, *needles)
    assert api.as_admin("GET", "/api/v1/deployments/web").json()["engine_config"] == {}


def test_good_engines_are_stored_as_given_and_tensor_parallel_follows_the_gpus(api: Api) -> None:
    register_version(api)
    gpu_host(api)
    vllm = {"engine": {"kind": "vllm", "extra_args": ["--enable-prefix-caching"]},
            "model": {"dtype": "bf16", "max_seq_len": 8192}}  # fmt: skip
    created = deploy(api, "chat", ["gpu-1"], gpus_per_instance=4, engine_config=vllm)
    assert created.status_code == 201, created.text
    assert created.json()["engine_config"] == vllm
    assert [len(i["gpu_indices"]) for i in created.json()["instances"]] == [4]
    command = {"engine": {"kind": "command", "command": MOCK, "metrics_path": None}}
    patched = api.as_admin("PATCH", "/api/v1/deployments/chat", json={"engine_config": command})
    assert patched.status_code == 200, patched.text
    assert patched.json()["engine_config"]["engine"]["command"] == MOCK
