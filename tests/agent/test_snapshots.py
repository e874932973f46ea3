"""Snapshot store: verified fetches from a directory, file:// and HTTP (with Range resume)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from agent.errors import FetchCancelled, SnapshotError, SnapshotMismatch
from agent.snapshots import SnapshotStore
from protocol.manifest import compute_manifest
from protocol.wire import SnapshotProgress


def make_checkpoint(root: Path, seed: int = 0) -> Path:
    """A small real checkpoint: safetensors weights in a subfolder plus a config file."""
    rng = np.random.default_rng(seed)
    (root / "shards").mkdir(parents=True)
    save_file({"w": rng.standard_normal((256, 256)).astype(np.float32)},
              str(root / "shards" / "model.safetensors"))  # fmt: skip
    (root / "config.json").write_text(f'{{"seed": {seed}}}')
    return root


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves files under `root`, honours `Range: bytes=N-`, and can cut a response short."""

    root: Path
    cut_after: int | None = None
    requests: list[tuple[str, str | None, str | None]]

    def do_GET(self) -> None:
        rel = self.path.removeprefix("/files/")
        self.requests.append((rel, self.headers.get("Range"), self.headers.get("Authorization")))
        path = self.root / rel
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        if rng := self.headers.get("Range"):
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = type(self).cut_after
        if cut is not None and len(body) > cut:
            type(self).cut_after = None  # only the first transfer is cut
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.close()
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def file_server(tmp_path: Path) -> Iterator[tuple[str, type[_RangeHandler]]]:
    handler = type("Handler", (_RangeHandler,), {"root": tmp_path / "src", "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/files", handler
    server.shutdown()
    server.server_close()


def test_fetch_from_a_local_directory_verifies_and_is_read_only(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    manifest = compute_manifest(src)
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    seen: list[SnapshotProgress] = []
    path = store.fetch(manifest, str(src), progress=seen.append)
    assert path == store.path_for(manifest.digest())
    assert (path / "shards" / "model.safetensors").read_bytes() == (
        src / "shards" / "model.safetensors"
    ).read_bytes()
    assert (path / "config.json").stat().st_mode & 0o222 == 0
    assert seen[-1].state == "ready" and seen[-1].percent() == 100.0
    assert store.verify(manifest.digest()).ok
    assert not any((tmp_path / "store" / "partial").iterdir())


def test_file_uri_source(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    path = store.fetch(compute_manifest(src), src.as_uri())
    assert (path / "config.json").exists()


def test_mismatch_names_the_file_deletes_partial_data_and_keeps_the_old_snapshot(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    old = make_checkpoint(tmp_path / "old", seed=1)
    old_digest = compute_manifest(old).digest()
    store.fetch(compute_manifest(old), str(old))
    src = make_checkpoint(tmp_path / "src", seed=2)
    manifest = compute_manifest(src)
    weights = src / "shards" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF  # same size, one flipped byte
    weights.write_bytes(bytes(blob))
    seen: list[SnapshotProgress] = []
    with pytest.raises(SnapshotMismatch, match=r"shards/model\.safetensors") as info:
        store.fetch(manifest, str(src), progress=seen.append)
    assert info.value.path == "shards/model.safetensors"
    assert seen[-1].state == "failed" and "shards/model.safetensors" in seen[-1].error
    assert not store.has(manifest.digest())
    assert not (tmp_path / "store" / "partial" / manifest.digest()).exists()
    assert store.has(old_digest) and store.verify(old_digest).ok


def test_http_fetch_resumes_with_range_after_a_cut(
    tmp_path: Path, file_server: tuple[str, type[_RangeHandler]]
) -> None:
    url, handler = file_server
    src = make_checkpoint(tmp_path / "src")
    manifest = compute_manifest(src)
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    handler.cut_after = 100_000  # the weights file is ~256 KiB: the first transfer breaks
    auth = {"Authorization": "Bearer agent-token"}
    with pytest.raises(SnapshotError, match="interrupted"):
        store.fetch(manifest, "s3://elsewhere/model", files_url=url, headers=auth)
    partial = tmp_path / "store" / "partial" / manifest.digest()
    assert (partial / "shards" / "model.safetensors").stat().st_size == 100_000
    path = store.fetch(manifest, "s3://elsewhere/model", files_url=url, headers=auth)
    assert store.verify(manifest.digest()).ok
    assert (path / "shards" / "model.safetensors").stat().st_size == manifest.files[1].size
    ranges = [r for rel, r, _ in handler.requests if rel == "shards/model.safetensors"]
    assert ranges == [None, "bytes=100000-"]
    assert all(a == "Bearer agent-token" for _, _, a in handler.requests)


def test_unreachable_source_without_file_url_says_what_to_fix(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    manifest = compute_manifest(src)
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    with pytest.raises(SnapshotError, match="make the source reachable"):
        store.fetch(manifest, str(tmp_path / "missing"))


def test_verify_detects_on_disk_corruption(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    manifest = compute_manifest(src)
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    path = store.fetch(manifest, str(src))
    target = path / "config.json"
    target.chmod(0o644)
    target.write_text('{"seed": 9}')
    result = store.verify(manifest.digest())
    assert not result.ok and result.bad_files == ["config.json"]


def test_prune_keeps_the_last_n_and_those_in_use(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", keep=2, model_roots=[tmp_path])
    digests = []
    for seed in range(4):
        src = make_checkpoint(tmp_path / f"src{seed}", seed=seed)
        manifest = compute_manifest(src)
        store.fetch(manifest, str(src))
        digests.append(manifest.digest())
    for i, digest in enumerate(digests):  # make the use order explicit (mtime resolution)
        os.utime(tmp_path / "store" / "manifests" / f"{digest}.json", (1000 + i, 1000 + i))
    removed = store.prune(in_use={digests[0]})
    assert removed == [digests[1]]
    assert set(store.digests()) == {digests[0], digests[2], digests[3]}


def test_a_cancelled_fetch_keeps_its_partial_data_for_the_next_attempt(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    manifest = compute_manifest(src)
    store = SnapshotStore(tmp_path / "store", model_roots=[tmp_path])
    stop = threading.Event()
    stop.set()
    with pytest.raises(FetchCancelled):
        store.fetch(manifest, str(src), cancel=stop)
    assert (tmp_path / "store" / "partial" / manifest.digest()).is_dir()
    assert not store.has(manifest.digest())
    store.fetch(manifest, str(src))
    assert store.verify(manifest.digest()).ok
