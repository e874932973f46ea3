"""A fleet through the real API, for the tests of what runs on it (deployments, routes, canaries,
rollouts, traffic): a GPU host and its heartbeats, a serving deployment, the agents' reports."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, col, select

from controlplane.models import Model, ModelVersion
from protocol.version_ref import VersionRef
from protocol.wire import Manifest
from tests.controlplane.conftest import Api, deploy, gpu, manifest, register_version

V1_DIGEST = Manifest(**manifest("config.json", "model.safetensors")).digest()
V2_MANIFEST = manifest("config.json", "model.safetensors", seed=7)
V2_DIGEST = Manifest(**V2_MANIFEST).digest()
ADDRESS = "10.0.0.5"


def gpu_host(api: Api, name: str = "gpu-1", **body: Any) -> str:
    """Register a host and report its 8 GPUs (141 GiB each); returns its agent token."""
    agent: str = api.register(name, **body)["agent_token"]
    beat(api, agent, advertise_address=body.get("advertise_address"))
    return agent


def beat(api: Api, agent: str, **body: Any) -> Any:
    """A heartbeat of a host with 8 GPUs (a heartbeat without GPUs says the host has none),
    reporting the desired state the previous one got as applied, as an agent does."""
    body.setdefault("applied_generation", api.generations.get(agent, 0))
    response = api.heartbeat(agent, gpus=[gpu(i) for i in range(8)], **body)
    assert response.status_code == 200, response.text
    reply = response.json()
    api.generations[agent] = reply["generation"]
    return reply


def serving_fleet(api: Api, per_host: int = 2, address: str | None = ADDRESS) -> str:
    """demo:v1 and demo:v2 registered, host gpu-1 (8 GPUs) advertising ADDRESS, deployment web
    of demo:v1 with PER_HOST instances there; returns the host's agent token."""
    register_version(api)
    register_version(api, version="v2", manifest=V2_MANIFEST)
    agent = gpu_host(api, advertise_address=address)
    response = deploy(api, "web", ["gpu-1"], per_host=per_host)
    assert response.status_code == 201, response.text
    return agent


def report(
    api: Api, agent: str, state: str = "ready", address: str | None = ADDRESS, **digests: str
) -> list[dict[str, Any]]:
    """Heartbeats (from ADDRESS, as agents always say) reporting every desired instance in STATE,
    running the digest of its desired version (or DIGESTS[str(id)]); returns the desired
    instances."""
    desired: list[dict[str, Any]] = beat(api, agent, advertise_address=address)["instances"]
    observed = [
        {
            "instance_id": i["instance_id"],
            "state": state,
            "port": i["port"],
            "version_digest": digests.get(str(i["instance_id"]), i["model"]["digest"]),
        }
        for i in desired
    ]
    beat(api, agent, instances=observed, advertise_address=address)
    return desired


def version_id_of(api: Api, ref: str) -> int:
    """The id of REF (`MODEL:VERSION`) in the store: what routes and traffic windows carry."""
    version = VersionRef.parse(ref)
    with Session(api.engine) as session:
        found = session.exec(
            select(ModelVersion.id)
            .join(Model, col(Model.id) == col(ModelVersion.model_id))
            .where(Model.name == version.model, ModelVersion.version == version.version)
        ).one()
    assert found is not None
    return found
