"""The heartbeat hot path: record what an agent observed, answer with its desired state.

Kept to one statement per heartbeat in the steady state: an UPDATE ... RETURNING of the host
row. Instances are written only when their observed state changed, GPUs only when the set
changed, facts only when they changed, metric samples once per 10 s bucket; the desired state
is rebuilt (and its JSON cached) only when the host's generation moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col

from controlplane.models import Deployment, Event, Gpu, Instance, Model, UTCDateTime
from controlplane.models import ModelVersion as VersionRow
from controlplane.samples import HostSampleBucket
from protocol.sources import local_source_dir
from protocol.wire import (
    DesiredInstance,
    GpuStatus,
    Heartbeat,
    HostState,
    Manifest,
    MemoryPlan,
    ModelVersionRef,
)


class _Statements:
    """The hot path's SQL, built once: plain text with typed parameters, cheap to execute."""

    def __init__(self, dialect: str) -> None:
        # JSON documents arrive already serialised (by pydantic, in Rust); PostgreSQL needs
        # the text cast to json, SQLite stores the text as is.
        as_json = "CAST({} AS JSON)" if dialect == "postgresql" else "{}"
        # One statement records the heartbeat and reads what the reply needs. RETURNING gives
        # the state as it was (this statement does not change it).
        self.touch_host = (
            sa.text(
                "UPDATE host SET last_seen_at = :now, applied_generation = :gen, "
                f"gpu_samples = {as_json.format(':gpus')} WHERE id = :hid "
                "RETURNING name, state, draining, desired_generation, heartbeat_interval_s"
            )
            .bindparams(sa.bindparam("now", type_=UTCDateTime()))
            .columns(
                sa.column("name", sa.String),
                sa.column("state", sa.String),
                sa.column("draining", sa.Boolean),
                sa.column("desired_generation", sa.Integer),
                sa.column("heartbeat_interval_s", sa.Float),
            )
        )
        self.set_facts = sa.text(
            f"UPDATE host SET facts = {as_json.format(':facts')} WHERE id = :hid"
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
                observed_at=bindparam("b_now"),
            )
        )


_T = TypeVar("_T")
_DESIRED_LIST = TypeAdapter(list[DesiredInstance])
_GPU_LIST = TypeAdapter(list[GpuStatus])


class UnknownHostError(LookupError):
    """The token's host no longer exists (it was removed): the agent must register again."""


@dataclass
class _HostCache:
    """What this process remembers about a host to skip writes that would change nothing."""

    samples: HostSampleBucket

    facts_json: str = ""
    last_seen: datetime | None = None
    gpu_fingerprint: int = 0
    observed: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    desired_generation: int = -1
    desired_json: bytes = b"[]"


# Heartbeat writer threads per dialect. SQLite has one writer anyway. PostgreSQL gets a few,
# not the 40 of the shared request pool: more threads only queue longer for the GIL after
# each database round trip (measured: 4 beat both the shared pool and 2).
WRITER_THREADS = {"sqlite": 1}
DEFAULT_WRITER_THREADS = 4


class HeartbeatService:
    """Handles heartbeats; one per app, shared by all request threads."""

    def __init__(
        self,
        engine: Engine,
        clock: Callable[[], datetime],
        on_heartbeat: Callable[[float | None], None] | None = None,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._on_heartbeat = on_heartbeat
        self._caches: dict[int, _HostCache] = {}
        self._sql = _Statements(engine.dialect.name)
        # SQLite has one writer at a time and its busy handler waits by sleeping (1, 2, 5, 10,
        # ... ms), which turns contention into long tails. Queue heartbeat writes on a lock
        # instead: a waiting thread wakes the moment the previous write commits.
        self._write_lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()
        )
        # Heartbeats run on a few dedicated threads (one for SQLite, which has one writer
        # anyway): no hop through the shared thread pool (its limiter, thread churn) and no
        # convoy of request threads contending for the write lock and the GIL.
        self._writer_threads = WRITER_THREADS.get(engine.dialect.name, DEFAULT_WRITER_THREADS)
        self._writer = self._new_writer()
        self._lock = threading.Lock()

    async def submit(
        self, host_id: int, beat: Heartbeat, files_base_url: Callable[[], str]
    ) -> bytes:
        """`handle` off the event loop, on the heartbeat writer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self.handle, host_id, beat, files_base_url)

    async def run_on_writer(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run `fn(*args)` on the writer threads (on SQLite: in turn with heartbeat writes)."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    def close(self) -> None:
        """Stop the writer threads (after the heartbeats they hold are handled).

        A fresh executor (which starts its thread only when used) takes its place, so an app
        whose lifespan runs again still handles heartbeats.
        """
        writer, self._writer = self._writer, self._new_writer()
        writer.shutdown(wait=True)

    def _new_writer(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self._writer_threads, thread_name_prefix="heartbeat-writer")

    def _cache(self, host_id: int) -> _HostCache:
        with self._lock:
            cache = self._caches.get(host_id)
            if cache is None:
                cache = self._caches[host_id] = _HostCache(HostSampleBucket(host_id))
            return cache

    def forget(self, host_id: int) -> None:
        """Drop what is cached about a host (it was removed or re-registered)."""
        with self._lock:
            self._caches.pop(host_id, None)

    def handle(self, host_id: int, beat: Heartbeat, files_base_url: Callable[[], str]) -> bytes:
        """Commit the host's last-seen time and observed state, then reply with desired state.

        `files_base_url` is called only when the desired state is rebuilt (building the URL
        from the request costs more than the rest of a steady-state reply).

        Returns the JSON of a `HeartbeatReply`; the instance list is serialised once per
        generation and reused, since it only changes when the generation does.
        """
        now = self._clock()
        cache = self._cache(host_id)
        try:
            with self._write_lock:
                row = self._record(host_id, beat, cache, now)
        except BaseException:
            # The transaction rolled back: what the cache says was written may not be.
            self.forget(host_id)
            raise
        if self._on_heartbeat is not None:
            previous = cache.last_seen
            self._on_heartbeat(None if previous is None else (now - previous).total_seconds())
        cache.last_seen = now
        if cache.desired_generation != row.desired_generation:
            desired = self._desired_instances(host_id, files_base_url())
            cache.desired_json = _DESIRED_LIST.dump_json(desired)
            cache.desired_generation = row.desired_generation
        head = json.dumps(
            {
                "generation": row.desired_generation,
                "host_id": host_id,
                "host_state": HostState.READY.value,
                "draining": bool(row.draining),
                "heartbeat_interval_s": row.heartbeat_interval_s,
                "server_time": now.isoformat().replace("+00:00", "Z"),
            },
            separators=(",", ":"),
        )
        return head[:-1].encode() + b',"instances":' + cache.desired_json + b"}"

    def _record(self, host_id: int, beat: Heartbeat, cache: _HostCache, now: datetime) -> Any:
        """One transaction: host row, GPUs, observed instances, metric samples."""
        sql = self._sql
        with self._engine.begin() as conn:
            row = conn.execute(
                sql.touch_host,
                {
                    "hid": host_id,
                    "now": now,
                    "gen": beat.applied_generation,
                    "gpus": _GPU_LIST.dump_json(beat.gpus).decode(),
                },
            ).first()
            if row is None:
                raise UnknownHostError("this host was removed from the fleet: register again")
            facts = beat.facts.model_dump_json()
            if facts != cache.facts_json:
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
            self._record_gpus(conn, host_id, beat, cache)
            self._record_instances(conn, host_id, row.name, beat, cache, now)
            cache.samples.add(conn, beat, now)
        cache.facts_json = facts
        return row

    def _record_gpus(
        self, conn: Connection, host_id: int, beat: Heartbeat, cache: _HostCache
    ) -> None:
        identity = [
            (g.index, g.uuid, g.name, g.memory_total_bytes, g.compute_capability) for g in beat.gpus
        ]
        # Per-process cache, so Python's (per-process salted) hash is a fine fingerprint.
        fingerprint = hash(tuple(identity)) or 1
        if fingerprint == cache.gpu_fingerprint:
            return
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
        cache.gpu_fingerprint = fingerprint

    def _record_instances(
        self,
        conn: Connection,
        host_id: int,
        host_name: str,
        beat: Heartbeat,
        cache: _HostCache,
        now: datetime,
    ) -> None:
        rows = []
        for inst in beat.instances:
            observed = (
                inst.state.value,
                inst.pid,
                inst.restart_count,
                inst.last_exit.model_dump(mode="json") if inst.last_exit else None,
                inst.version_digest,
                inst.message,
            )
            if cache.observed.get(inst.instance_id) == observed:
                continue
            cache.observed[inst.instance_id] = observed
            rows.append(
                {
                    "b_id": inst.instance_id,
                    "b_state": observed[0],
                    "b_pid": observed[1],
                    "b_restarts": observed[2],
                    "b_exit": observed[3],
                    "b_digest": observed[4],
                    "b_message": observed[5],
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

    def _desired_instances(self, host_id: int, files_base_url: str) -> list[DesiredInstance]:
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(
                    col(Instance.id),
                    col(Instance.port),
                    col(Instance.desired_state),
                    col(Deployment.name).label("deployment"),
                    col(Deployment.engine_config),
                    col(Model.name).label("model"),
                    col(VersionRow.version),
                    col(VersionRow.digest),
                    col(VersionRow.line),
                    col(VersionRow.manifest),
                    col(VersionRow.source_uri),
                    col(VersionRow.memory_plan),
                )
                .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
                .join(VersionRow, col(VersionRow.id) == col(Instance.version_id))
                .join(Model, col(Model.id) == col(VersionRow.model_id))
                .where(col(Instance.host_id) == host_id)
                .order_by(col(Instance.id))
            ).all()
        desired = []
        for r in rows:
            files_url = None
            if local_source_dir(r.source_uri) is not None:
                files_url = (
                    f"{files_base_url.rstrip('/')}/api/v1/models/{r.model}/versions/"
                    f"{r.version}/files/"
                )
            desired.append(
                DesiredInstance(
                    instance_id=r.id,
                    deployment=r.deployment,
                    port=r.port,
                    engine_config=r.engine_config,
                    desired_state=r.desired_state,
                    model=ModelVersionRef(
                        name=r.model,
                        version=r.version,
                        digest=r.digest,
                        line=r.line,
                        manifest=Manifest(files=r.manifest),
                        source_uri=r.source_uri,
                        files_url=files_url,
                        memory_plan=MemoryPlan(**r.memory_plan) if r.memory_plan else None,
                    ),
                )
            )
        return desired
