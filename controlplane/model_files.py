"""The files of model versions whose sources are on the control plane's disk, served safely.

A manifest is written by whoever registers the version, so the control plane trusts none of it:
it serves a file only after hashing that very file and finding the size and sha256 the manifest
names. A manifest that names a file whose content its author does not already know (the
credentials file, a private key) therefore serves nothing.

Each file is opened once per request, one path component at a time below its source directory
(`openat` with `O_NOFOLLOW`, following a symlink only while it stays below that directory, like
Linux's `RESOLVE_BENEATH`), and is verified and served through that descriptor, so a symlink or
file swapped in afterwards changes nothing. With `[controlplane] model_roots` set, the source
directory itself is reached the same way from one of those roots.

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
import errno
import logging
import os
import posixpath
import stat
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

log = logging.getLogger("controlplane.model_files")

Hasher = Callable[[BinaryIO], tuple[int, str]]

# O_PATH lets a directory be walked through with search permission alone (Linux).
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in a source directory must not hang a thread.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What open(2) answers for a final component that is a symlink under O_NOFOLLOW (ENOTDIR with
# O_DIRECTORY on Linux, EMLINK on the BSDs).
_SYMLINK_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.EMLINK}
MAX_SYMLINKS = 40
KNOWN_FILES_MAX = 16384
HASH_THREADS = 4


class Unservable(Exception):
    """Why a file cannot be served, with server paths: for the server's log, not the caller."""


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


def locate_in_roots(
    source_dir: PurePosixPath, roots: Sequence[Path]
) -> tuple[Path, PurePosixPath] | None:
    """The model root SOURCE_DIR lies in and the path below it, by name alone; None if none.

    `..` is collapsed first, so `/models/../etc` is not under `/models`. Symlinks below the
    root are dealt with when a file is opened.
    """
    normal = PurePosixPath(posixpath.normpath(str(source_dir)))
    for root in roots:
        if normal.is_relative_to(root):
            return root, normal.relative_to(root)
    return None


def _below(target: str, names: Sequence[str]) -> str | None:
    """An absolute symlink target as a path relative to the root called one of NAMES, or None."""
    normal = posixpath.normpath(target)
    for name in names:
        if normal == name:
            return "."
        if normal.startswith(name.rstrip("/") + "/"):
            return normal[len(name.rstrip("/")) + 1 :]
    return None


def open_beneath(
    root_fd: int, path: str, root_names: Sequence[str] = (), *, directory: bool = False
) -> int:
    """Open PATH below the directory ROOT_FD without ever leaving it; returns a new descriptor.

    Every component is opened with `O_NOFOLLOW` relative to the one before. A symlink is
    followed by hand, and only while it stays below the root: `..` above it, or an absolute
    target not under one of ROOT_NAMES (the root's own absolute names), is refused. The file
    is opened for reading (a directory, with DIRECTORY, for walking on); raises `Unservable`.
    """
    todo = list(reversed(path.split("/")))
    dirs = [os.dup(root_fd)]
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(dirs) == 1:
                    raise Unservable(f"{path}: leads above its root")
                os.close(dirs.pop())
                continue
            final = all(rest in ("", ".") for rest in todo)
            flags = _FILE_FLAGS if final and not directory else _DIR_FLAGS | os.O_NOFOLLOW
            try:
                fd = os.open(name, flags, dir_fd=dirs[-1])
            except (OSError, ValueError) as exc:
                target: str | None = _symlink_target(name, dirs[-1], exc)
            else:
                target = None
            if target is not None:
                links += 1
                if links > MAX_SYMLINKS:
                    raise Unservable(f"{path}: more than {MAX_SYMLINKS} symlinks")
                if target.startswith("/"):
                    below = _below(target, root_names)
                    if below is None:
                        raise Unservable(f"{path}: {name} is a symlink to {target}, outside")
                    while len(dirs) > 1:  # an absolute target starts again from the root
                        os.close(dirs.pop())
                    target = below
                todo.extend(reversed(target.split("/")))
                continue
            if final and not directory:
                return fd
            dirs.append(fd)
        if directory:
            return dirs.pop()
        raise Unservable(f"{path}: is a directory")
    finally:
        for fd in dirs:
            os.close(fd)


def _symlink_target(name: str, dir_fd: int, error: OSError | ValueError) -> str:
    """The target of the symlink NAME whose open failed with ERROR; `Unservable` if not one."""
    if isinstance(error, OSError) and error.errno in _SYMLINK_ERRNOS:
        try:
            return os.readlink(name, dir_fd=dir_fd)
        except OSError:
            pass  # not a symlink after all: a file where a directory was needed
    reason = error.strerror if isinstance(error, OSError) else str(error)
    raise Unservable(f"{name}: {reason}")


def _open_dir(path: str) -> int:
    """Open a directory the admin or the operator named, following its symlinks."""
    try:
        return os.open(path, _DIR_FLAGS)
    except (OSError, ValueError) as exc:
        raise Unservable(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None


def _names_of(path: str) -> tuple[str, ...]:
    """The absolute names an absolute symlink may use for the directory PATH."""
    return tuple(dict.fromkeys((posixpath.normpath(path), os.path.realpath(path))))


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
        if self.model_roots:
            found = locate_in_roots(source_dir, self.model_roots)
            if found is None:
                raise Unservable(f"{source_dir}: outside model_roots")
            root, below = found
            root_fd = _open_dir(str(root))
            try:
                source_fd = open_beneath(root_fd, str(below), _names_of(str(root)), directory=True)
            finally:
                os.close(root_fd)
        else:
            # No roots: the operator could have named the symlink's target directly.
            source_fd = _open_dir(str(source_dir))
        try:
            fd = open_beneath(source_fd, path, _names_of(str(source_dir)))
        finally:
            os.close(source_fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Unservable(f"{source_dir}/{path}: is not a regular file")
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
        except Unservable as exc:
            raise self._unavailable(entry, label, str(exc)) from None
        try:
            if opened.identity.size != entry.size:
                raise Unservable(f"{source_dir}/{entry.path}: size differs from the manifest")
            try:
                digest = await self.sha256(opened)
            except OSError as exc:  # a disk error while hashing: this file cannot be vouched for
                raise Unservable(f"{source_dir}/{entry.path}: {exc.strerror or exc}") from None
            if digest is None:
                raise Unservable(f"{source_dir}/{entry.path}: changed while it was verified")
            if digest != entry.sha256:
                raise Unservable(f"{source_dir}/{entry.path}: sha256 differs from the manifest")
        except Unservable as exc:
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
