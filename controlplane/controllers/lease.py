"""A lease in the database: one row per name, held by one replica until it expires.

Control-plane replicas share a database and nothing else, so the database decides who leads:
the `lease` row names its holder and when its hold ends. Taking it is one conditional UPDATE
(the row is ours, or its hold ended) and, when there is no row yet, one INSERT that does nothing
on conflict; either statement changes a row or not, atomically, on SQLite and PostgreSQL alike.
The holder renews it before it runs out; a holder that dies (kill -9, lost network) stops
renewing, and whoever asks after `expires_at` takes over.

Times come from the replica's injected clock, so replicas' clocks must agree to well within a
lease period (NTP does).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import col

from controlplane.models import Lease, UTCDateTime

log = logging.getLogger("controlplane.lease")

HOLDER_MAX = 128


def new_holder_id() -> str:
    """A holder id unique to this process: host, pid and a random part (pids get reused)."""
    return f"{socket.gethostname()[:80]}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease and until when, as the database says."""

    holder: str
    acquired_at: datetime
    expires_at: datetime


class DatabaseLease:
    """The lease `name`, taken and renewed for `period` at a time on behalf of `holder`.

    `hold(now)` is the one call a loop makes each round: it renews once half the period has
    passed (not on every round, to keep writes rare) and tells whether this replica may act.
    """

    def __init__(self, engine: Engine, name: str, holder: str, period: timedelta) -> None:
        if period <= timedelta(0):
            raise ValueError("a lease period must be positive")
        self.name = name
        self.holder = holder[:HOLDER_MAX]
        self.period = period
        self._engine = engine
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        # Until when this replica holds the lease, as of its last successful write; None: not.
        self._until: datetime | None = None

    def held(self, now: datetime) -> bool:
        """True while this replica's last take or renewal has not run out."""
        return self._until is not None and now < self._until

    def hold(self, now: datetime) -> bool:
        """Take or renew the lease when due; True when this replica holds it now.

        A database error counts as not holding it: a replica that cannot reach the database
        cannot run controllers against it either, and its hold runs out on its own.
        """
        if self._until is not None and self._until - now > self.period / 2:
            return True
        try:
            taken = self._take(now)
        except sa.exc.SQLAlchemyError:
            log.warning("lease %s: the database refused the renewal", self.name, exc_info=True)
            taken = False
        was_held = self._until is not None
        self._until = now + self.period if taken else None
        if taken and not was_held:
            log.info("lease %s taken by %s", self.name, self.holder)
        elif was_held and not taken:
            log.warning("lease %s lost by %s", self.name, self.holder)
        return taken

    def release(self, now: datetime) -> None:
        """Give the lease up (on shutdown), so another replica takes it without waiting."""
        if self._until is None:
            return
        self._until = None
        try:
            with self._engine.begin() as conn:
                conn.execute(
                    sa.update(Lease)
                    .where(col(Lease.name) == self.name, col(Lease.holder) == self.holder)
                    .values(expires_at=now)
                )
        except sa.exc.SQLAlchemyError:
            log.warning("lease %s: could not release it; it runs out by itself", self.name)

    def current(self) -> LeaseHolder | None:
        """The lease's holder as stored (expired or not), or None when nobody ever took it."""
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(col(Lease.holder), col(Lease.acquired_at), col(Lease.expires_at)).where(
                    col(Lease.name) == self.name
                )
            ).first()
        return None if row is None else LeaseHolder(row.holder, row.acquired_at, row.expires_at)

    def _take(self, now: datetime) -> bool:
        """One transaction: renew ours or take an expired one; else create it if absent."""
        until = now + self.period
        with self._engine.begin() as conn:
            renewed = conn.execute(
                sa.update(Lease)
                .where(
                    col(Lease.name) == self.name,
                    (col(Lease.holder) == self.holder) | (col(Lease.expires_at) <= now),
                )
                .values(
                    holder=self.holder,
                    expires_at=until,
                    # A renewal keeps the start of this replica's term; a takeover starts one.
                    acquired_at=sa.case(
                        (
                            (col(Lease.holder) == self.holder) & (col(Lease.expires_at) > now),
                            col(Lease.acquired_at),
                        ),
                        else_=sa.literal(now, UTCDateTime()),
                    ),
                )
            )
            if renewed.rowcount:
                return True
            # RETURNING, not rowcount: drivers disagree on the rowcount of a skipped insert.
            created = conn.execute(
                self._insert(Lease)
                .values(name=self.name, holder=self.holder, acquired_at=now, expires_at=until)
                .on_conflict_do_nothing(index_elements=["name"])
                .returning(col(Lease.name))
            )
            return created.first() is not None
