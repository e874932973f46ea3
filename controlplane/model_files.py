"""The files of model versions whose sources are on the control plane's disk, served safely.

A manifest is written by whoever registers the version, so the control plane trusts none of it:
it serves a file only after hashing that very file and finding the size and sha256 the manifest
names. A manifest that names a file whose content its author does not already know (the
credentials file, a private key) therefore serves nothing.

Each file is opened once per request without leaving its source directory (nor, with
`[controlplane] model_roots` set, the root that directory lies in: `runtime/model_roots.py`),
and is verified and served through that descriptor, so a symlink or file swapped in afterwards
changes nothing.

Hashing a multi-GB file takes seconds, so it runs in a thread, at most once per file identity
(device, inode, size, mtime, ctime) per process: requests for a file being hashed wait for that
one hash, read from a duplicate of the first request's descriptor (the same inode as theirs, by
the identity). A result whose file changed while it was read is thrown away, and a response stops
if its file changes while it is sent. The memory of verified files is a cache of facts about the
local disk, never a decision about stored state, so replicas can each keep their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from anyio import to_thread

from controlplane.services.errors import FileUnavailable
from protocol.manifest import hash_stream
from protocol.wire import ManifestEntry
from runtime.model_roots import SourceFileError, open_source_file

log = logging.getLogger("controlplane.model_files")

Hasher = Callable[[BinaryIO], tuple[int, str]]

KNOWN_FILES_MAX = 16384
HASH_THREADS = 4


@dataclass(frozen=True)
class FileIdentity:
    """What changes whenever a file's content may have: a verification holds while it does not."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    # Unlike mtime, ctime cannot be set back by the file's owner (`touch -d`).
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity of the file `st` describes."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class OpenedFile:
    """A regular file opened for serving: its descriptor and its identity when it was opened."""

    def __init__(self, fd: int, identity: FileIdentity) -> None:
        self.fd = fd
        self.identity = identity
        self._closed = False

    def unchanged(self) -> bool:
        """True while the file still has the identity it had when opened (and verified)."""
        return FileIdentity.of(os.fstat(self.fd)) == self.identity

    def close(self) -> None:
        """Close the descriptor (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            os.close(self.fd)


class ModelFiles:
    """Opens and verifies the files of versions whose sources live on this machine."""

    def __init__(
        self,
        model_roots: Sequence[Path] = (),
        hasher: Hasher = hash_stream,
        hash_threads: int = HASH_THREADS,
    ) -> None:
        self.model_roots = tuple(model_roots)
        self._hasher = hasher
        self._slots = threading.BoundedSemaphore(hash_threads)
        self._lock = threading.Lock()
        self._known: OrderedDict[FileIdentity, str] = OrderedDict()
        self._pending: dict[FileIdentity, concurrent.futures.Future[str | None]] = {}

    def open(self, source_dir: PurePosixPath, path: str) -> OpenedFile:
        """Open the regular file PATH below SOURCE_DIR (itself below a model root, if any)."""
        fd, st = open_source_file(source_dir, path, self.model_roots or None)
        return OpenedFile(fd, FileIdentity.of(st))

    async def open_verified(
        self, source_dir: PurePosixPath, entry: ManifestEntry, label: str
    ) -> OpenedFile:
        """ENTRY's file, opened and found to have the manifest's size and sha256.

        Raises `FileUnavailable` (no server paths in it; the log has them) when the file is
        missing, leaves its source, or differs from the manifest. LABEL names the version.
        """
        try:
            opened = await to_thread.run_sync(self.open, source_dir, entry.path)
        except SourceFileError as exc:
            raise self._unavailable(entry, label, str(exc)) from None
        try:
            if opened.identity.size != entry.size:
                raise SourceFileError(f"{source_dir}/{entry.path}: size differs from the manifest")
            try:
                digest = await self.sha256(opened)
            except OSError as exc:  # a disk error while hashing: this file cannot be vouched for
                raise SourceFileError(f"{source_dir}/{entry.path}: {exc.strerror or exc}") from None
            if digest is None:
                raise SourceFileError(f"{source_dir}/{entry.path}: changed while it was verified")
            if digest != entry.sha256:
                raise SourceFileError(
                    f"{source_dir}/{entry.path}: sha256 differs from the manifest"
                )
        except SourceFileError as exc:
            opened.close()
            raise self._unavailable(entry, label, str(exc)) from None
        except BaseException:
            opened.close()
            raise
        return opened

    @staticmethod
    def _unavailable(entry: ManifestEntry, label: str, reason: str) -> FileUnavailable:
        log.warning("not serving %s of %s: %s", entry.path, label, reason)
        return FileUnavailable(
            f"file {entry.path!r} of {label} is not available from the control plane: it is "
            "missing from the version's source or does not match the manifest (the control "
            "plane's log says which): restore the source or register a new version"
        )

    async def sha256(self, opened: OpenedFile) -> str | None:
        """The sha256 of OPENED's content; None if the file changed while it was read.

        Known identities answer at once; otherwise one thread hashes the file while every
        other request for the same identity awaits that result.
        """
        key = opened.identity
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                return known
            job = self._pending.get(key)
            if job is None:
                job = concurrent.futures.Future()
                self._pending[key] = job
                # Its own descriptor: the request that started the hash may end before it does.
                fd = os.dup(opened.fd)
                threading.Thread(
                    target=self._hash, args=(key, fd, job), name="dctl-verify", daemon=True
                ).start()
        # Shielded: one waiter giving up (a client gone) must not cancel the others' result.
        return await asyncio.shield(asyncio.wrap_future(job))

    def _hash(self, key: FileIdentity, fd: int, job: concurrent.futures.Future[str | None]) -> None:
        """Hash the file open at FD (which it closes) and hand the result to every waiter."""
        try:
            with self._slots:
                os.lseek(fd, 0, os.SEEK_SET)
                with open(fd, "rb", closefd=False) as handle:
                    size, digest = self._hasher(handle)
                # A file written while it was read is not the file the identity names.
                changed = size != key.size or FileIdentity.of(os.fstat(fd)) != key
            result = None if changed else digest
        except BaseException as exc:  # every waiter raises it (and the request logs it)
            with self._lock:
                del self._pending[key]
            job.set_exception(exc)
            return
        finally:
            os.close(fd)
        with self._lock:
            del self._pending[key]
            if result is not None:
                self._known[key] = result
                while len(self._known) > KNOWN_FILES_MAX:
                    self._known.popitem(last=False)
        job.set_result(result)
