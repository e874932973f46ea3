"""The heartbeat path: check the agent's token, record what it observed, reply with desired state.

`HeartbeatService.answer` is the one implementation; the fast lane (api/heartbeat_fastpath.py)
and the regular route both call it. In the steady state a heartbeat costs one statement: an
UPDATE ... RETURNING of the host row (`observed_state`) whose WHERE clause also checks that the
agent's token row is still unrevoked, unexpired and bound to this host. So the token cache only
spares the token lookup, and a token revoked on any replica fails its next heartbeat on every
replica. The desired state is rebuilt (and its JSON cached) only when the host's generation
moved.

Only verified work waits for the writer: a token is checked (read only) in the shared thread
pool and the host's rate limit (`rate_limit`) before anything is queued there, so made-up tokens,
other roles' tokens and hosts heartbeating too fast are answered without it. What the writer then
does for a token besides the heartbeat is `last_used_at`, once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, NoReturn, TypeVar

from pydantic import TypeAdapter
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from controlplane.auth import (
    AgentTokenCache,
    Principal,
    Role,
    TokenRefused,
    authenticate,
    last_used_due,
    parse_authorization,
    touch_last_used,
)
from controlplane.db import session_scope
from controlplane.heartbeat.desired_state import desired_instances, keep_digests, prefetch
from controlplane.heartbeat.observed_state import HostMemory, ObservedStateWriter
from controlplane.heartbeat.rate_limit import MAX_TRACKED_HOSTS, HeartbeatRateLimit
from controlplane.heartbeat.samples import HostSampleBucket
from controlplane.services.errors import DomainError, Forbidden
from controlplane.services.placement import place_fleet
from protocol.wire import DesiredInstance, Heartbeat, HeartbeatReply, HostState

_T = TypeVar("_T")
_DESIRED_LIST = TypeAdapter(list[DesiredInstance])
_REPLY = TypeAdapter(HeartbeatReply)


class UnknownHostError(DomainError):
    """The token's host no longer exists (it was removed): the agent must register again."""

    status = 404
    code = "host_removed"

    def __init__(self) -> None:
        super().__init__("this host was removed from the fleet: register again")


# Heartbeat writer threads per dialect. SQLite has one writer anyway. PostgreSQL gets a few,
# not the 40 of the shared request pool: more threads only queue longer for the GIL after
# each database round trip (measured: 4 beat both the shared pool and 2).
WRITER_THREADS = {"sqlite": 1}
DEFAULT_WRITER_THREADS = 4
# Heartbeats a host may send per heartbeat interval, on average (see `rate_limit`).
DEFAULT_MAX_PER_INTERVAL = 4.0


class HeartbeatService:
    """Handles heartbeats; one per app, shared by all request threads."""

    def __init__(
        self,
        engine: Engine,
        clock: Callable[[], datetime],
        tokens: AgentTokenCache,
        on_heartbeat: Callable[[float | None], None] | None = None,
        *,
        interval_s: float = 5.0,
        max_per_interval: float = DEFAULT_MAX_PER_INTERVAL,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._tokens = tokens
        self._on_heartbeat = on_heartbeat
        self._limit = HeartbeatRateLimit(interval_s, max_per_interval)
        # Least recently heartbeating hosts first; bounded like every per-host table here.
        self._memories: OrderedDict[int, HostMemory] = OrderedDict()
        self._observed = ObservedStateWriter(engine)
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

    async def answer(self, authorization: str | None, body: bytes) -> bytes:
        """The whole heartbeat: the JSON of a `HeartbeatReply` for the token's host.

        Raises `AuthError` (no valid token: 401), `Forbidden` (not an agent token bound to a
        host: 403), `HeartbeatTooSoon` (the host heartbeats too fast: 429), pydantic's
        `ValidationError` (bad body: 422), `UnknownHostError` (404) or a database error, in
        that order: the body is not even parsed for a caller who may not send it. A failed
        heartbeat wrote nothing (its transaction rolled back), so it may be run again.
        """
        secret = parse_authorization(authorization)
        principal, touch = await self._principal(secret)
        assert principal.host_id is not None  # `_principal` refuses unbound tokens
        self._limit.admit(principal.host_id, self._clock())
        beat = Heartbeat.model_validate_json(body)
        try:
            return await self.submit(principal, beat, touch)
        except TokenRefused:
            # The token changed in the store since it was cached: ask the store why (that
            # raises AuthError with the reason), or go on if it is valid again by now.
            self._tokens.drop_key(principal.key_id)
            principal, touch = await self._principal(secret)
            return await self.submit(principal, beat, touch)

    async def _principal(self, secret: str) -> tuple[Principal, bool]:
        """The agent behind `secret` (cached identity, else verified in the store), and whether
        its `last_used_at` is due for a write."""
        now = self._clock()
        principal = self._tokens.get(secret, now)
        touch = False
        if principal is None:
            # In the shared thread pool, reading only: a flood of made-up tokens neither
            # waits in line for the writer nor holds up the heartbeats queued there.
            principal = await run_in_threadpool(self._verify, secret, now)
            touch = last_used_due(principal, now)
            self._tokens.put(secret, principal, now)
        if not principal.may(Role.AGENT):
            raise Forbidden(
                f"this needs a token with role agent; "
                f"token {principal.name!r} has role {principal.role.value}"
            )
        if principal.host_id is None:
            raise Forbidden("this agent token is not bound to a host: register again")
        return principal, touch

    def _verify(self, secret: str, now: datetime) -> Principal:
        with session_scope(self._engine) as session:
            return authenticate(session, secret, now, touch=False)

    async def submit(self, principal: Principal, beat: Heartbeat, touch: bool = False) -> bytes:
        """`handle` off the event loop, on the heartbeat writer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self.handle, principal, beat, touch)

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

    def _memory(self, host_id: int) -> HostMemory:
        with self._lock:
            memory = self._memories.get(host_id)
            if memory is None:
                memory = self._memories[host_id] = HostMemory(HostSampleBucket(host_id))
                # A host forgotten here only costs its next heartbeat a full write.
                while len(self._memories) > MAX_TRACKED_HOSTS:
                    self._memories.popitem(last=False)
            else:
                self._memories.move_to_end(host_id)
            return memory

    def forget(self, host_id: int) -> None:
        """Drop what is remembered of a host (removed, re-registered, or a write failed)."""
        with self._lock:
            self._memories.pop(host_id, None)

    def forget_host(self, host_id: int) -> None:
        """Drop everything kept of a host: its memory and its rate limit (it was removed)."""
        self.forget(host_id)
        self._limit.forget(host_id)

    def handle(self, principal: Principal, beat: Heartbeat, touch: bool = False) -> bytes:
        """Commit the host's last-seen time and observed state, then reply with desired state.

        Returns the JSON of a `HeartbeatReply`; the instance list is serialised once per
        generation and reused, since it only changes when the generation does. With `touch`,
        the token's `last_used_at` is written too (due once a minute).
        """
        host_id = principal.host_id
        if host_id is None:
            raise Forbidden("this agent token is not bound to a host: register again")
        now = self._clock()
        memory = self._memory(host_id)
        with memory.lock:
            try:
                with self._write_lock:
                    if touch:
                        with session_scope(self._engine) as session:
                            touch_last_used(session, principal.token_id, now)
                    recorded = self._observed.record(principal, host_id, beat, memory, now)
                    if recorded is not None and recorded.gpus_changed:
                        self._replan(now)
            except BaseException:
                # The transaction rolled back: what memory says was written may not be.
                self.forget(host_id)
                raise
            if recorded is None:
                self._refused(host_id)
            if self._on_heartbeat is not None:
                # Only this replica's own previous heartbeat has a time here to measure from.
                previous = memory.last_seen if recorded.sole_writer else None
                self._on_heartbeat(None if previous is None else (now - previous).total_seconds())
            memory.last_seen = now
            self._limit.learn_interval(host_id, recorded.interval_s)
            if memory.desired_generation != recorded.generation:
                with self._engine.connect() as conn:
                    desired = desired_instances(conn, host_id, recorded.advertise_address)
                    memory.keep_digests = keep_digests(conn, host_id)
                    memory.prefetch = prefetch(conn, host_id)
                memory.desired_json = _DESIRED_LIST.dump_json(desired)
                memory.desired_generation = recorded.generation
            desired_json = memory.desired_json
            keep, fetch = memory.keep_digests, memory.prefetch
        head = _REPLY.dump_json(
            HeartbeatReply(
                generation=recorded.generation,
                host_id=host_id,
                host_state=HostState.READY,
                draining=recorded.draining,
                heartbeat_interval_s=recorded.interval_s,
                server_time=now,
                keep_digests=keep,
                prefetch=fetch,
            ),
            exclude={"instances"},
        )
        # The reply is the wire model, its instance list spliced in as serialised once.
        return head[:-1] + b',"instances":' + desired_json + b"}"

    def _replan(self, now: datetime) -> None:
        """Place every deployment again: a host's GPUs appeared, changed or went away (rare)."""
        with session_scope(self._engine) as session:
            place_fleet(session, now, "system:placement")

    def _refused(self, host_id: int) -> NoReturn:
        """The heartbeat's UPDATE matched no row: say whether the host or the token is gone."""
        if not self._observed.host_exists(host_id):
            raise UnknownHostError()
        raise TokenRefused("this agent token is no longer valid: register the agent again")
