"""Files of a local weight source, opened without leaving it or the model roots it lies in.

The control plane serves such files to agents (`controlplane/model_files.py`) and an agent copies
them into its snapshot store (`agent/snapshots.py`); both take the source directory from a
manifest's author, so neither may be led to another file by name, `..` or symlink. A source
directory is reached from the model root it lies in, and each file from its source directory,
one path component at a time (`openat` with `O_NOFOLLOW`, following a symlink only while it
stays below that directory, like Linux's `RESOLVE_BENEATH`), so a symlink or file swapped in
afterwards changes nothing: the caller reads the descriptor it got.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath


class SourceFileError(Exception):
    """Why a file of a source cannot be opened, with local paths: for the local log only."""


# O_PATH lets a directory be walked through with search permission alone (Linux).
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in a source directory must not hang a thread.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What open(2) answers for a final component that is a symlink under O_NOFOLLOW (ENOTDIR with
# O_DIRECTORY on Linux, EMLINK on the BSDs).
_SYMLINK_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.EMLINK}
MAX_SYMLINKS = 40


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
    is opened for reading (a directory, with DIRECTORY, for walking on); raises `SourceFileError`.
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
                    raise SourceFileError(f"{path}: leads above its root")
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
                    raise SourceFileError(f"{path}: more than {MAX_SYMLINKS} symlinks")
                if target.startswith("/"):
                    below = _below(target, root_names)
                    if below is None:
                        raise SourceFileError(f"{path}: {name} is a symlink to {target}, outside")
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
        raise SourceFileError(f"{path}: is a directory")
    finally:
        for fd in dirs:
            os.close(fd)


def _symlink_target(name: str, dir_fd: int, error: OSError | ValueError) -> str:
    """The target of the symlink NAME whose open failed with ERROR; `SourceFileError` if not one."""
    if isinstance(error, OSError) and error.errno in _SYMLINK_ERRNOS:
        try:
            return os.readlink(name, dir_fd=dir_fd)
        except OSError:
            pass  # not a symlink after all: a file where a directory was needed
    reason = error.strerror if isinstance(error, OSError) else str(error)
    raise SourceFileError(f"{name}: {reason}")


def _open_dir(path: str) -> int:
    """Open a directory the admin or the operator named, following its symlinks."""
    try:
        return os.open(path, _DIR_FLAGS)
    except (OSError, ValueError) as exc:
        raise SourceFileError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None


def _names_of(path: str) -> tuple[str, ...]:
    """The absolute names an absolute symlink may use for the directory PATH."""
    return tuple(dict.fromkeys((posixpath.normpath(path), os.path.realpath(path))))


def open_source_file(
    source_dir: PurePosixPath, path: str, roots: Sequence[Path] | None
) -> tuple[int, os.stat_result]:
    """Open the regular file PATH below SOURCE_DIR, itself below one of ROOTS (None: the source
    may be anywhere; empty: nowhere); its descriptor and stat. Raises `SourceFileError`."""
    if roots is None:
        # No roots: whoever names the source could have named the symlink's target directly.
        source_fd = _open_dir(str(source_dir))
    else:
        found = locate_in_roots(source_dir, roots)
        if found is None:
            raise SourceFileError(f"{source_dir}: outside the model roots")
        root, below = found
        root_fd = _open_dir(str(root))
        try:
            source_fd = open_beneath(root_fd, str(below), _names_of(str(root)), directory=True)
        finally:
            os.close(root_fd)
    try:
        fd = open_beneath(source_fd, path, _names_of(str(source_dir)))
    finally:
        os.close(source_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SourceFileError(f"{source_dir}/{path}: is not a regular file")
    return fd, st
