"""Threat: heartbeats that should cost nothing occupy the heartbeat writer, which every real
heartbeat waits for: made-up or other roles' tokens (verified on the writer), a host sending as
fast as it can, and tables keyed by what clients send growing without end.

Tokens are now verified, read-only, in the shared thread pool before anything is queued behind
the writer; a host may send 4 heartbeats per interval on average (bursts of 60) and gets 429
with Retry-After past that, before its body is parsed; the token cache, the per-host tables and
the request metrics' labels are bounded.

Against a real control plane on loopback (SQLite, one writer; PostgreSQL, four).
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

import contextlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import sqlalchemy as sa
from sqlmodel import Session

from controlplane.auth import AgentTokenCache, Principal, Role, authenticate
from controlplane.heartbeat.observed_state import (
    MAX_REMEMBERED_INSTANCES,
    HostMemory,
    ObservedStateWriter,
)
from controlplane.heartbeat.rate_limit import HEARTBEAT_BURST, HeartbeatRateLimit
from controlplane.heartbeat.samples import MAX_SERIES_PER_BUCKET, HostSampleBucket
from controlplane.heartbeat.service import DEFAULT_WRITER_THREADS, WRITER_THREADS
from protocol.wire import Heartbeat, InstanceMetrics, InstanceState, ObservedInstance
from tests.controlplane.conftest import Api, api, db_url, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live


@contextlib.contextmanager
def writes_blocked(live: LiveControlPlane) -> Iterator[None]:
    """Make heartbeat writes wait, as a slow or busy database would: SQLite's write lock, or
    the host rows on PostgreSQL, held by another connection until the block ends."""
    url = live.engine.url
    if url.get_backend_name() == "sqlite":
        holder = sqlite3.connect(str(url.database), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    other = sa.create_engine(url)
    with other.connect() as conn:
        conn.execute(sa.text("SELECT id FROM host FOR UPDATE"))
        try:
            yield
        finally:
            conn.rollback()
    other.dispose()


def made_up_token() -> str:
    return f"dctl_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def test_made_up_tokens_are_refused_without_waiting_for_the_heartbeat_writer(
    live: LiveControlPlane,
) -> None:
    writers = WRITER_THREADS.get(live.engine.dialect.name, DEFAULT_WRITER_THREADS)
    agents = [live.register(f"gpu-{i}") for i in range(writers)]
    for agent in agents:
        assert live.heartbeat(agent).status_code == 200
    viewer = live.token("viewer")
    stuck: list[int] = []
    with writes_blocked(live):
        # Every writer thread now waits on the database with a real agent's heartbeat.
        beats = [
            threading.Thread(target=lambda a=a: stuck.append(live.heartbeat(a).status_code))
            for a in agents
        ]
        for beat in beats:
            beat.start()
        time.sleep(0.5)
        with httpx.Client(base_url=live.url, timeout=2.0) as http:
            for token, status in [(made_up_token(), 401)] * 20 + [(viewer, 403), ("junk", 401)]:
                started = time.monotonic()
                reply = http.post(
                    f"{V}/agents/heartbeat", json={}, headers={"Authorization": f"Bearer {token}"}
                )
                assert reply.status_code == status, reply.text
                assert time.monotonic() - started < 1.0
    for beat in beats:
        beat.join(30)
    assert len(stuck) == writers  # answered once the database let go (200, or 503 to retry)
    assert all(agent and live.heartbeat(agent).status_code == 200 for agent in agents)


def test_verified_heartbeats_still_record_when_their_token_was_last_used(
    live: LiveControlPlane,
) -> None:
    agent = live.register("gpu-1")

    def last_used() -> str | None:
        row = next(t for t in live.tokens() if t["id"] == agent.split("_")[1])
        return row["last_used_at"]

    assert last_used() is None
    assert live.heartbeat(agent).status_code == 200
    first = last_used()
    assert first is not None  # written on the writer, after verification off it
    live.clock.advance(30)
    assert live.heartbeat(agent).status_code == 200
    assert last_used() == first  # at most once a minute
    live.clock.advance(31)
    assert live.heartbeat(agent).status_code == 200
    assert last_used() != first


def test_a_host_heartbeating_faster_than_its_limit_gets_429_with_retry_after(
    live: LiveControlPlane,
) -> None:
    fast, calm = live.register("gpu-1"), live.register("gpu-2")
    # The clock stands still: nothing refills the bucket.
    assert [live.heartbeat(fast).status_code for _ in range(HEARTBEAT_BURST)] == [200] * 60
    limited = live.heartbeat(fast, gpus="not even parsed")
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"] == "rate_limited"
    # 4 per 5 s interval: one heartbeat's worth comes back in 1.25 s, rounded up.
    assert limited.headers["retry-after"] == "2"
    assert live.heartbeat(calm).status_code == 200  # other hosts are not affected
    live.clock.advance(1.25)
    assert live.heartbeat(fast).status_code == 200
    assert live.heartbeat(fast).status_code == 429
    # Refused heartbeats wrote nothing: the host was last seen at the last accepted one.
    host = live.call("GET", f"{V}/hosts/gpu-1", live.admin).json()
    assert host["last_seen_at"].startswith(live.clock().strftime("%Y-%m-%dT%H:%M:%S"))


def test_a_real_agents_cadence_is_never_limited(live: LiveControlPlane) -> None:
    agent = live.register("gpu-1")
    statuses = []
    for _ in range(40):  # eight instances start: 32 state changes, each reported 0.2 s after
        statuses.append(live.heartbeat(agent).status_code)
        live.clock.advance(0.2)
    for _ in range(100):  # then one heartbeat per 5 s interval, and a change now and then
        statuses.append(live.heartbeat(agent).status_code)
        live.clock.advance(0.2)
        statuses.append(live.heartbeat(agent).status_code)
        live.clock.advance(4.8)
    assert set(statuses) == {200}


def test_caches_keyed_by_what_clients_send_stay_bounded(
    live: LiveControlPlane,
) -> None:
    ctx = live.app.state.ctx
    agent = live.register("gpu-1")
    assert live.heartbeat(agent).status_code == 200
    cached = len(ctx.token_cache)
    with httpx.Client(base_url=live.url, timeout=10) as http:
        for _ in range(200):
            token = made_up_token()
            reply = http.post(
                f"{V}/agents/heartbeat", json={}, headers={"Authorization": f"Bearer {token}"}
            )
            assert reply.status_code == 401
    assert len(ctx.token_cache) == cached  # made-up secrets never enter it
    # And what valid tokens fill is capped, least recently used out first.
    cache = AgentTokenCache(max_entries=3)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    secrets_ = [made_up_token() for _ in range(5)]
    for i, secret in enumerate(secrets_):
        principal = Principal(i, secret.split("_")[1], f"agent-{i}", Role.AGENT, host_id=i)
        cache.put(secret, principal, now)
    assert len(cache) == 3
    assert cache.get(secrets_[0], now) is None and cache.get(secrets_[4], now) is not None
    limits = HeartbeatRateLimit(interval_s=5, per_interval=4, max_hosts=3)
    for host in range(10):
        limits.admit(host, now + timedelta(seconds=host))
    assert len(limits) == 3


def test_what_an_agent_reports_cannot_grow_the_control_planes_memory_without_end(
    live: LiveControlPlane,
) -> None:
    agent = live.register("gpu-1")
    host_id = live.call("GET", f"{V}/hosts/gpu-1", live.admin).json()["id"]
    with Session(live.engine) as session:
        principal = authenticate(session, agent, live.clock(), touch=False)
    writer = ObservedStateWriter(live.engine)
    memory = HostMemory(HostSampleBucket(host_id))
    for beat in range(8):  # 256 made-up instance ids and metric names each time
        ids = range(beat * 256 + 1, beat * 256 + 257)
        report = Heartbeat(
            instances=[ObservedInstance(instance_id=i, state=InstanceState.READY) for i in ids],
            metrics=[
                InstanceMetrics(instance_id=i, counters={f"c{beat}_{n}": 1.0 for n in range(256)})
                for i in ids
            ],
        )
        assert writer.record(principal, host_id, report, memory, live.clock()) is not None
        assert len(memory.observed) <= MAX_REMEMBERED_INSTANCES + 256
    assert len(memory.samples.counters) <= MAX_SERIES_PER_BUCKET


def test_request_metrics_do_not_grow_a_label_per_made_up_method(api: Api) -> None:
    for i in range(20):
        api.client.request(f"BREW{i}", "/healthz")
    metrics = api.client.get("/metrics").text
    assert "BREW" not in metrics and 'method="other"' in metrics
