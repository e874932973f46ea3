"""Threat: the model file route serves files of the control plane's disk it was never meant to.

Finding 1: a version's manifest and source are whatever the registering operator sends, and the
file route served any path under that source to any viewer or agent, so `source_uri=/` and a
manifest naming the credentials file read out the admin token. Now a file is served only once
its own bytes, read from the descriptor that is then served, have the manifest's size and
sha256; `model_roots` bounds where sources may be; nothing is followed out of a source
directory; errors name no server path. Finding 5: an agent token fetched every version, not
only those its host runs. Finding 14 (part): `file://HOST/p` means one thing on both sides.

Real requests against the real app (SQLite and PostgreSQL), and a real `dctl server` process.
"""

# Fixtures imported from tests/controlplane are named again by the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest

from agent.snapshots import SnapshotStore
from controlplane.model_files import ModelFiles
from protocol.manifest import compute_manifest, hash_stream
from protocol.sources import local_source_dir
from protocol.wire import Manifest
from tests.cli.conftest import Dctl, Server, start_server
from tests.controlplane.conftest import (  # the app on SQLite and PostgreSQL, as fixtures
    Api,
    api,
    db_url,
    deploy,
    pg_url,
    sqlite_template,
)

V = "/api/v1/models"
PAYLOAD = bytes(range(256)) * 64  # 16 KiB


def entry(path: str, data: bytes) -> dict[str, Any]:
    """The manifest entry of DATA at PATH, as an honest client computes it."""
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def register(
    api: Api, version: str, source: str, entries: list[dict[str, Any]], token: str | None = None
) -> Any:
    """POST a version of model `demo` (as TOKEN, by default the admin)."""
    body = {"version": version, "manifest": {"files": entries}, "source_uri": source}
    return api.call("POST", f"{V}/demo/versions", token or api.admin, json=body)


def weights_dir(root: Path, data: bytes = PAYLOAD) -> Path:
    """A checkpoint directory with one weights file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(data)
    return root


def file_url(version: str, path: str = "model.safetensors") -> str:
    """The file route of demo:VERSION's PATH."""
    return f"{V}/demo/versions/{version}/files/{path}"


def assert_unavailable(response: Any, *secrets: str) -> None:
    """The route's one refusal for a file it will not serve, with no server path or secret."""
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "file_unavailable"
    for secret in secrets:
        assert secret not in response.text


# --- Finding 1: any file the control plane can read ------------------------------------------


@pytest.fixture
def real_server(tmp_path: Path) -> Iterator[Server]:
    """A `dctl server` of its own, whose first start wrote the admin token to its credentials."""
    server = start_server(tmp_path / "cp")
    try:
        yield server
    finally:
        server.stop()


def test_an_operator_cannot_read_the_admin_credentials_through_a_forged_manifest(
    real_server: Server,
) -> None:
    home_config = Path(real_server.env["XDG_CONFIG_HOME"])
    secrets_file = home_config / "dctl" / "credentials"
    content = secrets_file.read_bytes()
    assert real_server.admin_token.encode() in content
    admin = {"Authorization": f"Bearer {real_server.admin_token}"}
    with httpx.Client(base_url=real_server.url, timeout=30) as http:
        made = http.post("/api/v1/tokens", headers=admin, json={"name": "op", "role": "operator"})
        operator = {"Authorization": f"Bearer {made.json()['secret']}"}
        # The attacker knows where the file is and even its size, just not its content.
        guess = {"size": len(content), "sha256": "0" * 64}
        forged = [
            ("/", str(secrets_file.relative_to("/"))),
            (f"file://{secrets_file.parent}", secrets_file.name),
            (f"file://localhost{secrets_file.parent}", secrets_file.name),
        ]
        for number, (source, path) in enumerate(forged):
            body = {"version": f"v{number}", "source_uri": source,
                    "manifest": {"files": [{"path": path, **guess}]}}  # fmt: skip
            registered = http.post(f"{V}/demo/versions", headers=operator, json=body)
            assert registered.status_code == 201, registered.text
            url = file_url(f"v{number}", path)
            # Not even with the admin token: the bytes are not the manifest's.
            stolen = http.get(url, headers=admin)
            assert_unavailable(stolen, real_server.admin_token)
            assert stolen.json()["message"].startswith(f"file {path!r} of demo:v{number} is not")
            assert http.get(url, headers=operator).status_code == 403
            ranged = http.get(url, headers={**admin, "Range": "bytes=0-"})
            assert_unavailable(ranged, real_server.admin_token)


def test_a_file_is_served_only_while_its_bytes_match_the_manifest(api: Api, tmp_path: Path) -> None:
    src = weights_dir(tmp_path / "ckpt")
    assert register(api, "v1", str(src), [entry("model.safetensors", PAYLOAD)]).status_code == 201
    served = api.as_admin("GET", file_url("v1"))
    assert served.status_code == 200 and served.content == PAYLOAD
    assert served.headers["etag"] == f'"{hashlib.sha256(PAYLOAD).hexdigest()}"'
    # Same size, other bytes (an operator rewriting a file after registration): re-verified.
    (src / "model.safetensors").write_bytes(b"x" * len(PAYLOAD))
    assert_unavailable(api.as_admin("GET", file_url("v1")), str(tmp_path))
    (src / "model.safetensors").write_bytes(PAYLOAD)
    assert api.as_admin("GET", file_url("v1")).content == PAYLOAD
    # A wrong size is refused without hashing; a missing file gets the very same answer.
    (src / "model.safetensors").write_bytes(PAYLOAD + b"!")
    assert_unavailable(api.as_admin("GET", file_url("v1")), str(tmp_path))
    (src / "model.safetensors").unlink()
    missing = api.as_admin("GET", file_url("v1"))
    assert_unavailable(missing, str(tmp_path))
    assert missing.json()["message"] == api.as_admin("GET", file_url("v1")).json()["message"]


class CountingHasher:
    """The real hash, counted; the first call can wait for the test to let it go on."""

    def __init__(self, hold: bool = False) -> None:
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, handle: BinaryIO) -> tuple[int, str]:
        self.calls += 1
        self.started.set()
        assert self.release.wait(30)
        return hash_stream(handle)


def test_concurrent_requests_for_a_file_share_one_verification_kept_until_it_changes(
    api: Api, tmp_path: Path
) -> None:
    src = weights_dir(tmp_path / "ckpt")
    assert register(api, "v1", str(src), [entry("model.safetensors", PAYLOAD)]).status_code == 201
    hasher = CountingHasher(hold=True)
    files = ModelFiles(hasher=hasher)
    opened = 0
    real_open = files.open

    def counting_open(*args: Any) -> Any:
        nonlocal opened
        result = real_open(*args)
        opened += 1
        return result

    files.open = counting_open  # type: ignore[method-assign]
    api.app.state.model_files = files
    answers: list[Any] = []
    threads = [
        threading.Thread(target=lambda: answers.append(api.as_admin("GET", file_url("v1"))))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    assert hasher.started.wait(30)
    deadline = time.monotonic() + 30
    while opened < len(threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # every request has its file open: let each reach the verification
    hasher.release.set()
    for thread in threads:
        thread.join(30)
    assert [(a.status_code, a.content == PAYLOAD) for a in answers] == [(200, True)] * 8
    assert hasher.calls == 1
    assert api.as_admin("GET", file_url("v1")).status_code == 200
    assert hasher.calls == 1  # remembered: same file, same size, mtime and ctime
    later = time.time() + 5
    os.utime(src / "model.safetensors", (later, later))  # same bytes, new mtime: hashed again
    assert api.as_admin("GET", file_url("v1")).status_code == 200
    assert hasher.calls == 2


def test_a_symlink_swapped_in_during_verification_does_not_change_what_is_served(
    api: Api, tmp_path: Path
) -> None:
    src = weights_dir(tmp_path / "ckpt")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * len(PAYLOAD))
    assert register(api, "v1", str(src), [entry("model.safetensors", PAYLOAD)]).status_code == 201
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "model.safetensors").symlink_to(secret)

    def swapping_hasher(handle: BinaryIO) -> tuple[int, str]:
        # The race an attacker wins at best: the path leads elsewhere once the file is open.
        src.rename(tmp_path / "moved")
        src.symlink_to(evil)
        return hash_stream(handle)

    api.app.state.model_files = ModelFiles(hasher=swapping_hasher)
    served = api.as_admin("GET", file_url("v1"), headers={"Range": "bytes=100-"})
    assert served.status_code == 206 and served.content == PAYLOAD[100:]
    assert_unavailable(api.as_admin("GET", file_url("v1")), str(tmp_path))  # opened anew


def test_nothing_is_followed_out_of_the_source_even_for_content_the_caller_knows(
    api: Api, tmp_path: Path
) -> None:
    # A public file outside the source: its hash is no secret, yet it is not the version's.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "public.bin").write_bytes(PAYLOAD)
    src = weights_dir(tmp_path / "ckpt")
    (src / "rel-link.bin").symlink_to("../outside/public.bin")
    (src / "abs-link.bin").symlink_to(outside / "public.bin")
    (src / "dir-link").symlink_to(outside)
    (src / "nested").mkdir()
    (src / "nested" / "alias.bin").symlink_to("../model.safetensors")  # stays inside: fine
    (src / "self.bin").symlink_to(src / "model.safetensors")  # absolute, inside: fine
    names = ["rel-link.bin", "abs-link.bin", "dir-link/public.bin", "nested/alias.bin", "self.bin"]
    entries = [entry(name, PAYLOAD) for name in names]
    assert register(api, "v1", str(src), entries).status_code == 201
    for name in names[:3]:
        assert_unavailable(api.as_admin("GET", file_url("v1", name)), str(tmp_path))
    for name in names[3:]:
        served = api.as_admin("GET", file_url("v1", name))
        assert served.status_code == 200 and served.content == PAYLOAD, name
    os.mkfifo(src / "pipe")  # must not hang the server opening it
    assert register(api, "v2", str(src), [entry("pipe", b"")]).status_code == 201
    assert_unavailable(api.as_admin("GET", file_url("v2", "pipe")), str(tmp_path))


@pytest.fixture
def model_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`DCTL_MODEL_ROOTS` set to one directory before the `api` fixture reads its settings."""
    root = tmp_path / "models"
    root.mkdir()
    monkeypatch.setenv("DCTL_MODEL_ROOTS", f"{root}{os.pathsep}{tmp_path / 'more'}")
    return root


@pytest.fixture
def rooted_api(model_root: Path, api: Api) -> Api:
    """The app, built after `model_root` set the environment it reads `model_roots` from."""
    assert api.settings.model_roots[0] == model_root.resolve()
    return api


def test_model_roots_refuse_sources_outside_them_with_403_naming_the_setting(
    rooted_api: Api, model_root: Path, tmp_path: Path
) -> None:
    api = rooted_api
    operator = api.token("operator")
    inside = weights_dir(model_root / "demo")
    outside = weights_dir(tmp_path / "elsewhere")
    good = [entry("model.safetensors", PAYLOAD)]
    for number, source in enumerate(
        ["/", str(outside), f"file://{outside}", f"{model_root}/../elsewhere", str(tmp_path)]
    ):
        refused = register(api, f"o{number}", source, good, operator)
        assert refused.status_code == 403, (source, refused.text)
        message = refused.json()["message"]
        assert "model_roots" in message and "DCTL_MODEL_ROOTS" in message
        # The caller's own source is echoed; the configured roots are not disclosed.
        assert str(model_root) not in message.replace(source, "")
    assert register(api, "v1", str(inside), good, operator).status_code == 201
    assert register(api, "v2", f"file://localhost{inside}", good, operator).status_code == 201
    assert register(api, "v3", "s3://bucket/demo", good, operator).status_code == 201  # remote
    for version in ("v1", "v2"):
        assert api.as_admin("GET", file_url(version)).content == PAYLOAD


def test_a_source_under_model_roots_cannot_lead_out_of_them_by_symlink(
    rooted_api: Api, model_root: Path, tmp_path: Path
) -> None:
    api = rooted_api
    outside = weights_dir(tmp_path / "elsewhere")
    store = weights_dir(model_root / "store" / "demo")
    (model_root / "escape").symlink_to(outside)  # by name inside the root, in fact outside
    (model_root / "relative-escape").symlink_to("../elsewhere")
    (model_root / "alias").symlink_to(store)  # an absolute symlink within the root: fine
    good = [entry("model.safetensors", PAYLOAD)]
    for version, name in [("v1", "escape"), ("v2", "relative-escape"), ("v3", "alias")]:
        assert register(api, version, str(model_root / name), good).status_code == 201
    assert_unavailable(api.as_admin("GET", file_url("v1")), str(tmp_path))
    assert_unavailable(api.as_admin("GET", file_url("v2")), str(tmp_path))
    assert api.as_admin("GET", file_url("v3")).content == PAYLOAD


def test_range_requests_are_answered_from_the_verified_descriptor(api: Api, tmp_path: Path) -> None:
    src = weights_dir(tmp_path / "ckpt")
    assert register(api, "v1", str(src), [entry("model.safetensors", PAYLOAD)]).status_code == 201
    size = len(PAYLOAD)
    etag = f'"{hashlib.sha256(PAYLOAD).hexdigest()}"'

    def get(**headers: str) -> Any:
        return api.call("GET", file_url("v1"), api.admin, headers=headers)

    for header, first, last in [("bytes=100-", 100, size - 1), ("bytes=10-19", 10, 19),
                                ("bytes=-16", size - 16, size - 1),
                                ("bytes=5-999999", 5, size - 1)]:  # fmt: skip
        part = get(Range=header)
        assert part.status_code == 206, header
        assert part.content == PAYLOAD[first : last + 1]
        assert part.headers["content-range"] == f"bytes {first}-{last}/{size}"
        assert part.headers["content-length"] == str(last - first + 1)
    for header in ["bytes=0-1,5-6", "items=0-1", "bytes=9-2", "bytes=x-"]:
        whole = get(Range=header)
        assert whole.status_code == 200 and whole.content == PAYLOAD, header
    past = get(Range=f"bytes={size}-")
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    stale = get(Range="bytes=100-", **{"If-Range": '"another-version"'})
    assert stale.status_code == 200 and stale.content == PAYLOAD
    fresh = get(Range="bytes=100-", **{"If-Range": etag})
    assert fresh.status_code == 206 and fresh.content == PAYLOAD[100:]


# --- Finding 5: an agent token fetches only what its host runs -------------------------------


def test_an_agent_token_downloads_only_the_versions_its_host_runs(api: Api, tmp_path: Path) -> None:
    src = weights_dir(tmp_path / "ckpt")
    good = [entry("model.safetensors", PAYLOAD)]
    assert register(api, "v1", str(src), good).status_code == 201
    assert register(api, "v2", str(src), good).status_code == 201
    gpu1 = api.register("gpu-1")["agent_token"]
    gpu2 = api.register("gpu-2")["agent_token"]
    assert deploy(api, "one", ["gpu-1"]).status_code == 201  # demo:v1 on gpu-1
    assert deploy(api, "two", ["gpu-2"], version="v2").status_code == 201
    assert api.call("GET", file_url("v1"), gpu1).content == PAYLOAD
    assert api.call("GET", file_url("v2"), gpu2).content == PAYLOAD
    for token, version in [(gpu1, "v2"), (gpu2, "v1"), (gpu1, "v9")]:
        refused = api.call("GET", file_url(version), token)
        assert refused.status_code == 403, refused.text
        assert "desired state" in refused.json()["message"]
    for role in ("viewer", "operator"):  # they read manifests; weights go to agents
        assert api.call("GET", file_url("v1"), api.token(role)).status_code == 403
    assert api.as_admin("GET", file_url("v2")).status_code == 200
    assert api.as_admin("DELETE", "/api/v1/deployments/one").status_code == 204
    assert api.call("GET", file_url("v1"), gpu1).status_code == 403  # no longer runs it


# --- Finding 14 (part): file:// URIs mean one thing on both sides ----------------------------


def test_a_file_uri_naming_another_host_is_refused_at_registration(
    api: Api, tmp_path: Path
) -> None:
    good = [entry("model.safetensors", PAYLOAD)]
    for source in ["file://otherhost/x", "file://otherhost/" + str(tmp_path), "relative/dir"]:
        refused = register(api, "v1", source, good)
        assert refused.status_code == 422, (source, refused.text)
        message = refused.json()["message"]
        assert "absolute path" in message and "file:///PATH" in message and "URL" in message


def test_file_uris_with_an_empty_host_or_localhost_are_local_on_both_sides(
    api: Api, tmp_path: Path
) -> None:
    src = weights_dir(tmp_path / "ckpt")
    manifest = compute_manifest(src)
    good = [e.model_dump() for e in manifest.files]
    forms = {"v1": f"file://{src}", "v2": f"file://localhost{src}"}
    agent = api.register("gpu-1")["agent_token"]
    for version, uri in forms.items():
        assert local_source_dir(uri) is not None and str(local_source_dir(uri)) == str(src)
        assert register(api, version, uri, good).status_code == 201
        assert api.as_admin("GET", file_url(version)).content == PAYLOAD  # control plane: local
        body = {"name": f"d-{version}", "model": "demo", "version": version,
                "placement": {"hosts": ["gpu-1"]}}  # fmt: skip
        assert api.as_admin("POST", "/api/v1/deployments", json=body).status_code == 201
    desired = api.heartbeat(agent).json()["instances"]
    assert {i["model"]["files_url"] for i in desired} == {
        f"{V}/demo/versions/{v}/files/" for v in forms
    }
    # The agent: a local source is copied from disk, no files_url needed.
    for number, uri in enumerate(forms.values()):
        store = SnapshotStore(tmp_path / f"store{number}", model_roots=[tmp_path])
        path = store.fetch(manifest, uri, files_url=None)
        assert (path / "model.safetensors").read_bytes() == PAYLOAD


# --- The operator's and the agent's everyday path, on a real server --------------------------


def test_register_then_an_agent_resumes_a_download_from_a_real_control_plane(
    tmp_path: Path,
) -> None:
    home = tmp_path / "cp"
    roots = tmp_path / "models"
    src = weights_dir(roots / "demo" / "v1", bytes(range(256)) * 4096)  # 1 MiB
    (home / "config" / "dctl").mkdir(parents=True)
    (home / "config" / "dctl" / "config.toml").write_text(
        f'[controlplane]\nmodel_roots = ["{roots}"]\n'
    )
    server = start_server(home)
    try:
        admin = {"Authorization": f"Bearer {server.admin_token}"}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            made = http.post(
                "/api/v1/tokens", headers=admin, json={"name": "op", "role": "operator"}
            )
            cli = Dctl({"XDG_CONFIG_HOME": server.env["XDG_CONFIG_HOME"],
                        "DCTL_URL": server.url, "DCTL_TOKEN": made.json()["secret"]})  # fmt: skip
            done = cli("model", "register", "demo:v1", str(src))
            assert done.code == 0, done.stderr
            outside = cli("model", "register", "demo:v2", str(weights_dir(tmp_path / "x")))
            assert outside.code != 0 and "model_roots" in outside.stderr
            boot = http.post(
                "/api/v1/tokens", headers=admin, json={"name": "boot", "role": "bootstrap"}
            )
            bootstrap = {"Authorization": f"Bearer {boot.json()['secret']}"}
            joined = http.post("/api/v1/agents/register", headers=bootstrap, json={"name": "gpu-1"})
            agent = joined.json()["agent_token"]
            body = {"name": "web", "model": "demo", "version": "v1",
                    "placement": {"hosts": ["gpu-1"]}}  # fmt: skip
            assert http.post("/api/v1/deployments", headers=admin, json=body).status_code == 201
        manifest = Manifest.model_validate(compute_manifest(src).model_dump())
        store_root = tmp_path / "store"
        partial = store_root / "partial" / manifest.digest()
        partial.mkdir(parents=True)
        weights = (src / "model.safetensors").read_bytes()
        (partial / "model.safetensors").write_bytes(weights[:300_000])  # an interrupted fetch
        seen: list[tuple[str | None, int, str | None]] = []

        def record(response: httpx.Response) -> None:
            seen.append((response.request.headers.get("range"), response.status_code,
                         response.headers.get("content-range")))  # fmt: skip

        http_client = httpx.Client(timeout=30, event_hooks={"response": [record]})
        store = SnapshotStore(store_root, http=http_client)
        try:
            # As if the weights were on another machine: they come over HTTP.
            path = store.fetch(
                manifest,
                "s3://elsewhere/demo",
                files_url=f"{server.url}{V}/demo/versions/v1/files/",
                headers={"Authorization": f"Bearer {agent}"},
            )
        finally:
            store.close()
        assert (path / "model.safetensors").read_bytes() == weights
        assert ("bytes=300000-", 206, f"bytes 300000-{len(weights) - 1}/{len(weights)}") in seen
    finally:
        server.stop()
