"""Database engines: SQLite (WAL, foreign keys, busy timeout) or PostgreSQL, same code.

A SQLite store holds every instance's API key in clear, so its file is created 0600 before
SQLite opens it: SQLite gives the `-wal`, `-shm` and `-journal` files it makes next to it the
database file's own mode. An existing store that other users may read is named in a warning.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlmodel import Session

SQLITE_BUSY_TIMEOUT_MS = 5000
# Files SQLite keeps next to the database; each holds recent writes, keys included.
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")

log = logging.getLogger("controlplane.db")


class DatabaseUrlError(ValueError):
    """The database URL names a database dctl does not support."""


def normalise_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` as the psycopg 3 driver dctl ships with."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    if not (url.startswith("sqlite") or url.startswith("postgresql+psycopg://")):
        raise DatabaseUrlError(
            f"unsupported database URL {url.split('://')[0]}://...: "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
    return url


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # WAL lets readers run while the heartbeat path writes; NORMAL sync is safe under WAL.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names; None for an in-memory database or a `file:` URI."""
    database = sa.engine.make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _private_store(path: Path) -> None:
    """Create the store at PATH 0600 if it is new; warn when an existing one is readable by
    others. Not the process umask: it is shared by every thread, and SQLite follows the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError:
        return  # no folder, read-only disk: SQLite's own error says so when it opens the file
    else:
        os.close(fd)  # an empty file is a new database to SQLite
        return
    for name in (path, *(path.with_name(path.name + side) for side in SQLITE_SIDE_FILES)):
        try:
            mode = stat.S_IMODE(name.stat().st_mode)
        except OSError:
            continue
        if mode & 0o077:
            log.warning(
                "%s is readable by other users (mode %o) and holds every instance API key: "
                "run `chmod 600 %s`", name, mode, shlex.quote(str(name)),
            )  # fmt: skip


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`; SQLite connections get WAL, foreign keys and a busy timeout, and a
    new SQLite file is created private to its owner."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        path = sqlite_file(url)
        if path is not None:
            _private_store(path)
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 5})
        engine = sa.create_engine(url, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    # No pre-ping: it costs a round trip per checkout on the heartbeat path. A connection the
    # server dropped fails one request (503, retried by agents) and the pool is invalidated.
    kwargs.setdefault("pool_pre_ping", False)
    return sa.create_engine(url, **kwargs)


def is_sqlite(engine: Engine) -> bool:
    """True for a SQLite engine."""
    return engine.dialect.name == "sqlite"


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session committed on success and rolled back on any error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def ping(engine: Engine) -> bool:
    """True when the database answers a trivial query."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return True
    except sa.exc.SQLAlchemyError:
        return False
