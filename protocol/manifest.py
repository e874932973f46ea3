"""Compute the manifest of a checkpoint directory: every file's relative path, size and sha256.

Files are hashed as streams (never read whole into memory), so a 100 GB checkpoint costs only
time. A symlink to a file inside the directory is hashed under its own path (the agent will
materialise it as a regular file); a symlink that leads outside the directory, a directory
symlink and anything that is not a regular file are refused, because the snapshot would not
be self-contained or its content would be ambiguous.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from protocol.wire import Manifest, ManifestEntry

_CHUNK = 1 << 20

ProgressCallback = Callable[[str, int], None]


class ManifestError(Exception):
    """The directory cannot become a weight snapshot; the message names the file and the fix."""


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of the file at PATH, read as a stream: the one file hash of dctl."""
    with path.open("rb") as handle:
        return hash_stream(handle)


def hash_stream(handle: BinaryIO) -> tuple[int, str]:
    """(size, sha256 hex) of what HANDLE reads from where it stands to its end, in chunks."""
    digest = hashlib.sha256()
    size = 0
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _files(root: Path) -> list[tuple[str, Path]]:
    """(manifest path, real path) of every file under ROOT, sorted; raises on what is refused."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_walk_error):
        here = Path(dirpath)
        for name in dirnames:
            if (here / name).is_symlink():
                rel = (here / name).relative_to(root).as_posix()
                raise ManifestError(
                    f"{rel}: is a symlink to a directory; replace it with the files themselves"
                )
        for name in filenames:
            path = here / name
            rel = path.relative_to(root).as_posix()
            target = path
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root):
                    raise ManifestError(
                        f"{rel}: is a symlink to {target}, outside {root}; copy the file into "
                        "the directory instead"
                    )
            try:
                mode = target.stat().st_mode
            except OSError as exc:
                raise ManifestError(f"{rel}: cannot be read: {exc.strerror or exc}") from exc
            if not stat.S_ISREG(mode):
                raise ManifestError(f"{rel}: is not a regular file; remove it from the directory")
            found.append((rel, target))
    found.sort()
    return found


def _walk_error(exc: OSError) -> None:
    raise ManifestError(f"{exc.filename}: cannot be listed: {exc.strerror or exc}") from exc


def compute_manifest(directory: str | Path, progress: ProgressCallback | None = None) -> Manifest:
    """Walk DIRECTORY and return its manifest; PROGRESS(path, size) is called after each file."""
    given = Path(directory)
    if not given.exists():
        raise ManifestError(f"{given}: no such directory")
    if not given.is_dir():
        raise ManifestError(f"{given}: is not a directory; give the checkpoint directory")
    root = given.resolve()
    entries: list[ManifestEntry] = []
    for rel, real in _files(root):
        try:
            size, sha256 = hash_file(real)
        except OSError as exc:
            raise ManifestError(f"{rel}: cannot be read: {exc.strerror or exc}") from exc
        try:
            entries.append(ManifestEntry(path=rel, size=size, sha256=sha256))
        except ValidationError as exc:
            raise ManifestError(f"{rel}: {exc.errors()[0]['msg']}; rename the file") from exc
        if progress is not None:
            progress(rel, size)
    if not entries:
        raise ManifestError(f"{given}: contains no files; give a checkpoint directory")
    try:
        return Manifest(files=entries)
    except ValidationError as exc:
        raise ManifestError(f"{given}: {exc.errors()[0]['msg']}") from exc
