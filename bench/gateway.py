"""What the gateway costs: through `dctl gateway` vs straight to the upstream, in one run.

Part 1 (the engine): a tiny demo engine (`python -m engine.serve`, one torch thread by default,
see `--engine-threads`) and a gateway in front of it (`dctl gateway --routes-file`, no control
plane needed); c=8 closed-loop streamed completions, alternating direct and gateway rounds;
prints req/s, p50/p99 latency and TTFT of both, the throughput ratio (goal >= 0.95) and the
added p50 latency (goal <= 2 ms).

Part 2 (proxy capacity): a minimal canned OpenAI upstream (raw asyncio, one short completion
per request, a separate process) and a gateway in front; a raw keep-alive HTTP/1.1 load
generator (c=32, non-streaming) measures requests/s through the gateway and p50/p99 added over
hitting the upstream directly. Goal >= 500 req/s with generator, gateway and upstream sharing
this machine's cores (moonshot 800). LiteLLM publishes about 130 req/s per CPU with 12 ms
median overhead; Envoy-class proxies add well under 1 ms.

Medians of `--rounds` rounds. `--smoke`: one short round of each, for the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.demo_checkpoint import create_demo_checkpoint  # noqa: E402

DEPLOYMENT = "bench"
ENGINE_KEY = "bench-engine-key"

CANNED_UPSTREAM = textwrap.dedent(
    """
    import asyncio, sys
    BODY = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"bench",'
            b'"choices":[{"index":0,"text":"hello","finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
    HEAD = (b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n"
            b"content-length: %d\\r\\n\\r\\n")
    RESPONSE = HEAD % len(BODY) + BODY

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buffer = transport, b""

        def data_received(self, data):
            self.buffer += data
            while (end := self.buffer.find(b"\\r\\n\\r\\n")) >= 0:
                length = 0
                for line in self.buffer[:end].lower().split(b"\\r\\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if len(self.buffer) < end + 4 + length:
                    return
                self.buffer = self.buffer[end + 4 + length:]
                self.transport.write(RESPONSE)

    async def main():
        server = await asyncio.get_running_loop().create_server(
            Upstream, "127.0.0.1", int(sys.argv[1]))
        await server.serve_forever()

    asyncio.run(main())
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} not ready in {timeout_s:.0f} s")


def client_token() -> tuple[str, str, str]:
    """A client token as the control plane mints them: (secret, key id, sha256 of the secret)."""
    key_id = secrets.token_hex(6)
    secret = f"dctl_{key_id}_{secrets.token_urlsafe(32)}"
    return secret, key_id, hashlib.sha256(secret.encode()).hexdigest()


def start_gateway(tmp: Path, upstream_port: int, log: Path) -> tuple[subprocess.Popen, str, str]:
    """A gateway serving one deployment whose one stable instance is UPSTREAM_PORT."""
    secret, key_id, digest = client_token()
    routes = {
        "etag": "bench",
        "deployments": [{
            "deployment": DEPLOYMENT, "model_names": [DEPLOYMENT],
            "stable": {"version_id": 1, "version": "bench:v1", "instances": [{
                "id": 1, "host": "local", "address": "127.0.0.1", "port": upstream_port,
                "scheme": "http", "api_key": ENGINE_KEY}]},
        }],
        "clients": [{"key_id": key_id, "name": "bench", "secret_sha256": digest}],
    }  # fmt: skip
    routes_file = tmp / f"routes-{upstream_port}.json"
    routes_file.write_text(json.dumps(routes))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(DCTL_GATEWAY_RATE_LIMIT_RPS="1000000", DCTL_GATEWAY_RATE_LIMIT_BURST="1000000",
               DCTL_GATEWAY_LOG_LEVEL="warning", HOME=str(tmp))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "gateway", "--routes-file", str(routes_file),
         "--port", str(port)],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health/ready", proc, "the gateway", 60)
    return proc, url, secret


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- part 1: a real engine, streamed ------------------------------------------------------------


@dataclass
class Round:
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


async def stream_round(url: str, key: str, concurrency: int, seconds: float, tokens: int) -> Round:
    result = Round()
    body = {"model": DEPLOYMENT, "prompt": "the engine reads a checkpoint", "stream": True,
            "max_tokens": tokens, "seed": 7}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        end = start + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                first = None
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        result.errors += 1
                        continue
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - t0
                result.latencies.append(time.perf_counter() - t0)
                if first is not None:
                    result.ttfts.append(first)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    return result


def engine_part(
    tmp: Path, rounds: int, seconds: float, tokens: int, concurrency: int, engine_threads: int
) -> None:
    checkpoint = create_demo_checkpoint(tmp / "tiny", seed=0, size="tiny")
    port = free_port()
    config = tmp / "engine.yaml"
    config.write_text(json.dumps({
        "service": {"host": "127.0.0.1", "port": port, "api_key": ENGINE_KEY,
                    "max_concurrent_requests": concurrency, "max_queue": 64},
        "model": {"path": str(checkpoint), "served_name": DEPLOYMENT, "dtype": "fp32",
                  "max_seq_len": 512},
        "resources": {"device": "cpu", "threads": engine_threads},
        "logging": {"level": "warning"},
    }))  # fmt: skip
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine.serve", "--config", str(config)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    gateway = None
    try:
        wait_http(f"http://127.0.0.1:{port}/health/ready", engine, "the engine")
        gateway, gw_url, secret = start_gateway(tmp, port, tmp / "gateway-engine.log")
        direct_url = f"http://127.0.0.1:{port}"
        asyncio.run(stream_round(gw_url, secret, concurrency, min(1.0, seconds), tokens))  # warm
        direct: list[Round] = []
        through: list[Round] = []
        for _ in range(rounds):
            direct.append(
                asyncio.run(stream_round(direct_url, ENGINE_KEY, concurrency, seconds, tokens))
            )
            through.append(asyncio.run(
                stream_round(gw_url, secret, concurrency, seconds, tokens)))  # fmt: skip
    finally:
        for proc in (gateway, engine):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)

    def med(results: list[Round], fn: Callable[[Round], float]) -> float:
        return statistics.median(fn(r) for r in results)

    print(f"part 1: tiny engine ({engine_threads} torch thread(s)), c={concurrency}, "
          f"streamed completions of {tokens} tokens, {rounds} x {seconds:.0f} s per path "
          "(medians)")  # fmt: skip
    for name, results in (("direct ", direct), ("gateway", through)):
        print(
            f"  {name} req/s {med(results, lambda r: r.rate):7.2f}  latency p50/p99 "
            f"{med(results, lambda r: pct(r.latencies, 0.5)) * 1e3:7.1f}/"
            f"{med(results, lambda r: pct(r.latencies, 0.99)) * 1e3:7.1f} ms  TTFT p50/p99 "
            f"{med(results, lambda r: pct(r.ttfts, 0.5)) * 1e3:6.1f}/"
            f"{med(results, lambda r: pct(r.ttfts, 0.99)) * 1e3:6.1f} ms  "
            f"errors {sum(r.errors for r in results)}"
        )
    ratio = med(through, lambda r: r.rate) / med(direct, lambda r: r.rate)
    added = (med(through, lambda r: pct(r.latencies, 0.5))
             - med(direct, lambda r: pct(r.latencies, 0.5))) * 1e3  # fmt: skip
    added_ttft = (med(through, lambda r: pct(r.ttfts, 0.5))
                  - med(direct, lambda r: pct(r.ttfts, 0.5))) * 1e3  # fmt: skip
    print(f"  throughput ratio gateway/direct {ratio:.3f} (goal >= 0.95); added p50 latency "
          f"{added:+.2f} ms (goal <= 2 ms); added p50 TTFT {added_ttft:+.2f} ms")  # fmt: skip


# --- part 2: proxy capacity with a canned upstream ------------------------------------------------


async def raw_load(port: int, key: str, concurrency: int, seconds: float) -> tuple[float, list]:
    """Closed-loop keep-alive HTTP/1.1 clients with the least client overhead Python allows."""
    payload = json.dumps({"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: "
        + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )  # fmt: skip
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not head.startswith(b"HTTP/1.1 200"):
                    errors += 1
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{errors} requests failed")
    return len(latencies) / elapsed, latencies


def proxy_part(tmp: Path, rounds: int, seconds: float, concurrency: int) -> None:
    upstream_port = free_port()
    script = tmp / "canned_upstream.py"
    script.write_text(CANNED_UPSTREAM)
    upstream = subprocess.Popen([sys.executable, str(script), str(upstream_port)])
    gateway = None
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", upstream_port)) == 0:
                    break
            time.sleep(0.05)
        gateway, gw_url, secret = start_gateway(tmp, upstream_port, tmp / "gateway-proxy.log")
        gw_port = int(gw_url.rsplit(":", 1)[1])
        asyncio.run(raw_load(gw_port, secret, concurrency, min(1.0, seconds)))  # warm-up
        direct, through, light_direct, light_through = [], [], [], []
        for _ in range(rounds):
            direct.append(asyncio.run(raw_load(upstream_port, secret, concurrency, seconds)))
            through.append(asyncio.run(raw_load(gw_port, secret, concurrency, seconds)))
            # One client at a time: the proxy's own cost, without queueing behind other requests.
            light_direct.append(asyncio.run(raw_load(upstream_port, secret, 1, seconds / 2)))
            light_through.append(asyncio.run(raw_load(gw_port, secret, 1, seconds / 2)))
    finally:
        for proc in (gateway, upstream):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    rate = statistics.median(r for r, _ in through)
    p50 = statistics.median(pct(lat, 0.5) for _, lat in through) * 1e3
    p99 = statistics.median(pct(lat, 0.99) for _, lat in through) * 1e3
    d50 = statistics.median(pct(lat, 0.5) for _, lat in direct) * 1e3
    d99 = statistics.median(pct(lat, 0.99) for _, lat in direct) * 1e3
    print(f"part 2: canned upstream, c={concurrency}, non-streaming, {rounds} x {seconds:.0f} s "
          "(medians)")  # fmt: skip
    print(f"  direct  req/s {statistics.median(r for r, _ in direct):8.0f}  p50/p99 "
          f"{d50:6.2f}/{d99:6.2f} ms")  # fmt: skip
    print(f"  gateway req/s {rate:8.0f}  p50/p99 {p50:6.2f}/{p99:6.2f} ms  added p50/p99 "
          f"{p50 - d50:+.2f}/{p99 - d99:+.2f} ms  (goal >= 500 req/s, moonshot 800)")  # fmt: skip
    l50 = statistics.median(pct(lat, 0.5) for _, lat in light_through) * 1e3
    l99 = statistics.median(pct(lat, 0.99) for _, lat in light_through) * 1e3
    ld50 = statistics.median(pct(lat, 0.5) for _, lat in light_direct) * 1e3
    ld99 = statistics.median(pct(lat, 0.99) for _, lat in light_direct) * 1e3
    print(f"  c=1: direct p50/p99 {ld50:.2f}/{ld99:.2f} ms, gateway {l50:.2f}/{l99:.2f} ms: "
          f"added p50/p99 {l50 - ld50:+.2f}/{l99 - ld99:+.2f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="one short round of each part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per round and path")
    parser.add_argument("--tokens", type=int, default=32, help="streamed tokens per request")
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of the CPU engine; 1 leaves a core to the gateway and the load "
        "generator, as a GPU engine would (with every core, torch's parallel matmuls stall "
        "whenever the gateway runs, and part 1 measures that contention, not the proxy)",
    )
    args = parser.parse_args(argv)
    rounds, seconds = (1, 1.0) if args.smoke else (args.rounds, args.seconds)
    tokens = 8 if args.smoke else args.tokens
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proxy_part(tmp, rounds, seconds, 32)
        engine_part(tmp, rounds, seconds, tokens, 8, args.engine_threads)


if __name__ == "__main__":
    main()
