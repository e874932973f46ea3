"""`parallel` in a deployment's engine config through the real API: its size held to the GPUs of
an instance, and the version's heads, K/V heads and experts held to the size, with 422s that
name the key and the figures; nothing written when refused."""

from __future__ import annotations

from typing import Any

from tests.controlplane.conftest import Api, deploy, register_version
from tests.controlplane.fleet import gpu_host

GIB = 2**30
# 12 query heads, 2 K/V heads, 8 experts: sizes 2 and 4 split it (K/V heads replicated on 4),
# 3 does not split the K/V heads, 6 does not split the experts whole.
ARCHITECTURE = {"weights_bytes": GIB, "kv_bytes_per_token": 1024, "num_heads": 12,
                "num_kv_heads": [2], "num_experts": 8, "vocab_size": 1000}  # fmt: skip


def patch(api: Api, name: str, **body: Any) -> Any:
    """PATCH a deployment with the admin token."""
    return api.as_admin("PATCH", f"/api/v1/deployments/{name}", json=body)


def refused(response: Any, *needles: str) -> None:
    """A 422 whose message holds every needle."""
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert all(needle in message for needle in needles), message


def test_the_parallel_size_is_the_gpus_of_an_instance(api: Api) -> None:
    register_version(api)
    gpu_host(api)
    four = {"parallel": {"size": 4}}
    refused(
        deploy(api, "web", ["gpu-1"], gpus_per_instance=2, engine_config=four),
        "engine_config: parallel.size (4) must equal gpus_per_instance (2)",
    )
    assert api.as_admin("GET", "/api/v1/deployments/web").status_code == 404
    created = deploy(api, "web", ["gpu-1"], gpus_per_instance=4, engine_config=four)
    assert created.status_code == 201, created.text
    assert created.json()["engine_config"] == {"parallel": {"size": 4}}
    assert [len(i["gpu_indices"]) for i in created.json()["instances"]] == [4]
    # Either half of the pair changed alone must still match the other.
    refused(patch(api, "web", gpus_per_instance=2), "parallel.size (4)", "gpus_per_instance (2)")
    refused(
        patch(api, "web", engine_config={"parallel": {"size": 8}}),
        "parallel.size (8) must equal gpus_per_instance (4)",
    )
    both = patch(api, "web", gpus_per_instance=2, engine_config={"parallel": {"size": 2}})
    assert both.status_code == 200, both.text
    # Left out, the size follows the GPUs.
    assert patch(api, "web", gpus_per_instance=4, engine_config={}).status_code == 200
    # CPU ranks are processes, not GPUs: any size goes.
    cpu = {"parallel": {"size": 3}, "resources": {"device": "cpu"}}
    assert deploy(api, "cpu", ["gpu-1"], gpus_per_instance=1, engine_config=cpu).status_code == 201
    bad = patch(api, "web", engine_config={"parallel": {"size": 0, "experts": "tensor"}})
    refused(bad, "engine_config: parallel.size")
    refused(patch(api, "web", engine_config={"parallel": {"experts": "data"}}), "parallel.experts")


def test_a_version_whose_heads_or_experts_do_not_split_is_refused(api: Api) -> None:
    register_version(api, memory_plan=ARCHITECTURE)
    gpu_host(api)
    refused(
        deploy(api, "web", ["gpu-1"], gpus_per_instance=3),
        "parallel.size 3 and the 2 K/V heads of demo:v1: one must divide the other",
        "(parallel.size left out: gpus_per_instance 3)",
    )
    refused(
        deploy(api, "web", ["gpu-1"], gpus_per_instance=6),
        "parallel.size 6 does not divide the 8 experts of demo:v1 with parallel.experts 'expert'",
        "or parallel.experts: tensor",
    )
    tensor = deploy(
        api,
        "web",
        ["gpu-1"],
        gpus_per_instance=6,
        engine_config={"parallel": {"experts": "tensor"}},
    )
    assert tensor.status_code == 201, tensor.text  # each expert's matrices split 6 ways
    four = deploy(api, "four", ["gpu-1"], gpus_per_instance=2)  # the 2 GPUs left
    assert four.status_code == 201, four.text


def test_a_cpu_deployment_checks_the_size_it_sets(api: Api) -> None:
    register_version(api, memory_plan=ARCHITECTURE)
    gpu_host(api)
    cpu = {"resources": {"device": "cpu"}}
    refused(
        deploy(api, "web", ["gpu-1"], engine_config={**cpu, "parallel": {"size": 5}}),
        "engine_config: parallel.size 5 does not divide the 12 attention heads of demo:v1",
    )
    # Left out on a CPU: one rank, nothing to split (whatever GPUs the instance holds).
    assert deploy(api, "web", ["gpu-1"], gpus_per_instance=5, engine_config=cpu).status_code == 201


def test_a_new_version_must_split_over_the_deployment_s_ranks(api: Api) -> None:
    register_version(api, memory_plan=ARCHITECTURE)
    register_version(api, version="v2", memory_plan={**ARCHITECTURE, "num_heads": 10})
    gpu_host(api)
    assert deploy(api, "web", ["gpu-1"], gpus_per_instance=4).status_code == 201
    refused(
        patch(api, "web", version="v2"),
        "parallel.size 4 does not divide the 10 attention heads of demo:v2",
    )
    shown = api.as_admin("GET", "/api/v1/deployments/web").json()
    assert shown["version"] == "v1"
    assert patch(api, "web", version="v2", gpus_per_instance=2).status_code == 200


def test_the_architecture_is_stored_with_the_version(api: Api) -> None:
    register_version(api, memory_plan=ARCHITECTURE)
    found = api.as_admin("GET", "/api/v1/models/demo/versions/v1").json()
    assert {k: found["memory_plan"][k] for k in ARCHITECTURE} == ARCHITECTURE


def test_a_size_for_all_of_a_host_s_gpus_must_be_its_gpu_count(api: Api) -> None:
    register_version(api)
    gpu_host(api)  # 8 GPUs
    refused(
        deploy(api, "web", ["gpu-1"], engine_config={"parallel": {"size": 4}}),
        "host gpu-1: its engine config sets parallel.size 4, and each instance gets all 8 GPUs",
        "set --gpus-per-instance 4, or parallel.size 8",
    )
    assert deploy(api, "web", ["gpu-1"], engine_config={"parallel": {"size": 8}}).status_code == 201


def test_a_rollout_to_a_version_that_does_not_split_is_refused(api: Api) -> None:
    register_version(api, memory_plan=ARCHITECTURE)
    register_version(api, version="v2", memory_plan={**ARCHITECTURE, "num_heads": 10})
    gpu_host(api)
    assert deploy(api, "web", ["gpu-1"], per_host=2, gpus_per_instance=4).status_code == 201
    started = api.as_admin(
        "POST", "/api/v1/deployments/web/rollout", json={"to": "v2", "canary": 50}
    )
    refused(started, "parallel.size 4 does not divide the 10 attention heads of demo:v2")
    assert api.as_admin("GET", "/api/v1/deployments/web/rollout").status_code == 404
