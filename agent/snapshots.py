"""Content-addressed weight snapshots, verified before use.

Layout under the store root:
    snapshots/<digest>/...   complete, verified snapshots (files read-only); engines load these
    manifests/<digest>.json  the manifest each snapshot was verified against; its mtime = last use
    partial/<digest>/...     a fetch in progress (kept across agent restarts so HTTP can resume)

A fetch streams every file through sha256 while copying it, compares size and digest with the
manifest, and only then renames the whole directory into `snapshots/` in one step, so an engine
never sees a half-written or unverified snapshot. A mismatch deletes the partial data and names
the file; whatever snapshot was serving before stays in place.

A manifest's author chooses its source and its file names, so a local source is read only when it
lies below one of the store's model roots, each file opened without a symlink leading out of it
(`runtime/model_roots.py`); anything else comes from the control plane's file URL. Otherwise
the copy and its mismatch report would tell the author the size and digest of any file the
agent can read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import quote

import httpx

from agent.errors import FetchCancelled, SnapshotError, SnapshotMismatch, TransferRefused
from agent.http_bodies import error_text
from protocol.manifest import hash_file
from protocol.sources import local_source_dir
from protocol.wire import Manifest, ManifestEntry, SnapshotProgress
from runtime.model_roots import SourceFileError, locate_in_roots, open_source_file
from runtime.tls import client_context

log = logging.getLogger("dctl.agent.snapshots")
CHUNK = 1 << 20
DEFAULT_KEEP = 3
ProgressCallback = Callable[[SnapshotProgress], None]
FetchState = Literal["downloading", "verifying", "ready", "failed"]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of re-hashing a stored snapshot."""

    digest: str
    ok: bool
    bad_files: list[str]


class _Meter:
    """Bytes done and rate of one fetch, reported at most every `interval_s`."""

    def __init__(
        self,
        digest: str,
        total: int,
        callback: ProgressCallback | None,
        cancel: threading.Event | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self.digest, self.total, self.callback = digest, total, callback
        self.cancel = cancel
        self.interval_s = interval_s
        self.done = 0
        self.started = time.monotonic()
        self._last = 0.0

    def progress(self, state: FetchState = "downloading", error: str = "") -> SnapshotProgress:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        return SnapshotProgress(
            digest=self.digest,
            state=state,
            bytes_done=min(self.done, self.total),
            bytes_total=self.total,
            bytes_per_s=self.done / elapsed,
            error=error[:1000],
        )

    def add(self, count: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise FetchCancelled(f"snapshot {self.digest[:12]}: fetch cancelled")
        self.done += count
        now = time.monotonic()
        if self.callback and now - self._last >= self.interval_s:
            self._last = now
            self.callback(self.progress())

    def finish(self, state: FetchState, error: str = "") -> None:
        if self.callback:
            self.callback(self.progress(state, error))


class SnapshotStore:
    """Verified, content-addressed weight snapshots under one directory; keeps the last N."""

    def __init__(
        self,
        root: Path,
        keep: int = DEFAULT_KEEP,
        http: httpx.Client | None = None,
        tls: ssl.SSLContext | None = None,
        model_roots: Sequence[Path] = (),
    ) -> None:
        self.root = root
        self.keep = keep
        # Local sources are copied only from below these (none: every file over HTTP).
        self.model_roots = tuple(model_roots)
        self._http = http
        # Snapshots come from the control plane only: verified like the agent's link to it.
        self._tls = tls
        for sub in ("snapshots", "manifests", "partial"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Close the HTTP client, if one was opened."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def path_for(self, digest: str) -> Path:
        """Where the verified snapshot with this digest lives (whether or not it exists yet)."""
        return self.root / "snapshots" / digest

    def has(self, digest: str) -> bool:
        """True when a verified snapshot with this digest is in the store."""
        return self.path_for(digest).is_dir() and self._manifest_file(digest).is_file()

    def digests(self) -> list[str]:
        """Stored snapshots, most recently used first."""
        found = [d.name for d in (self.root / "snapshots").iterdir() if self.has(d.name)]
        return sorted(found, key=lambda d: self._manifest_file(d).stat().st_mtime, reverse=True)

    def touch(self, digest: str) -> None:
        """Mark a snapshot as used now (it is the last to be pruned)."""
        os.utime(self._manifest_file(digest))

    def _manifest_file(self, digest: str) -> Path:
        return self.root / "manifests" / f"{digest}.json"

    def fetch(
        self,
        manifest: Manifest,
        source_uri: str,
        files_url: str | None = None,
        headers: dict[str, str] | None = None,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> Path:
        """Make the snapshot present and verified; returns its path. Raises `SnapshotError`.

        Setting CANCEL stops the transfer at the next chunk, keeping the partial data.
        """
        digest = manifest.digest()
        if self.has(digest):
            self.touch(digest)
            return self.path_for(digest)
        partial = self.root / "partial" / digest
        partial.mkdir(parents=True, exist_ok=True)
        meter = _Meter(digest, manifest.total_bytes(), progress, cancel)
        source_dir = local_source_dir(source_uri)
        local = self._local_source(source_dir, source_uri)
        try:
            for entry in manifest.files:
                target = partial / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = None if local is None else self._open_local(local, entry)
                if fd is not None:
                    actual = _copy_hashing(fd, target, meter)
                elif files_url:
                    actual = self._download(files_url, entry, target, headers or {}, meter)
                elif source_dir is not None and local is None:
                    raise SnapshotError(
                        f"snapshot {digest[:12]}: its source {source_uri} is not below this "
                        "host's model roots and the control plane offers no file URL: add its "
                        "directory to [agent] model_roots (env DCTL_AGENT_MODEL_ROOTS) on the "
                        "host, or register the version from a directory the control plane serves"
                    )
                else:
                    raise SnapshotError(
                        f"snapshot {digest[:12]}: file {entry.path} is not under {source_uri} "
                        "and the control plane offers no file URL: make the source reachable "
                        "from this host"
                    )
                expected = f"{entry.size} bytes sha256 {entry.sha256[:12]}"
                if actual != (entry.size, entry.sha256):
                    got = f"{actual[0]} bytes sha256 {actual[1][:12]}"
                    raise SnapshotMismatch(digest, entry.path, expected, got)
        except FetchCancelled:
            meter.finish("failed", "cancelled: the agent is stopping")
            raise
        except TransferRefused as exc:
            meter.finish("failed", str(exc))
            raise
        except SnapshotError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            meter.finish("failed", str(exc))
            raise
        except (OSError, httpx.HTTPError) as exc:
            # Transfer problems keep the partial data: the next attempt resumes over HTTP.
            meter.finish("failed", f"{exc}")
            raise SnapshotError(f"snapshot {digest[:12]}: fetch interrupted: {exc}") from exc
        self._commit(digest, manifest, partial)
        meter.finish("ready")
        return self.path_for(digest)

    def _local_source(self, source_dir: PurePosixPath | None, uri: str) -> PurePosixPath | None:
        """SOURCE_DIR when it lies below a model root (its files may be copied), else None."""
        if source_dir is None:
            return None
        if locate_in_roots(source_dir, self.model_roots) is None:
            log.info(
                "source %s is not below [agent] model_roots: fetching its files over HTTP", uri
            )
            return None
        return source_dir

    def _open_local(self, source_dir: PurePosixPath, entry: ManifestEntry) -> int | None:
        """ENTRY's file opened below SOURCE_DIR, or None (missing, or it leads out: the reason,
        with local paths, goes to this host's log only)."""
        try:
            fd, _ = open_source_file(source_dir, entry.path, self.model_roots)
        except SourceFileError as exc:
            log.info("not copying %s from its local source: %s", entry.path, exc)
            return None
        return fd

    def _commit(self, digest: str, manifest: Manifest, partial: Path) -> None:
        for path in partial.rglob("*"):
            if path.is_file():
                path.chmod(0o444)  # a snapshot is immutable; make accidental writes fail
        tmp = self._manifest_file(digest).with_suffix(".json.tmp")
        tmp.write_text(manifest.model_dump_json())
        os.replace(partial, self.path_for(digest))
        os.replace(tmp, self._manifest_file(digest))

    def _download(
        self,
        files_url: str,
        entry: ManifestEntry,
        target: Path,
        headers: dict[str, str],
        meter: _Meter,
    ) -> tuple[int, str]:
        """Fetch one file over HTTP into TARGET, resuming what is there; returns (size, sha256).

        The server is not trusted with sizes: more bytes than the manifest says stop the
        transfer at once (a file never grows past its size on disk), a resumed transfer is
        appended only when `Content-Range` says it starts where the partial file ends, and an
        error body is read up to 4 KiB.
        """
        digest = hashlib.sha256()
        have = target.stat().st_size if target.exists() else 0
        if have > entry.size:
            target.unlink()
            have = 0
        if have:
            # Resume: hash what is already there, then ask only for the rest.
            with target.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
            meter.add(have)
        if have == entry.size:
            return have, digest.hexdigest()
        url = f"{files_url.rstrip('/')}/{quote(entry.path)}"
        request_headers = dict(headers)
        if have:
            request_headers["Range"] = f"bytes={have}-"
        if self._http is None:
            # One client for the store's lifetime: building one costs more than a small file.
            self._http = httpx.Client(
                timeout=httpx.Timeout(30.0, read=300.0), verify=self._tls or client_context()
            )
        with self._http.stream("GET", url, headers=request_headers) as response:
            if response.status_code == 200 and have:
                # The server ignored the Range: start this file over.
                digest, have = hashlib.sha256(), 0
                meter.done -= target.stat().st_size
            elif response.status_code == 206:
                _check_content_range(meter.digest, entry, target, have, response)
            elif response.status_code != 200:
                raise TransferRefused(
                    f"GET {url}: HTTP {response.status_code}: {error_text(response)[:200]}"
                )
            _check_content_length(meter.digest, entry, have, response)
            size = have
            with target.open("ab" if have else "wb") as out:
                for chunk in response.iter_bytes():
                    if size + len(chunk) > entry.size:  # a mismatch drops the partial data
                        raise SnapshotMismatch(
                            meter.digest, entry.path, f"{entry.size} bytes",
                            f"more than {entry.size} bytes (transfer stopped)",
                        )  # fmt: skip
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    meter.add(len(chunk))
        return size, digest.hexdigest()

    def verify(self, digest: str) -> VerifyResult:
        """Re-hash every file of a stored snapshot against its manifest."""
        if not self.has(digest):
            raise SnapshotError(f"snapshot {digest[:12]} is not in the store {self.root}")
        manifest = Manifest.model_validate_json(self._manifest_file(digest).read_text())
        bad = []
        for entry in manifest.files:
            path = self.path_for(digest) / entry.path
            if not path.is_file() or hash_file(path) != (entry.size, entry.sha256):
                bad.append(entry.path)
        return VerifyResult(digest=digest, ok=not bad, bad_files=bad)

    def remove(self, digest: str) -> None:
        """Delete one snapshot (e.g. after it failed verification)."""
        self._manifest_file(digest).unlink(missing_ok=True)
        shutil.rmtree(self.path_for(digest), ignore_errors=True)

    def prune(self, in_use: set[str]) -> list[str]:
        """Keep the `keep` most recently used snapshots plus any in use; return those removed."""
        removed = []
        for digest in self.digests()[self.keep :]:
            if digest not in in_use:
                self.remove(digest)
                removed.append(digest)
        return removed


def _copy_hashing(source_fd: int, target: Path, meter: _Meter) -> tuple[int, str]:
    """Copy the file open at SOURCE_FD (closed after) into TARGET; returns (size, sha256)."""
    digest = hashlib.sha256()
    size = 0
    with open(source_fd, "rb") as src, target.open("wb") as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
            digest.update(chunk)
            size += len(chunk)
            meter.add(len(chunk))
    return size, digest.hexdigest()


def _check_content_range(
    digest: str, entry: ManifestEntry, target: Path, have: int, response: httpx.Response
) -> None:
    """Accept a 206 only for exactly the bytes asked for: from HAVE to the end of the file.

    Anything else would be appended at the wrong offset; the partial file is dropped (the next
    attempt fetches the file from its start) and the fetch fails as a transfer error.
    """
    expected = f"bytes {have}-{entry.size - 1}/{entry.size}"
    actual = response.headers.get("Content-Range", "")
    if actual.strip() in (expected, f"bytes {have}-{entry.size - 1}/*"):
        return
    target.unlink(missing_ok=True)
    raise TransferRefused(
        f"snapshot {digest[:12]}: file {entry.path}: asked for bytes {have}- and got HTTP 206 "
        f"with Content-Range {actual or '(none)'!r}, not {expected!r}: its partial data was "
        "dropped and the next attempt fetches it from the start"
    )


def _check_content_length(
    digest: str, entry: ManifestEntry, have: int, response: httpx.Response
) -> None:
    """Refuse before reading a body announced longer than what is missing of the file."""
    length = response.headers.get("Content-Length", "")
    # With a Content-Encoding the length is of the encoded bytes; the stream cap still holds.
    encoded = "Content-Encoding" in response.headers
    if length.isdigit() and not encoded and have + int(length) > entry.size:
        raise SnapshotMismatch(
            digest, entry.path, f"{entry.size} bytes",
            f"{have + int(length)} bytes announced (not fetched)",
        )  # fmt: skip
