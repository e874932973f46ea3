"""Heartbeat throughput of the control plane: N simulated agents over HTTP on loopback.

Starts a real `dctl server` subprocess (SQLite file, then a throwaway PostgreSQL database when
one listens on 127.0.0.1:5432), registers N hosts with a bootstrap token, then lets every agent
heartbeat on its own keep-alive connection:

- open loop: each agent sends every N/RATE seconds (RATE heartbeats/s in total), the way a
  fleet of N hosts at a fixed interval does; reports the rate achieved and p50/p99 latency;
- closed loop: C agents send back to back; reports the most the server sustains.

Each heartbeat is realistic: facts, 8 GPUs with samples, 2 instances with engine metric deltas.
Every simulated agent sends far faster than a real one (back to back, or 4/s each at 1000/s),
so the server runs with its per-host heartbeat rate limit raised out of reach
(`DCTL_HEARTBEAT_MAX_PER_INTERVAL`): the limiter is still consulted on every heartbeat, and so
counted in the figures, but never refuses one.
Server CPU (from /proc) and the load generator's CPU are reported too: both share the machine.
Goal: >= 500 heartbeats/s with p99 < 100 ms (2,500 hosts at a 5 s interval).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from client.credentials import CredentialsFile
from protocol.logs import LogBatch, ShippedLine
from protocol.wire import (
    HEARTBEAT_PATH,
    REGISTER_PATH,
    GpuStatus,
    Heartbeat,
    HistogramDelta,
    HostFacts,
    InstanceMetrics,
    InstanceState,
    ObservedInstance,
    PreflightCheck,
    RegisterRequest,
)

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Heartbeats per host per interval the bench's server allows: more than any phase sends.
UNLIMITED_PER_INTERVAL = 1_000_000
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVER_CMD = [sys.executable, "-m", "cli", "server"]


def advertise_address(host: int) -> str:
    """Where host number HOST's engines listen (the agent reports it with every heartbeat)."""
    return f"10.0.{host // 256}.{host % 256}"


def heartbeat_body(host: int, rng: random.Random, log_lines: int = 0) -> bytes:
    """A realistic heartbeat of host number HOST, serialised once (agents resend similar ones),
    with LOG_LINES shipped log lines (engine-like, ~160 characters each)."""
    gpus = [
        GpuStatus(
            index=i,
            uuid=f"GPU-{host:05d}-{i}-5f1c2a7e-9b3d-4c1e-8a2f",
            name="NVIDIA H100 80GB HBM3",
            memory_total_bytes=80 * 2**30,
            memory_used_bytes=rng.randrange(10, 79) * 2**30,
            utilization_percent=float(rng.randrange(0, 100)),
            temperature_c=float(rng.randrange(30, 80)),
            power_w=float(rng.randrange(80, 700)),
            power_limit_w=700.0,
            ecc_uncorrectable=0,
            persistence_mode=True,
            compute_capability="9.0",
        )
        for i in range(8)
    ]
    instances = [
        ObservedInstance(
            instance_id=host * 2 + k + 1,
            state=InstanceState.READY,
            pid=10_000 + k,
            port=18000 + k,
            restart_count=0,
            message="",
        )
        for k in range(2)
    ]
    buckets = {le: float(n) for le, n in (("0.1", 3), ("0.5", 40), ("1", 57), ("+Inf", 60))}
    metrics = [
        InstanceMetrics(
            instance_id=inst.instance_id,
            counters={"dllm_generated_tokens_total": 5120.0, "dllm_requests_total": 60.0},
            gauges={"dllm_requests_running": 4.0, "dllm_requests_waiting": 1.0},
            histograms={
                "dllm_e2e_request_latency_seconds": HistogramDelta(
                    buckets=buckets, sum=31.5, count=60
                ),
                "dllm_tokens_per_forward": HistogramDelta(buckets=buckets, sum=180.0, count=60),
            },
        )
        for inst in instances
    ]
    facts = HostFacts(
        hostname=f"gpu-{host:05d}.example",
        os="Ubuntu 24.04",
        agent_version="0.1.0",
        gpu_backend="nvml",
        driver_version="560.35.03",
        cuda_driver_version="12.6",
        cpu_count=128,
        memory_bytes=2 * 2**40,
        disk_free_bytes=3 * 2**40,
        preflight=[PreflightCheck(name=n, status="pass") for n in ("driver", "cuda", "ecc")],
    )
    # The agent's own lines: an engine's would be checked against instances this bench never
    # created (and dropped); these are stored like an engine's.
    now = datetime.now(UTC)
    logs = LogBatch(
        lines=[
            ShippedLine(
                source="agent",
                time=now,
                seq=n,
                line=f'{{"time": "{now.isoformat()}", "level": "info", "logger": "engine.requests"'
                f', "message": "POST /v1/completions 200", "request_id": "req-{host}-{n}"}}',
                request_id=f"req-{host}-{n}",
            )
            for n in range(log_lines)
        ]
    )
    beat = Heartbeat(
        applied_generation=1,
        facts=facts,
        advertise_address=advertise_address(host),
        gpus=gpus,
        instances=instances,
        metrics=metrics,
        logs=logs if log_lines else None,
    )
    return beat.model_dump_json(exclude_none=True).encode()


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (and its reaped children) used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / CLK_TCK


def backend_cpu(database: str) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving DATABASE (their titles name it)."""
    found: dict[int, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with suppress(OSError, IndexError, ValueError):
            title = (proc / "cmdline").read_bytes()
            if title.startswith(b"postgres: ") and f" {database} ".encode() in title:
                found[int(proc.name)] = cpu_seconds(int(proc.name))
    return found


class DatabaseCpu:
    """PostgreSQL backend CPU over a phase, polled: the pool opens and closes backends."""

    def __init__(self, database: str | None) -> None:
        self.database = database
        self.start = backend_cpu(database) if database else {}
        self.last = dict(self.start)

    def poll(self) -> None:
        """Remember each backend's latest figure (one that exits keeps its last one)."""
        if self.database:
            self.last.update(backend_cpu(self.database))

    async def poll_every(self, seconds: float) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            self.poll()

    def used(self) -> float:
        """CPU seconds since the start; a backend born since then started from zero."""
        self.poll()
        return sum(cpu - self.start.get(pid, 0.0) for pid, cpu in self.last.items())


@dataclass
class RunningServer:
    """A `dctl server` subprocess and the admin token it saved on first start."""

    url: str
    proc: subprocess.Popen[bytes]
    admin_token: str
    database: str | None = None  # PostgreSQL database name, whose backends' CPU is counted


@contextmanager
def dctl_server(db_url: str, home: Path) -> Iterator[RunningServer]:
    """Run `dctl server --migrate` on DB_URL until the block ends."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
        DCTL_LOG_LEVEL="warning",
        DCTL_HEARTBEAT_MAX_PER_INTERVAL=str(UNLIMITED_PER_INTERVAL),
    )
    out = home / f"server-{port}.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [*SERVER_CMD, "--migrate", "--db", db_url, "--port", str(port)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"dctl server exited: {out.read_text()[-2000:]}")
            with suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("dctl server did not become healthy in 60 s")
            time.sleep(0.1)
        # stdout is a file, not a terminal: the first admin token is only in the credentials.
        _, contexts = CredentialsFile(home / "config" / "dctl" / "credentials").load()
        admin = contexts.get("default")
        if admin is None or not admin.token:
            raise SystemExit(f"dctl server saved no admin token: {out.read_text()[-2000:]}")
        database = db_url.rsplit("/", 1)[1] if db_url.startswith("postgresql") else None
        yield RunningServer(url, proc, admin.token, database)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def register_agents(server: RunningServer, count: int) -> list[str]:
    """Register COUNT hosts with one bootstrap token; returns their agent tokens."""
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        boot = http.post(
            "/api/v1/tokens",
            json={"name": "bench-bootstrap", "role": "bootstrap", "uses": count},
            headers=admin,
        )
        boot.raise_for_status()
        headers = {
            "Authorization": f"Bearer {boot.json()['secret']}",
            "Content-Type": "application/json",
        }
        tokens = []
        for i in range(count):
            body = RegisterRequest(
                name=f"gpu-{i:05d}",
                labels={"rack": f"r{i % 40}"},
                advertise_address=advertise_address(i),
            )
            reply = http.post(REGISTER_PATH, content=body.model_dump_json(), headers=headers)
            reply.raise_for_status()
            tokens.append(str(reply.json()["agent_token"]))
    return tokens


@dataclass
class Phase:
    """What one load phase measured."""

    name: str
    sent: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    server_cpu_s: float
    database_cpu_s: float
    client_cpu_s: float

    @property
    def rate(self) -> float:
        """Successful heartbeats per second."""
        return (self.sent - self.errors) / self.seconds

    def percentile(self, q: float) -> float:
        """Latency percentile Q (0-100) in ms."""
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def per_heartbeat_ms(self, cpu_s: float) -> float:
        """CPU milliseconds per heartbeat: what bounds throughput once the cores are busy."""
        return 1000 * cpu_s / max(self.sent, 1)

    def line(self, backend: str) -> str:
        """One line of figures."""
        return (
            f"{backend:<10} {self.name:<30} {self.rate:7.0f} hb/s  "
            f"p50 {self.percentile(50):6.1f} ms  p99 {self.percentile(99):6.1f} ms  "
            f"errors {self.errors}  server CPU {100 * self.server_cpu_s / self.seconds:4.0f}% "
            f"({self.per_heartbeat_ms(self.server_cpu_s):.1f} ms/hb)  "
            + (
                f"PostgreSQL CPU {100 * self.database_cpu_s / self.seconds:4.0f}% "
                f"({self.per_heartbeat_ms(self.database_cpu_s):.1f} ms/hb)  "
                if self.database_cpu_s
                else ""
            )
            + f"load-gen CPU {100 * self.client_cpu_s / self.seconds:4.0f}% "
            f"({self.per_heartbeat_ms(self.client_cpu_s):.1f} ms/hb)"
        )


class AgentConnection:
    """One agent's keep-alive HTTP/1.1 connection, written by hand.

    A general HTTP client costs the load generator more CPU per request than the server
    spends on it, and both share two cores; this costs a few tens of microseconds.
    """

    def __init__(self, host: str, port: int, token: str, body: bytes) -> None:
        self.host, self.port = host, port
        head = (
            f"POST {HEARTBEAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.request = head.encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def heartbeat(self) -> int:
        """Send one heartbeat and read the whole reply; returns the HTTP status."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if match is None:
            raise ConnectionError("reply without Content-Length")
        await self.reader.readexactly(int(match.group(1)))
        if re.search(rb"(?i)\r\nconnection: *close", head):
            await self.close()
        return status

    async def close(self) -> None:
        """Close the connection (the next heartbeat opens a new one)."""
        if self.writer is not None:
            self.writer.close()
            with suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def run_phase(
    server: RunningServer,
    tokens: list[str],
    bodies: list[bytes],
    *,
    name: str,
    seconds: float,
    rate: float | None,
) -> Phase:
    """Heartbeat for SECONDS: every agent at interval len(tokens)/RATE, or back to back."""
    latencies: list[float] = []
    counts = {"sent": 0, "errors": 0}
    interval = len(tokens) / rate if rate else 0.0
    url = httpx.URL(server.url)
    host, port = url.host, url.port or 80
    start = time.perf_counter()
    stop = start + seconds

    async def agent(token: str, body: bytes) -> None:
        conn = AgentConnection(host, port, token, body)
        due = start + (random.random() * interval if interval else 0.0)
        try:
            while True:
                now = time.perf_counter()
                if due > now:
                    await asyncio.sleep(min(due, stop) - now)
                if time.perf_counter() >= stop:
                    return
                sent_at = time.perf_counter()
                try:
                    ok = await conn.heartbeat() == 200
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                    await conn.close()
                latencies.append(1000 * (time.perf_counter() - sent_at))
                counts["sent"] += 1
                counts["errors"] += 0 if ok else 1
                # Like a real agent: the next beat is due one interval later, or now if late.
                due = max(due + interval, time.perf_counter()) if interval else 0.0
        finally:
            await conn.close()

    server_cpu, client_cpu = cpu_seconds(server.proc.pid), time.process_time()
    database_cpu = DatabaseCpu(server.database)
    poller = asyncio.create_task(database_cpu.poll_every(0.25))
    await asyncio.gather(*(agent(t, b) for t, b in zip(tokens, bodies, strict=True)))
    elapsed = time.perf_counter() - start
    poller.cancel()
    return Phase(
        name=name,
        sent=counts["sent"],
        errors=counts["errors"],
        seconds=elapsed,
        latencies_ms=latencies,
        server_cpu_s=cpu_seconds(server.proc.pid) - server_cpu,
        database_cpu_s=database_cpu.used(),
        client_cpu_s=time.process_time() - client_cpu,
    )


def bench_backend(backend: str, db_url: str, args: argparse.Namespace) -> list[Phase]:
    """Every phase against one database."""
    with (
        tempfile.TemporaryDirectory(prefix=f"dctl-bench-{backend}-") as tmp,
        dctl_server(db_url, Path(tmp)) as server,
    ):
        tokens = register_agents(server, args.agents)
        rng = random.Random(0)
        bodies = [heartbeat_body(i, rng, args.log_lines) for i in range(args.agents)]
        # Warm-up: first heartbeats insert GPU rows and instance state; not measured.
        asyncio.run(
            run_phase(server, tokens, bodies, name="warm-up", seconds=args.warmup, rate=None)
        )
        phases = []
        for rate in args.rates:
            phases.append(
                asyncio.run(
                    run_phase(
                        server,
                        tokens,
                        bodies,
                        name=f"open loop {rate:.0f}/s, {args.agents} agents",
                        seconds=args.duration,
                        rate=rate,
                    )
                )
            )
        closed = tokens[: args.concurrency]
        phases.append(
            asyncio.run(
                run_phase(
                    server,
                    closed,
                    bodies[: len(closed)],
                    name=f"closed loop, {len(closed)} agents",
                    seconds=args.duration,
                    rate=None,
                )
            )
        )
    return phases


@contextmanager
def throwaway_postgres() -> Iterator[str | None]:
    """A fresh PostgreSQL database on 127.0.0.1:5432, dropped afterwards; None if none runs."""
    try:
        import psycopg
    except ImportError:
        yield None
        return
    name = f"dctl_bench_{os.getpid()}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError:
        yield None
        return
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run every backend, print one line per phase."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=250, help="simulated hosts")
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[100.0, 250.0, 500.0, 1000.0],
        help="open-loop targets, hb/s",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop agents")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"])
    parser.add_argument(
        "--log-lines", type=int, default=0, help="log lines each heartbeat ships (issue 32)"
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for the test suite")
    args = parser.parse_args(argv)
    if args.smoke:
        args.agents, args.rates, args.concurrency = 20, [100.0], 8
        args.duration, args.warmup = 1.5, 0.5
        args.log_lines = args.log_lines or 5  # the logs path runs in the smoke too
    print(
        f"heartbeats: {args.agents} agents, 8 GPUs + 2 instances each, "
        f"{args.duration:.0f} s per phase, {args.log_lines} log lines per heartbeat "
        "(goal >= 500 hb/s, p99 < 100 ms)"
    )
    for backend in args.backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="dctl-bench-db-") as tmp:
                phases = bench_backend("sqlite", f"sqlite:///{tmp}/bench.db", args)
        elif backend == "postgres":
            with throwaway_postgres() as url:
                if url is None:
                    print("postgres   skipped: nothing answers on 127.0.0.1:5432")
                    continue
                phases = bench_backend("postgres", url, args)
        else:
            parser.error(f"unknown backend {backend!r}: use sqlite and/or postgres")
        for phase in phases:
            print(phase.line(backend), flush=True)


if __name__ == "__main__":
    main()
