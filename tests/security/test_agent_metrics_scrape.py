"""Threat: an engine (or whatever listens on its port) sends an endless or huge `/metrics` body.

The agent scrapes every ready engine's `/metrics` each heartbeat. Without a cap, a broken or
hostile listener streaming an endless page would grow the agent's memory until it is killed,
taking supervision of every engine with it. The scrape reads at most `METRICS_BODY_LIMIT` bytes
(sized well above a 64-layer x 256-expert page); a larger body drops that scrape (no metrics,
one warning), and the next scrape tries again. Real servers on loopback, real scrapes.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.engine_metrics import parse_metrics
from agent.engine_process import METRICS_BODY_LIMIT, HttpMetricsScraper
from engine.metrics import ExpertTokenCollector
from tests.agent.loopback import Answer, LoopbackServer, Seen, endless

MIB = 1 << 20


def expert_page(layers: int = 64, experts: int = 256) -> bytes:
    """The engine's own `dllm_expert_tokens_total{layer,expert}` page, with large counts."""
    registry = CollectorRegistry()
    collector = ExpertTokenCollector()
    registry.register(collector)
    collector.update([[123_456_789] * experts for _ in range(layers)])
    return (
        generate_latest(registry) + b"# TYPE dllm_requests_running gauge\ndllm_requests_running 3\n"
    )


def test_the_cap_is_comfortably_above_a_64_layer_256_expert_page() -> None:
    assert len(expert_page()) * 3 < METRICS_BODY_LIMIT


@pytest.mark.parametrize("announce", [False, True], ids=["close-delimited", "huge-length"])
def test_an_endless_metrics_body_is_dropped_quickly_with_bounded_memory(
    announce: bool, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Content-Length": str(1 << 40)} if announce else {}

    def route(seen: Seen) -> Answer:
        return 200, headers, endless(b"dllm_x_total 1\n" * 4096, stop=server.stop)

    with LoopbackServer(route) as server:
        scraper = HttpMetricsScraper(timeout_s=5.0)
        results: list[str | None] = []
        tracemalloc.start()
        try:
            for _ in range(3):  # every scrape tries again; each is dropped
                started = time.monotonic()
                results.append(scraper("127.0.0.1", server.port))
                assert time.monotonic() - started < 1.0
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        scraper.close()
        assert len(server.seen) == 3
        assert server.bytes_sent < 3 * (METRICS_BODY_LIMIT + 16 * MIB)
    assert results == [None, None, None]
    assert peak < 3 * METRICS_BODY_LIMIT  # the cap (plus slack), not the stream
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/metrics body is over" in warnings[0].getMessage()


def test_a_large_legitimate_page_is_scraped_and_an_engine_can_recover() -> None:
    page = expert_page()
    endless_now = threading.Event()
    endless_now.set()

    def route(seen: Seen) -> Answer:
        if endless_now.is_set():
            return 200, {}, endless(stop=server.stop)
        return 200, {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}, page

    with LoopbackServer(route) as server:
        scraper = HttpMetricsScraper(timeout_s=5.0)
        assert scraper("127.0.0.1", server.port) is None
        endless_now.clear()
        text = scraper("127.0.0.1", server.port)
        scraper.close()
    assert text is not None and len(text) == len(page)
    assert parse_metrics(text).gauges["dllm_requests_running"] == 3


def test_a_trickling_metrics_body_is_dropped_at_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def trickle(stop: threading.Event) -> Iterator[bytes]:
        """One byte every 0.1 s, forever: each read is quick, the scrape never ends."""
        while not stop.is_set():
            yield b"x"
            time.sleep(0.1)

    def route(seen: Seen) -> Answer:
        return 200, {}, trickle(server.stop)

    with LoopbackServer(route) as server:
        scraper = HttpMetricsScraper(timeout_s=1.0, deadline_s=1.5)
        results: list[str | None] = []
        for _ in range(2):  # dropped each time, warned once
            started = time.monotonic()
            results.append(scraper("127.0.0.1", server.port))
            assert time.monotonic() - started < 1.5 + 1.0
        scraper.close()
    assert results == [None, None]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/metrics took over 1.5s" in warnings[0].getMessage()


def test_the_default_deadline_is_twice_the_read_timeout() -> None:
    ticks = iter([0.0, 0.5, 3.9, 4.1])

    def route(seen: Seen) -> Answer:
        return 200, {}, endless(b"y" * 1024, stop=server.stop)

    with LoopbackServer(route) as server:
        scraper = HttpMetricsScraper(timeout_s=2.0, clock=lambda: next(ticks))
        assert scraper("127.0.0.1", server.port) is None  # dropped on the fourth tick: 4.1 > 4.0
        scraper.close()
    assert next(ticks, None) is None
