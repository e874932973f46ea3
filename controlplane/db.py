"""Database engines: SQLite (WAL, foreign keys, busy timeout) or PostgreSQL, same code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlmodel import Session

SQLITE_BUSY_TIMEOUT_MS = 5000


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


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`; SQLite connections get WAL, foreign keys and a busy timeout."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
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
