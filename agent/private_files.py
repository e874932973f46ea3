"""Files and directories only this user may read (tokens, identity, engine configs, pid records).

Three rules, because the agent's data dir is where a local attacker would plant things:
- a private file is written 0600 from its first byte, through a fresh temporary file opened
  `O_CREAT | O_EXCL | O_NOFOLLOW`, then renamed over the target (a rename replaces a symlink
  planted at the target instead of writing through it);
- a private file is read `O_NOFOLLOW`, so a symlink planted in its place is refused rather than
  read (the agent would otherwise send whatever it points at as its token);
- a private directory is 0700: created so, tightened (with a warning) when found looser.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from agent.errors import PrivateFileError

log = logging.getLogger("dctl.agent")
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def write_private(path: Path, text: str) -> None:
    """Replace PATH with TEXT atomically, mode 0600 from the first byte, following no symlink.

    The bytes go to a fresh temporary file created 0600 (never chmod-ed afterwards, so the
    secret is not world-readable even briefly) which then replaces PATH: a reader sees the old
    file or the new one, never a torn one, a PATH that once had looser permissions does not keep
    them, and a symlink at PATH is replaced, not followed.
    """
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a crash; O_EXCL below must create it anew
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_private(path: Path) -> str:
    """The text of a private file; a symlink or anything but a regular file is refused.

    Raises `FileNotFoundError` when PATH does not exist and `PrivateFileError` when it is not a
    plain file of its own (then the message says to remove it).
    """
    try:
        # O_NONBLOCK: a FIFO planted in its place must not hang the agent on open().
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            raise PrivateFileError(
                f"{path} is a symlink (to {os.readlink(path)}); the agent does not follow "
                "symlinks for its secrets: remove it and register again"
            ) from None
        raise PrivateFileError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "r") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise PrivateFileError(f"{path} is not a regular file: remove it and register again")
        return handle.read()


def private_dir(path: Path) -> Path:
    """Make PATH (and missing parents) a directory only this user can enter: 0700.

    A directory that already exists with group or other bits is tightened, with a warning (what
    lies under it may have been readable until now). One that is a symlink or belongs to another
    user is refused: the agent would be keeping its secrets somewhere someone else controls.
    """
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PrivateFileError(
            f"{path} is not a directory of its own (a symlink?): the agent keeps secrets there; "
            "point --data-dir at a real directory"
        )
    if info.st_uid != os.geteuid():
        raise PrivateFileError(
            f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}): the agent "
            "keeps secrets there; use a directory of your own (--data-dir)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != PRIVATE_DIR_MODE:
        if mode & 0o077:
            log.warning(
                "%s was mode %o (others could read the agent's secrets): set to 700", path, mode
            )
        path.chmod(PRIVATE_DIR_MODE)
    return path
