"""REST API behaviour on SQLite and PostgreSQL: models, deployments, hosts, events, status."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlmodel import Session

from controlplane.app import create_app
from controlplane.auth import Role, mint_token
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings
from protocol.wire import Manifest
from tests.controlplane.conftest import PG_ADMIN_URL, Api, deploy, manifest, register_version


def test_version_registration_is_immutable_and_idempotent(api: Api) -> None:
    created = register_version(api)
    assert created["digest"] == Manifest(**manifest("config.json", "model.safetensors")).digest()
    assert created["file_count"] == 2
    again = api.as_admin(
        "POST",
        "/api/v1/models/demo/versions",
        json={
            "version": "v1",
            "manifest": manifest("config.json", "model.safetensors"),
            "source_uri": "/nonexistent",
        },
    )
    assert again.status_code == 200
    other = api.as_admin(
        "POST",
        "/api/v1/models/demo/versions",
        json={"version": "v1", "manifest": manifest("other.bin"), "source_uri": "/x"},
    )
    assert other.status_code == 409
    assert "immutable" in other.json()["message"]
    shown = api.as_admin("GET", "/api/v1/models/demo/versions/v1").json()
    assert [f["path"] for f in shown["manifest"]["files"]] == ["config.json", "model.safetensors"]


def test_version_lineage_memory_plan_and_deprecation(api: Api) -> None:
    register_version(api, memory_plan={"weights_bytes": 2**30, "kv_bytes_per_token": 4096})
    child = register_version(api, version="v2", line="diffusion", parent="demo:v1")
    assert child["parent"] == "demo:v1" and child["line"] == "diffusion"
    missing = api.as_admin(
        "POST",
        "/api/v1/models/demo/versions",
        json={"version": "v3", "manifest": manifest("a"), "source_uri": "/x", "parent": "demo:v9"},
    )
    assert missing.status_code == 422 and "demo:v9" in missing.json()["message"]
    listed = api.as_admin("GET", "/api/v1/models").json()
    assert [v["version"] for v in listed[0]["versions"]] == ["v1", "v2"]
    assert listed[0]["versions"][0]["memory_plan"]["kv_bytes_per_token"] == 4096
    dep = api.as_admin("POST", "/api/v1/models/demo/versions/v1/deprecate")
    assert dep.status_code == 200 and dep.json()["deprecated"] is True
    refused = deploy(api, "web", ["nohost"])
    assert refused.status_code == 422 and "deprecated" in refused.json()["message"]


def test_digest_mismatch_and_bad_manifest_paths_are_rejected(api: Api) -> None:
    body = {"version": "v1", "manifest": manifest("a"), "source_uri": "/x", "digest": "0" * 64}
    response = api.as_admin("POST", "/api/v1/models/demo/versions", json=body)
    assert response.status_code == 422 and "digest" in response.json()["message"]
    for bad in ["../etc/passwd", "/abs", "a//b", "a/./b"]:
        body = {"version": "v1", "manifest": manifest(bad), "source_uri": "/x"}
        response = api.as_admin("POST", "/api/v1/models/demo/versions", json=body)
        assert response.status_code == 422, bad
        assert "manifest.files.0.path" in response.json()["message"]


def test_version_files_are_served_with_range_and_confined(api: Api, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    payload = bytes(range(256)) * 40
    (source / "model.safetensors").write_bytes(payload)
    (tmp_path / "secret.txt").write_text("not yours")
    (source / "link").symlink_to(tmp_path / "secret.txt")
    entries = [
        {"path": "model.safetensors", "size": len(payload),
         "sha256": hashlib.sha256(payload).hexdigest()},
        {"path": "link", "size": 9, "sha256": "0" * 64},
    ]  # fmt: skip
    body = {"version": "v1", "manifest": {"files": entries}, "source_uri": f"file://{source}"}
    assert api.as_admin("POST", "/api/v1/models/demo/versions", json=body).status_code == 201
    url = "/api/v1/models/demo/versions/v1/files/"
    full = api.as_admin("GET", url + "model.safetensors")
    assert full.status_code == 200 and full.content == payload
    part = api.call("GET", url + "model.safetensors", api.admin, headers={"Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == payload[100:]
    assert api.as_admin("GET", url + "link").status_code == 404  # symlink out of the source dir
    assert api.as_admin("GET", url + "secret.txt").status_code == 404  # not in the manifest
    assert api.as_admin("GET", url + "../secret.txt").status_code == 404


def test_deployment_derives_instances_with_distinct_ports(api: Api) -> None:
    register_version(api)
    api.register("gpu-1", port_range=[18000, 18002])
    api.register("gpu-2", stamp={"pool": "a"})
    created = deploy(api, "web", ["gpu-1"], per_host=2, engine_config={"service": {"max_queue": 8}})
    assert created.status_code == 201, created.text
    ports = sorted((i["host"], i["port"]) for i in created.json()["instances"])
    assert ports == [("gpu-1", 18000), ("gpu-1", 18001)]
    second = deploy(api, "api", ["gpu-1"], per_host=2)
    assert second.status_code == 409 and "no free port" in second.json()["message"]
    assert api.as_admin("GET", "/api/v1/deployments/api").status_code == 404  # no partial write
    by_label = api.as_admin(
        "POST",
        "/api/v1/deployments",
        json={
            "name": "lab",
            "model": "demo",
            "version": "v1",
            "placement": {"labels": {"pool": "a"}},
        },
    )
    assert [i["host"] for i in by_label.json()["instances"]] == ["gpu-2"]
    scaled = api.as_admin("PATCH", "/api/v1/deployments/web", json={"instances_per_host": 1})
    assert [i["port"] for i in scaled.json()["instances"]] == [18000]
    assert api.as_admin("PATCH", "/api/v1/deployments/web", json={}).status_code == 422
    assert api.as_admin("DELETE", "/api/v1/deployments/web").status_code == 204
    names = [d["name"] for d in api.as_admin("GET", "/api/v1/deployments").json()]
    assert names == ["lab"]


def test_deployment_input_errors_name_what_to_fix(api: Api) -> None:
    register_version(api)
    unknown_host = deploy(api, "web", ["ghost"])
    assert unknown_host.status_code == 422 and "ghost" in unknown_host.json()["message"]
    bad_name = deploy(api, "Not_A_Label", ["ghost"])
    assert bad_name.status_code == 422 and bad_name.json()["message"].startswith("name:")
    api.register("gpu-1")
    assert deploy(api, "web", ["gpu-1"]).status_code == 201
    dup = deploy(api, "web", ["gpu-1"])
    assert dup.status_code == 409 and "already exists" in dup.json()["message"]
    empty = api.as_admin(
        "POST",
        "/api/v1/deployments",
        json={"name": "x", "model": "demo", "version": "v1", "placement": {}},
    )
    assert empty.status_code == 422 and "placement" in empty.json()["message"]


def test_drain_stops_instances_and_bumps_generation(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"], per_host=2)
    before = api.heartbeat(agent).json()
    drained = api.as_admin("POST", "/api/v1/hosts/gpu-1/drain").json()
    assert drained["draining"] is True
    assert {i["desired_state"] for i in drained["instances"]} == {"stopped"}
    after = api.heartbeat(agent).json()
    assert after["generation"] > before["generation"] and after["draining"] is True
    assert {i["desired_state"] for i in after["instances"]} == {"stopped"}
    undrained = api.as_admin("POST", "/api/v1/hosts/gpu-1/undrain").json()
    assert {i["desired_state"] for i in undrained["instances"]} == {"running"}
    kinds = [e["kind"] for e in api.as_admin("GET", "/api/v1/events").json()["items"]]
    assert "host.drained" in kinds and "host.undrained" in kinds


def test_removing_a_host_removes_its_instances_and_agent_token(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    assert api.as_admin("DELETE", "/api/v1/hosts/gpu-1").status_code == 204
    assert api.as_admin("GET", "/api/v1/hosts/gpu-1").status_code == 404
    assert api.as_admin("GET", "/api/v1/deployments/web").json()["instances"] == []
    assert api.heartbeat(agent).status_code == 401


def test_events_filter_and_cursor_pagination(api: Api) -> None:
    for i in range(5):
        api.register(f"h{i}")
    page = api.as_admin("GET", "/api/v1/events", params={"kind": "host.registered", "limit": 2})
    body = page.json()
    assert [e["subject"] for e in body["items"]] == ["host/h3", "host/h4"]
    first = api.as_admin("GET", "/api/v1/events", params={"after": 0, "limit": 3}).json()
    rest = api.as_admin(
        "GET", "/api/v1/events", params={"after": first["next_cursor"], "limit": 100}
    ).json()
    ids = [e["id"] for e in first["items"] + rest["items"]]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    everything = api.as_admin("GET", "/api/v1/events", params={"limit": 1000}).json()
    assert len(ids) == len(everything["items"])
    idle = api.as_admin("GET", "/api/v1/events", params={"after": rest["next_cursor"]}).json()
    assert idle == {"items": [], "next_cursor": rest["next_cursor"]}
    prefix = api.as_admin("GET", "/api/v1/events", params={"kind": "token.*"}).json()
    assert prefix["items"] and all(e["kind"].startswith("token.") for e in prefix["items"])


def test_status_counts_the_fleet(api: Api) -> None:
    register_version(api)
    agent = api.register("gpu-1")["agent_token"]
    deploy(api, "web", ["gpu-1"])
    api.heartbeat(agent, gpus=[{"index": 0, "uuid": "GPU-0"}])
    status = api.as_admin("GET", "/api/v1/status").json()
    assert status["hosts_by_state"] == {"ready": 1}
    assert status["gpus"] == 1 and status["deployments"] == 1 and status["versions"] == 1
    assert status["instances_by_state"] == {"pending": 1}


def test_health_endpoints_and_openapi(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"status": "ready"}
    paths = api.client.get("/openapi.json").json()["paths"]
    wanted = ["hosts", "models", "deployments", "events", "tokens", "agents/register",
              "agents/heartbeat"]  # fmt: skip
    for path in wanted:
        assert f"/api/v1/{path}" in paths


def test_an_unexpected_error_is_still_json(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("controlplane.api.health.ping", broken)
    client = TestClient(api.app, raise_server_exceptions=False)
    response = client.get("/readyz")
    assert response.status_code == 500
    assert response.json()["error"] == "internal" and "boom" not in response.text


def test_postgres_connections_dropped_by_the_server_are_replaced(pg_url: str) -> None:
    engine = make_engine(pg_url)
    admin = ensure_admin_token(engine)
    token = admin or ""
    if admin is None:  # the shared session database already has an admin token: mint one
        with Session(engine) as session:
            new = mint_token("pg-drop", Role.ADMIN, datetime.now(UTC))
            session.add(new.row)
            session.commit()
            token = new.secret
    app = create_app(
        ControlPlaneSettings(database_url=pg_url), engine=engine, run_controllers=False
    )
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(app) as client:
        assert client.get("/api/v1/hosts", headers=headers).status_code == 200
        name = pg_url.rsplit("/", 1)[1]
        killer = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with killer.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"
                ),
                {"db": name},
            )
        killer.dispose()
        first = client.get("/api/v1/hosts", headers=headers)
        assert first.status_code in (200, 503), first.text  # never a 500
        assert client.get("/api/v1/hosts", headers=headers).status_code == 200
    engine.dispose()


def test_changing_placement_moves_instances_and_tells_both_hosts(api: Api) -> None:
    register_version(api)
    agent_a = api.register("host-a")["agent_token"]
    agent_b = api.register("host-b")["agent_token"]
    deploy(api, "web", ["host-a"])
    gen_a, gen_b = api.heartbeat(agent_a).json(), api.heartbeat(agent_b).json()
    assert len(gen_a["instances"]) == 1 and gen_b["instances"] == []
    moved = api.as_admin(
        "PATCH", "/api/v1/deployments/web", json={"placement": {"hosts": ["host-b"]}}
    )
    assert [i["host"] for i in moved.json()["instances"]] == ["host-b"]
    after_a, after_b = api.heartbeat(agent_a).json(), api.heartbeat(agent_b).json()
    assert after_a["generation"] > gen_a["generation"] and after_a["instances"] == []
    assert after_b["generation"] > gen_b["generation"] and len(after_b["instances"]) == 1
