"""Threat: a file server (or the control plane) chooses how much the agent downloads and keeps.

A hostile or broken server may send more bytes than the manifest says (an endless body fills the
disk), answer a resumed fetch with bytes from the wrong offset (the file is spliced together
wrong), or send an endless error page (the agent's memory). Each is stopped at the agent: the
transfer ends once past the manifest size, a 206 is used only when its `Content-Range` is the
range asked for, and error bodies are read up to 4 KiB. Real servers on loopback, real fetches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.control_plane import ControlPlaneLink
from agent.errors import (
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    SnapshotError,
    SnapshotMismatch,
)
from agent.snapshots import SnapshotStore
from protocol.manifest import compute_manifest
from protocol.wire import Heartbeat, Manifest
from tests.agent.loopback import Answer, LoopbackServer, Seen, endless, file_answer

MIB = 1 << 20
# A fix stops these in well under a second; without one they would run until the server gives up.
DEADLINE_S = 15.0


def weights(tmp_path: Path, size: int = 300_000) -> tuple[Path, Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
    return src, compute_manifest(src)


def finishes(work: Callable[[], object], cancel: threading.Event | None = None) -> BaseException:
    """Run WORK in a thread; it must end (with an exception) before the deadline."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the test, whatever it is
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        if cancel is not None:
            cancel.set()
        pytest.fail(f"still reading from the server after {DEADLINE_S} s")
    assert outcome, "WORK was expected to fail"
    return outcome[0]


@pytest.mark.parametrize("announce", [False, True], ids=["close-delimited", "huge-length"])
def test_a_server_sending_more_than_the_manifest_size_is_cut_off(
    tmp_path: Path, announce: bool
) -> None:
    _src, manifest = weights(tmp_path)
    size = manifest.files[0].size
    headers = {"Content-Length": str(1 << 40)} if announce else {}

    def route(seen: Seen) -> Answer:
        return 200, headers, endless(stop=server.stop)

    store = SnapshotStore(tmp_path / "store")
    cancel = threading.Event()
    with LoopbackServer(route) as server:
        error = finishes(
            lambda: store.fetch(manifest, "s3://x", files_url=server.url, cancel=cancel), cancel
        )
        assert server.bytes_sent < size + 16 * MIB  # socket buffers, not the disk, took the rest
    assert isinstance(error, SnapshotMismatch), error
    message = str(error)
    assert f"expected {size} bytes" in message
    assert ("more than" if not announce else "announced") in message
    partial = tmp_path / "store" / "partial" / manifest.digest()
    assert not partial.exists() or all(
        p.stat().st_size <= size for p in partial.rglob("*") if p.is_file()
    )
    store.close()


def _resume_scenario(
    tmp_path: Path, answer_resume: Callable[[bytes, int], Answer]
) -> tuple[SnapshotStore, Manifest, bytes, LoopbackServer, BaseException]:
    """A first transfer cut at 100 000 bytes, then a resume answered by ANSWER_RESUME."""
    src, manifest = weights(tmp_path)
    data = (src / "model.safetensors").read_bytes()
    calls: list[str | None] = []

    def route(seen: Seen) -> Answer:
        rng = seen.headers.get("range")
        calls.append(rng)
        if len(calls) == 1:  # the first transfer breaks after 100 000 bytes
            return 200, {"Content-Length": str(len(data))}, [data[:100_000]]
        if rng:
            return answer_resume(data, int(rng.removeprefix("bytes=").rstrip("-")))
        return file_answer(data, None)

    store = SnapshotStore(tmp_path / "store")
    server = LoopbackServer(route).__enter__()
    with pytest.raises(SnapshotError, match="interrupted"):
        store.fetch(manifest, "s3://x", files_url=server.url)
    partial_file = tmp_path / "store" / "partial" / manifest.digest() / "model.safetensors"
    assert partial_file.stat().st_size == 100_000
    try:
        store.fetch(manifest, "s3://x", files_url=server.url)
        error: BaseException = AssertionError("no error")
    except SnapshotError as exc:
        error = exc
    return store, manifest, data, server, error


def test_a_resume_answered_with_the_wrong_range_is_not_spliced_into_the_file(
    tmp_path: Path,
) -> None:
    def wrong_range(data: bytes, start: int) -> Answer:
        # 206 for the whole file: appending it at `start` would corrupt the file.
        return 206, {"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"}, data

    store, manifest, data, server, error = _resume_scenario(tmp_path, wrong_range)
    try:
        assert not isinstance(error, SnapshotMismatch), error
        assert "Content-Range" in str(error) and "from the start" in str(error)
        partial_file = tmp_path / "store" / "partial" / manifest.digest() / "model.safetensors"
        assert not partial_file.exists()  # nothing was appended; the next try starts at zero
        path = store.fetch(manifest, "s3://x", files_url=server.url)
        assert (path / "model.safetensors").read_bytes() == data
        assert store.verify(manifest.digest()).ok
    finally:
        server.__exit__()
        store.close()


def test_a_resume_answered_with_200_and_the_whole_file_starts_the_file_over(
    tmp_path: Path,
) -> None:
    def ignores_range(data: bytes, start: int) -> Answer:
        return 200, {}, data

    store, manifest, data, server, error = _resume_scenario(tmp_path, ignores_range)
    try:
        assert isinstance(error, AssertionError) and str(error) == "no error"
        assert store.verify(manifest.digest()).ok
        assert (store.path_for(manifest.digest()) / "model.safetensors").read_bytes() == data
    finally:
        server.__exit__()
        store.close()


def test_an_endless_error_body_from_the_file_server_is_read_only_up_to_a_cap(
    tmp_path: Path,
) -> None:
    _src, manifest = weights(tmp_path)
    store = SnapshotStore(tmp_path / "store")

    def route(seen: Seen) -> Answer:
        return 500, {}, endless(b"<html>oops</html>" * 4096, stop=server.stop)

    with LoopbackServer(route) as server:
        error = finishes(lambda: store.fetch(manifest, "s3://x", files_url=server.url))
        assert server.bytes_sent < 16 * MIB
    assert isinstance(error, SnapshotError) and "HTTP 500: <html>oops" in str(error)
    assert len(str(error)) < 1000
    store.close()


@pytest.mark.parametrize(
    ("status", "kind"), [(500, ControlPlaneUnavailable), (403, ControlPlaneRejected)]
)
def test_an_endless_error_body_from_the_control_plane_is_read_only_up_to_a_cap(
    status: int, kind: type[Exception]
) -> None:
    def route(seen: Seen) -> Answer:
        return status, {}, endless(b'{"error": "' + b"x" * 65536, stop=server.stop)

    with LoopbackServer(route) as server:
        link = ControlPlaneLink(server.url, timeout_s=5.0)
        error = finishes(lambda: link.heartbeat(Heartbeat(), "agent-token"))
        assert server.bytes_sent < 16 * MIB
        link.close()
    assert isinstance(error, kind), error
    assert len(str(error)) < 1000
