"""Traffic windows: counts and buckets, the swap for a report, and the merge back on failure."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from client.errors import ClientError
from gateway.traffic import (
    MAX_WINDOWS,
    TrafficReporter,
    TrafficWindows,
    WindowKey,
    bucket_index,
)
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S
from tests.clock import FakeClock
from tests.gateway.conftest import Sink

KEY: WindowKey = ("chat", 1, "stable")
CANARY: WindowKey = ("chat", 2, "canary")


def test_bucket_bounds_are_inclusive_and_the_last_bucket_takes_the_rest() -> None:
    assert bucket_index(0.0) == 0
    assert bucket_index(LATENCY_BUCKETS_S[0]) == 0
    assert bucket_index(LATENCY_BUCKETS_S[0] + 1e-9) == 1
    assert bucket_index(0.3) == LATENCY_BUCKETS_S.index(0.5)
    assert bucket_index(1e6) == BUCKET_COUNT - 1


def test_windows_count_requests_errors_buckets_and_tokens() -> None:
    windows = TrafficWindows(FakeClock())
    windows.record(KEY, None, 0.3, 0.02, 12)
    windows.record(KEY, "5xx", 0.004, 0.004, 0)
    windows.record(KEY, "timeout", 700.0, None, 0)
    windows.record(KEY, "connect", 0.001, None, 0)
    windows.record(KEY, "client_4xx", 0.002, 0.002, 0)
    windows.record(CANARY, None, 1.5, 0.2, 3)
    counts = windows.peek(KEY)
    assert counts is not None
    assert (counts.requests, counts.errors_5xx, counts.errors_timeout, counts.errors_connect,
            counts.client_4xx, counts.output_tokens) == (5, 1, 1, 1, 1, 12)  # fmt: skip
    assert sum(counts.latency_buckets) == 5
    assert counts.latency_buckets[0] == 3  # 4 ms, 1 ms, 2 ms
    assert counts.latency_buckets[-1] == 1  # 700 s
    assert sum(counts.ttft_buckets) == 3  # no TTFT without a body byte
    assert counts.latency_sum_s == pytest.approx(700.307)
    assert counts.ttft_sum_s == pytest.approx(0.026)


def test_a_report_carries_the_windows_and_starts_new_ones() -> None:
    clock = FakeClock()
    windows = TrafficWindows(clock)
    sink = Sink()
    reporter = TrafficReporter(
        windows, sink, gateway_id="gw-1", address="10.0.0.9", port=8800, interval_s=5
    )
    windows.record(KEY, None, 0.1, 0.05, 4)
    windows.record(CANARY, "5xx", 0.2, None, 0)
    clock.advance(5)
    assert asyncio.run(reporter.report_once())
    (report,) = sink.reports
    assert (report.gateway, report.address, report.port) == ("gw-1", "10.0.0.9", 8800)
    assert report.ended_at - report.started_at == timedelta(seconds=5)
    by_key = {(w.deployment, w.version_id, w.pool): w for w in report.windows}
    assert by_key[KEY].requests == 1 and by_key[KEY].output_tokens == 4
    assert by_key[CANARY].errors == 1
    assert windows.peek(KEY) is None  # swapped out
    # Nothing served: nothing posted.
    assert asyncio.run(reporter.report_once()) and len(sink.reports) == 1


def test_a_failed_report_is_merged_back_and_sent_with_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    windows = TrafficWindows(clock)
    sink = Sink()
    reporter = TrafficReporter(
        windows, sink, gateway_id="gw", address=None, port=None, interval_s=5
    )
    first_start = clock()
    sink.fail_with = ClientError("control plane at http://cp did not answer in time")
    for _ in range(3):
        windows.record(KEY, None, 0.1, 0.05, 2)
        clock.advance(5)
        assert not asyncio.run(reporter.report_once())
    assert sum("cannot report traffic" in r.message for r in caplog.records) == 1  # once per outage
    sink.fail_with = None
    windows.record(KEY, "5xx", 0.2, None, 0)
    clock.advance(5)
    assert asyncio.run(reporter.report_once())
    (report,) = sink.reports
    assert report.started_at == first_start  # the whole outage in one report
    (window,) = report.windows
    assert (window.requests, window.errors_5xx, window.output_tokens) == (4, 1, 6)
    assert sum(window.latency_buckets) == 4


def test_a_report_the_control_plane_rejects_for_good_is_dropped() -> None:
    windows = TrafficWindows(FakeClock())
    sink = Sink()
    reporter = TrafficReporter(
        windows, sink, gateway_id="gw", address=None, port=None, interval_s=5
    )
    windows.record(KEY, None, 0.1, 0.05, 2)
    sink.fail_with = ClientError("invalid report", status=422)
    assert not asyncio.run(reporter.report_once())
    assert windows.peek(KEY) is None
    sink.fail_with = ClientError("revoked", status=401)  # an operator can fix this one
    windows.record(KEY, None, 0.1, 0.05, 2)
    assert not asyncio.run(reporter.report_once())
    assert windows.peek(KEY) is not None


def test_memory_stays_bounded_by_the_number_of_windows() -> None:
    windows = TrafficWindows(FakeClock())
    for i in range(MAX_WINDOWS + 10):
        windows.record((f"d{i}", 1, "stable"), None, 0.1, None, 0)
    assert windows.dropped == 10
    taken = windows.take()
    assert len(taken.counts) == MAX_WINDOWS
    windows.record(("new", 1, "stable"), None, 0.1, None, 0)
    windows.merge_back(taken)
    assert len(windows.take().counts) == MAX_WINDOWS
