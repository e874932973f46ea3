"""Load test of the engine server on loopback, and its HTTP overhead against in-process decoding.

Starts `python -m engine.serve` on a free port with a demo checkpoint, then for each concurrency
level runs N async httpx clients in a closed loop for a fixed duration, every request a streamed
completion (so time to first token is observed). Prints requests/s, generated tokens/s and
p50/p95/p99 of latency and TTFT. Finally decodes the same prompts in-process with
`LLM.generate` (one batch of 32, the same parameters) and prints the HTTP/in-process ratio of
tokens/s at concurrency 32 — the issue's goal is >= 0.8.

Random demo weights: text is noise and lengths vary as EOS is drawn; both paths see the same.
`--smoke` uses the tiny checkpoint and a second per level, for the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.demo_checkpoint import create_demo_checkpoint  # noqa: E402

MODEL = "bench"
CORPUS = (
    "the engine reads a checkpoint and serves many requests in blocks of tokens "
    "while operators watch the metrics and the queue stays short"
)
WORDS = CORPUS.split(" ")


def prompts(n: int, length: int) -> list[str]:
    """n different prompts of about `length` words."""
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(length)) for i in range(n)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LevelResult:
    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0

    def line(self) -> str:
        def pct(values: list[float], q: float) -> float:
            if not values:
                return float("nan")
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

        n = len(self.latencies)
        return (
            f"c={self.concurrency:<3} req/s {n / self.seconds:7.2f}  tok/s "
            f"{self.tokens / self.seconds:8.1f}  latency p50/p95/p99 "
            f"{pct(self.latencies, 0.5):7.0f}/{pct(self.latencies, 0.95):7.0f}/"
            f"{pct(self.latencies, 0.99):7.0f} ms  TTFT p50/p95/p99 {pct(self.ttfts, 0.5):6.0f}/"
            f"{pct(self.ttfts, 0.95):6.0f}/{pct(self.ttfts, 0.99):6.0f} ms  "
            f"requests {n}  errors {self.errors}"
        )


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, knobs: dict, result: LevelResult
) -> None:
    body = {"model": MODEL, "prompt": prompt, "stream": True,
            "stream_options": {"include_usage": True}, **knobs}  # fmt: skip
    start = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.tokens += chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
    result.latencies.append(time.perf_counter() - start)
    if first is not None:
        result.ttfts.append(first)


async def run_level(
    base: str, concurrency: int, seconds: float, texts: list[str], knobs: dict
) -> LevelResult:
    result = LevelResult(concurrency, seconds)
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        end = time.perf_counter() + seconds
        start = time.perf_counter()

        async def worker(i: int) -> None:
            k = i
            while time.perf_counter() < end:
                await one_request(client, url, texts[k % len(texts)], knobs, result)
                k += concurrency

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        # Requests in flight at the deadline finish; count the real elapsed time.
        result.seconds = time.perf_counter() - start
    return result


def start_server(
    checkpoint: Path, port: int, max_batch: int, dtype: str, tmp: Path
) -> subprocess.Popen[bytes]:
    config = tmp / "engine.yaml"
    config.write_text(json.dumps({
        "service": {"host": "127.0.0.1", "port": port, "max_concurrent_requests": max_batch,
                    "max_queue": 256},
        "model": {"path": str(checkpoint), "served_name": MODEL, "dtype": dtype,
                  "max_seq_len": 1024},
        "resources": {"device": "cpu"},
        "logging": {"level": "warning"},
    }))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serve", "--config", str(config)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 180 s")


class InProcess:
    """The same checkpoint and parameters decoded with `LLM.generate` in this process."""

    def __init__(self, checkpoint: Path, knobs: dict, dtype: str, max_batch: int) -> None:
        from engine.llm import LLM
        from engine.params import SamplingParams

        self.llm = LLM(checkpoint, dtype=dtype, max_batch_size=max_batch, max_seq_len=1024)
        self.params = SamplingParams(**knobs)
        self.llm.generate(["warm-up", "run"], self.params)  # like the server's warm-up

    def tokens_per_s(self, texts: list[str]) -> float:
        start = time.perf_counter()
        outputs = self.llm.generate(texts, self.params)
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny model, about a second per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each level")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--checkpoint", help="serve this directory instead of the demo")
    parser.add_argument("--repeats", type=int, default=3, help="HTTP/in-process pairs")
    args = parser.parse_args(argv)
    size = "tiny" if args.smoke else "small"
    levels = [1, 4] if args.smoke else [int(x) for x in args.levels.split(",")]
    seconds = 1.0 if args.smoke else args.seconds
    if args.smoke:
        args.repeats = 1
    max_tokens = 8 if args.smoke else args.max_tokens
    dtype = "fp32" if args.smoke else args.dtype
    max_batch = max(levels)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = (
            Path(args.checkpoint)
            if args.checkpoint
            else create_demo_checkpoint(tmp / "ckpt", size=size)
        )
        block = json.loads((checkpoint / "config.json").read_text()).get("block_size", 4)
        # Steps mode with 4 tokens per step (as the decoding benchmark): lengths do not depend
        # on how confident random weights happen to be.
        knobs = {"max_tokens": max_tokens, "steps": max(1, block // 4)}
        texts = prompts(max(32, max_batch), 24)
        port = free_port()
        print(
            f"engine_serve: {size} demo checkpoint ({dtype}), block {block}, "
            f"steps {knobs['steps']}, max_tokens {max_tokens}, {seconds:g} s per level, "
            f"{os.cpu_count()} CPUs"
        )
        proc = start_server(checkpoint, port, max_batch, dtype, tmp)
        top = max(levels)
        local = InProcess(checkpoint, knobs, dtype, max_batch)
        ratios: list[float] = []
        http_rates: list[float] = []
        local_rates: list[float] = []
        try:
            base = f"http://127.0.0.1:{port}"
            # Unmeasured warm-up at the top concurrency: first batches of each shape are slow.
            asyncio.run(run_level(base, top, min(3.0, seconds / 4), texts, knobs))
            for c in levels:
                result = asyncio.run(run_level(base, c, seconds, texts, knobs))
                print(result.line(), flush=True)
            # The ratio: HTTP at the top concurrency and in-process batches, alternated, so a
            # noisy neighbour on a shared machine hits both sides alike; medians of the pairs.
            for _ in range(args.repeats):
                result = asyncio.run(run_level(base, top, seconds, texts, knobs))
                http_rates.append(result.tokens / result.seconds)
                local_rates.append(local.tokens_per_s(texts[:top]))
                ratios.append(http_rates[-1] / local_rates[-1])
        finally:
            proc.terminate()
            proc.wait(60)
        print(
            f"c={top} over HTTP: median {statistics.median(http_rates):.1f} tok/s; in-process "
            f"LLM.generate batch {top}: median {statistics.median(local_rates):.1f} tok/s "
            f"({args.repeats} alternating pairs)"
        )
        overall = statistics.median(http_rates) / statistics.median(local_rates)
        print(
            f"HTTP / in-process tokens/s: {overall:.2f} (ratio of the medians; per pair "
            f"{', '.join(f'{r:.2f}' for r in ratios)}; goal >= 0.8)"
        )


if __name__ == "__main__":
    main()
