"""Observed state: what an agent's heartbeat reports, written to the store in one transaction.

The host row is touched every time (last seen, applied generation, latest GPU samples, and
`heartbeat_seq` + 1), in an UPDATE whose WHERE clause also re-checks the agent's token row.
The rest is written only when it changed: facts, the GPU set, each instance's observed state,
the advertise address, metric samples once per 10 s bucket (`samples`).

"Changed" is judged against `HostMemory`, what this replica last wrote of the host. That memory
is trusted only while this replica is the host's only writer: `heartbeat_seq` grows with every
write of observed state (heartbeats on any replica, registration), so a replica whose UPDATE
returns anything but its own last value + 1 forgets what it remembers and writes everything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col

from controlplane.auth import Principal, TokenRefused
from controlplane.heartbeat.desired_state import DEFAULT_BIND_ADDRESS
from controlplane.heartbeat.samples import HostSampleBucket
from controlplane.logs.shipped import write_batch
from controlplane.models import Deployment, Event, Gpu, Instance, UTCDateTime
from protocol.wire import GpuStatus, Heartbeat, HostState, ModelVersionRef

_GPU_LIST = TypeAdapter(list[GpuStatus])
# The gauges the autoscaler reads (the agent maps other engines' names onto these).
RUNNING_GAUGE = "dllm_requests_running"
WAITING_GAUGE = "dllm_requests_waiting"
# How long an instance's last reported load stands in for a heartbeat that has none for it.
LOAD_HOLD = timedelta(seconds=15)
# Larger is no engine's real count; the column is a 32-bit integer.
MAX_REQUESTS = 2**31 - 1


def _count(value: float | None) -> int | None:
    """A reported gauge as a request count (None: not reported)."""
    if value is None:
        return None
    return min(max(round(value), 0), MAX_REQUESTS)


# Instances remembered per host: four heartbeats' worth at most (a host runs far fewer).
MAX_REMEMBERED_INSTANCES = 1024


class _Statements:
    """The hot path's SQL, built once: plain text with typed parameters, cheap to execute."""

    def __init__(self, dialect: str) -> None:
        # JSON documents arrive already serialised (by pydantic, in Rust); PostgreSQL needs
        # the text cast to json, SQLite stores the text as is.
        as_json = "CAST({} AS JSON)" if dialect == "postgresql" else "{}"
        # One statement records the heartbeat, re-checks the token and reads what the reply
        # needs. RETURNING gives the new heartbeat_seq and the rest as it was (unchanged here).
        self.touch_host = (
            sa.text(
                "UPDATE host SET last_seen_at = :now, applied_generation = :gen, "
                f"gpu_samples = {as_json.format(':gpus')}, heartbeat_seq = heartbeat_seq + 1 "
                "WHERE id = :hid AND EXISTS (SELECT 1 FROM apitoken t WHERE t.id = :tid "
                "AND t.host_id = :hid AND t.revoked_at IS NULL "
                "AND (t.expires_at IS NULL OR t.expires_at > :now) "
                "AND (t.uses_left IS NULL OR t.uses_left > 0)) "
                "RETURNING name, state, draining, desired_generation, heartbeat_interval_s, "
                "heartbeat_seq, advertise_address"
            )
            .bindparams(sa.bindparam("now", type_=UTCDateTime()))
            .columns(
                sa.column("name", sa.String),
                sa.column("state", sa.String),
                sa.column("draining", sa.Boolean),
                sa.column("desired_generation", sa.Integer),
                sa.column("heartbeat_interval_s", sa.Float),
                sa.column("heartbeat_seq", sa.Integer),
                sa.column("advertise_address", sa.String),
            )
        )
        self.spend_use = sa.text(
            "UPDATE apitoken SET uses_left = uses_left - 1 WHERE id = :tid AND uses_left > 0"
        )
        self.host_exists = sa.text("SELECT 1 FROM host WHERE id = :hid")
        self.set_facts = sa.text(
            f"UPDATE host SET facts = {as_json.format(':facts')} WHERE id = :hid"
        )
        # Engines bind to the advertise address, so a new one is a new desired state.
        self.set_address = sa.text(
            "UPDATE host SET advertise_address = :address, "
            "desired_generation = desired_generation + 1 WHERE id = :hid "
            "RETURNING desired_generation"
        )
        self.mark_ready = sa.text("UPDATE host SET state = 'ready' WHERE id = :hid")
        # The host_id condition is what keeps one agent from writing another host's instances.
        self.observe_instance = (
            update(Instance)
            .where(
                col(Instance.id) == bindparam("b_id"), col(Instance.host_id) == bindparam("b_host")
            )
            .values(
                observed_state=bindparam("b_state"),
                pid=bindparam("b_pid"),
                restart_count=bindparam("b_restarts"),
                last_exit=bindparam("b_exit"),
                observed_digest=bindparam("b_digest"),
                message=bindparam("b_message"),
                requests_running=bindparam("b_running"),
                requests_waiting=bindparam("b_waiting"),
                observed_at=bindparam("b_now"),
            )
        )


@dataclass
class HostMemory:
    """What this replica last wrote of a host, to skip writes that would change nothing."""

    samples: HostSampleBucket
    # The host's heartbeat_seq after this replica's last committed write; -1: none yet.
    seq: int = -1
    last_seen: datetime | None = None
    facts_json: str = ""
    gpu_fingerprint: int = 0
    observed: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    # The desired state last sent, serialised, and its generation (a database value, so this
    # part holds with any number of replicas).
    desired_generation: int = -1
    desired_json: bytes = b"[]"
    keep_digests: list[str] = field(default_factory=list)
    # Each instance's last reported load and when (`ObservedStateWriter._load`).
    load: dict[int, tuple[tuple[int | None, int | None], datetime]] = field(default_factory=dict)
    # The host's instances' deployments, for its shipped log lines (`controlplane.logs`).
    log_deployments: dict[int, int | None] = field(default_factory=dict)
    prefetch: list[ModelVersionRef] = field(default_factory=list)
    # Heartbeats of one host are handled one at a time here (the database would queue them on
    # the host row anyway); this keeps the fields above consistent with each other.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def distrust(self) -> None:
        """Someone else wrote the host's observed state: what is remembered may be stale."""
        self.facts_json = ""
        self.gpu_fingerprint = 0
        self.observed.clear()


@dataclass(frozen=True)
class Recorded:
    """What the heartbeat reply needs from a committed write."""

    draining: bool
    generation: int
    interval_s: float
    advertise_address: str | None
    # True when this replica wrote the host's previous observed state too.
    sole_writer: bool
    # The host's set of GPUs differs from the stored one (placement must be planned again).
    gpus_changed: bool = False


class ObservedStateWriter:
    """Writes heartbeats' observed state; one per app, called on the heartbeat writer threads."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sql = _Statements(engine.dialect.name)

    def host_exists(self, host_id: int) -> bool:
        """True while the host row exists."""
        with self._engine.connect() as conn:
            return conn.execute(self._sql.host_exists, {"hid": host_id}).first() is not None

    def record(
        self, principal: Principal, host_id: int, beat: Heartbeat, memory: HostMemory, now: datetime
    ) -> Recorded | None:
        """One transaction: host row, GPUs, observed instances, metric samples.

        None when the host row was not updated: the host is gone or the token no longer valid.
        """
        sql = self._sql
        with self._engine.begin() as conn:
            row = conn.execute(
                sql.touch_host,
                {
                    "hid": host_id,
                    "tid": principal.token_id,
                    "now": now,
                    "gen": beat.applied_generation,
                    "gpus": _GPU_LIST.dump_json(beat.gpus).decode(),
                },
            ).first()
            if row is None:
                return None
            if (
                principal.limited_uses
                and not conn.execute(sql.spend_use, {"tid": principal.token_id}).rowcount
            ):
                raise TokenRefused(f"token {principal.name!r} has no uses left")
            sole_writer = row.heartbeat_seq == memory.seq + 1
            if not sole_writer:
                memory.distrust()
            if row.desired_generation != memory.desired_generation:
                # The desired state moved (instances replaced or reset): write what the agent
                # reports of each instance once more rather than trust what was last written.
                memory.observed.clear()
            generation = row.desired_generation
            if beat.advertise_address != row.advertise_address:
                generation = self._address(conn, host_id, row, beat, now)
            facts = beat.facts.model_dump_json()
            if facts != memory.facts_json:
                conn.execute(sql.set_facts, {"hid": host_id, "facts": facts})
            if row.state != HostState.READY:
                conn.execute(sql.mark_ready, {"hid": host_id})
                conn.execute(
                    insert(Event).values(
                        time=now,
                        actor=f"host:{row.name}",
                        kind="host.ready",
                        subject=f"host/{row.name}",
                        message=f"host {row.name} is heartbeating again (was {row.state})",
                        data={"previous": row.state},
                    )
                )
            gpus_changed = self._gpus(conn, host_id, beat, memory)
            self._instances(conn, host_id, row.name, beat, memory, now)
            if beat.logs is not None:
                write_batch(conn, host_id, beat.logs, memory.log_deployments, now)
            memory.samples.add(conn, beat, now, shared=not sole_writer)
        memory.seq = row.heartbeat_seq
        memory.facts_json = facts
        return Recorded(
            draining=bool(row.draining),
            generation=generation,
            interval_s=row.heartbeat_interval_s,
            advertise_address=beat.advertise_address,
            sole_writer=sole_writer,
            gpus_changed=gpus_changed,
        )

    def _address(
        self, conn: Connection, host_id: int, row: Any, beat: Heartbeat, now: datetime
    ) -> int:
        """Store a new advertise address; returns the desired generation it bumped to."""
        address = beat.advertise_address
        generation = int(
            conn.execute(self._sql.set_address, {"hid": host_id, "address": address}).scalar_one()
        )
        conn.execute(
            insert(Event).values(
                time=now,
                actor=f"host:{row.name}",
                kind="host.address_changed",
                subject=f"host/{row.name}",
                message=f"host {row.name} advertises {address or 'no address'} "
                f"(was {row.advertise_address or 'none'}); its engines bind to "
                f"{address or DEFAULT_BIND_ADDRESS}",
                data={"previous": row.advertise_address, "current": address},
            )
        )
        return generation

    def _gpus(self, conn: Connection, host_id: int, beat: Heartbeat, memory: HostMemory) -> bool:
        """Store the host's GPU identities when they changed; True when they did."""
        identity = sorted(
            (g.index, g.uuid, g.name, g.memory_total_bytes, g.compute_capability) for g in beat.gpus
        )
        # Per-process cache, so Python's (per-process salted) hash is a fine fingerprint.
        fingerprint = hash(tuple(identity)) or 1
        if fingerprint == memory.gpu_fingerprint:
            return False
        # Memory missed (first heartbeat here, or another replica wrote): compare with the rows,
        # so only a real change rewrites them and re-plans placement.
        stored = conn.execute(
            select(
                col(Gpu.index),
                col(Gpu.uuid),
                col(Gpu.name),
                col(Gpu.memory_total_bytes),
                col(Gpu.compute_capability),
            )
            .where(col(Gpu.host_id) == host_id)
            .order_by(col(Gpu.index))
        ).all()
        memory.gpu_fingerprint = fingerprint
        if [tuple(row) for row in stored] == identity:
            return False
        conn.execute(delete(Gpu).where(col(Gpu.host_id) == host_id))
        if identity:
            conn.execute(
                insert(Gpu),
                [
                    {
                        "host_id": host_id,
                        "index": i,
                        "uuid": u,
                        "name": n,
                        "memory_total_bytes": m,
                        "compute_capability": c,
                    }
                    for i, u, n, m, c in identity
                ],
            )
        return True

    @staticmethod
    def _load(
        memory: HostMemory, instance_id: int, gauges: dict[str, float] | None, now: datetime
    ) -> tuple[int | None, int | None]:
        """An instance's running and waiting requests: as this heartbeat reports them, else as
        the last one did within `LOAD_HOLD` (an agent's scrape of a busy engine may time out:
        that is no reason to read its queue as empty), else unknown."""
        if gauges is not None:
            load = (_count(gauges.get(RUNNING_GAUGE)), _count(gauges.get(WAITING_GAUGE)))
            memory.load[instance_id] = (load, now)
            return load
        held = memory.load.get(instance_id)
        if held is not None and now - held[1] <= LOAD_HOLD:
            return held[0]
        memory.load.pop(instance_id, None)
        return (None, None)

    def _instances(
        self,
        conn: Connection,
        host_id: int,
        host_name: str,
        beat: Heartbeat,
        memory: HostMemory,
        now: datetime,
    ) -> None:
        if len(memory.load) > MAX_REMEMBERED_INSTANCES:
            memory.load.clear()
        if len(memory.observed) > MAX_REMEMBERED_INSTANCES:
            # The ids are the agent's to report (other hosts' are ignored by the UPDATE, but
            # remembered here): start over rather than keep every id it ever sent.
            memory.observed.clear()
        rows = []
        # The engines' load, the autoscaler's signal: written with the rest when it changes.
        gauges = {m.instance_id: m.gauges for m in beat.metrics}
        for inst in beat.instances:
            load = self._load(memory, inst.instance_id, gauges.get(inst.instance_id), now)
            observed = (
                inst.state.value,
                inst.pid,
                inst.restart_count,
                inst.last_exit.model_dump(mode="json") if inst.last_exit else None,
                inst.version_digest,
                inst.message,
                load[0],
                load[1],
            )
            if memory.observed.get(inst.instance_id) == observed:
                continue
            memory.observed[inst.instance_id] = observed
            rows.append(
                {
                    "b_id": inst.instance_id,
                    "b_state": observed[0],
                    "b_pid": observed[1],
                    "b_restarts": observed[2],
                    "b_exit": observed[3],
                    "b_digest": observed[4],
                    "b_message": observed[5],
                    "b_running": observed[6],
                    "b_waiting": observed[7],
                }
            )
        if not rows:
            return
        # Read what changed only when something did, to write a state-change event for it.
        before = {
            m["id"]: (m["observed_state"], m["name"])
            for m in conn.execute(
                select(col(Instance.id), col(Instance.observed_state), col(Deployment.name))
                .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
                .where(
                    col(Instance.host_id) == host_id,
                    col(Instance.id).in_([r["b_id"] for r in rows]),
                )
            ).mappings()
        }
        for r in rows:
            r["b_host"], r["b_now"] = host_id, now
        conn.execute(self._sql.observe_instance, rows)
        events = []
        for r in rows:
            if r["b_id"] not in before or before[r["b_id"]][0] == r["b_state"]:
                continue  # another host's instance (ignored), or no state change
            previous, deployment = before[r["b_id"]]
            detail = f": {r['b_message']}" if r["b_message"] else ""
            events.append(
                {
                    "time": now,
                    "actor": f"host:{host_name}",
                    "kind": f"instance.{r['b_state']}",
                    "subject": f"instance/{r['b_id']}",
                    "message": f"{deployment} instance {r['b_id']} on {host_name}: "
                    f"{previous} -> {r['b_state']}{detail}"[:2000],
                    "data": {
                        "deployment": deployment,
                        "host": host_name,
                        "previous": previous,
                        "restart_count": r["b_restarts"],
                        "last_exit": r["b_exit"],
                    },
                }
            )
        if events:
            conn.execute(insert(Event), events)
