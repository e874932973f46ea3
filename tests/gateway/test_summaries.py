"""What the traffic reports carry of single requests and client tokens: summaries sampled above
`summary_sample_rps` (errors always kept, never more than a report holds), every request counted
per token and deployment, refusals counted per token and reason; all of it kept for the next
report when a post fails."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta

from client.errors import ClientError
from gateway.errors import Refusal
from gateway.summaries import MAX_REFUSALS, RequestsSeen
from gateway.traffic import TrafficReporter, TrafficWindows
from protocol.gateway import TrafficReport
from protocol.logs import MAX_REQUESTS_PER_REPORT, RequestSummary, TokenUsage
from tests.clock import START, FakeClock
from tests.gateway.conftest import Sink


def summary(
    n: int, status: int = 200, token: str = "app", deployment: str = "chat"
) -> RequestSummary:
    return RequestSummary(
        request_id=f"r{n}", time=START + timedelta(milliseconds=n), token=token,
        deployment=deployment, status=status, latency_s=0.1,
    )  # fmt: skip


def seen_over(clock: FakeClock, sample_rps: float = 20.0) -> RequestsSeen:
    return RequestsSeen(sample_rps, clock.monotonic, random.Random(7))


def test_below_the_rate_every_summary_goes_in_time_order() -> None:
    clock = FakeClock()
    seen = seen_over(clock)
    for n in reversed(range(100)):  # 100 in 5 s: exactly 20/s
        seen.served(summary(n))
    clock.advance(5)
    taken = seen.take()
    assert [s.request_id for s in taken.requests] == [f"r{n}" for n in range(100)]
    assert not seen.take()  # the next interval starts empty


def test_above_the_rate_a_uniform_sample_goes_and_every_error_with_it() -> None:
    clock = FakeClock()
    seen = seen_over(clock)
    for n in range(2000):
        seen.served(summary(n, status=503 if n % 50 == 0 else 200))
    clock.advance(5)
    requests = seen.take().requests
    errors = [s for s in requests if s.status >= 500]
    assert len(errors) == 40  # all of them
    ok = [int(s.request_id[1:]) for s in requests if s.status < 500]
    assert len(ok) == 100  # 20/s over 5 s
    # Uniform over the interval, not the first or last ones.
    assert 25 <= sum(n < 1000 for n in ok) <= 75


def test_a_report_never_carries_more_than_its_limit_and_errors_come_first() -> None:
    clock = FakeClock()
    seen = seen_over(clock, sample_rps=10_000)
    for n in range(MAX_REQUESTS_PER_REPORT + 300):
        seen.served(summary(n, status=500))
    for n in range(500):
        seen.served(summary(10_000 + n))
    clock.advance(5)
    requests = seen.take().requests
    assert len(requests) == MAX_REQUESTS_PER_REPORT
    assert all(s.status == 500 for s in requests)
    # At 0/s only the errors go.
    only_errors = seen_over(clock, sample_rps=0)
    only_errors.served(summary(1))
    only_errors.served(summary(2, status=502))
    clock.advance(5)
    assert [s.request_id for s in only_errors.take().requests] == ["r2"]


def test_token_usage_counts_every_request_sampled_or_not() -> None:
    clock = FakeClock()
    seen = seen_over(clock, sample_rps=1)
    for n in range(1000):
        seen.served(summary(n, status=503 if n < 30 else 429 if n < 40 else 200))
    seen.served(summary(2000, token="other", deployment="code"))
    clock.advance(1)
    taken = seen.take()
    assert len(taken.requests) == 31  # the 30 errors and one more
    assert sorted(taken.usage, key=lambda u: u.token) == [
        TokenUsage(token="app", deployment="chat", requests=1000, errors=30, rate_limited=10),
        TokenUsage(token="other", deployment="code", requests=1, errors=0, rate_limited=0),
    ]


def test_refusals_are_counted_per_token_and_reason_within_the_reports_bound() -> None:
    seen = seen_over(FakeClock())
    seen.refused(Refusal("app", "aaaaaaaaaaaa", "rate_limited"))
    seen.refused(Refusal("app", "aaaaaaaaaaaa", "rate_limited"))
    seen.refused(Refusal("app", "aaaaaaaaaaaa", "forbidden"))
    seen.refused(Refusal("", "", "unknown"))
    counted = {(r.token, r.reason): r.count for r in seen.take().refusals}
    assert counted == {("app", "rate_limited"): 2, ("app", "forbidden"): 1, ("", "unknown"): 1}
    # Someone spraying made-up key ids: the count stays whole, the list bounded.
    for n in range(3000):
        seen.refused(Refusal("", f"{n:012d}", "unknown"))
    refusals = seen.take().refusals
    assert len(refusals) <= MAX_REFUSALS
    assert sum(r.count for r in refusals) == 3000
    assert any(r.key_id == "" and r.count > 1 for r in refusals)  # the rest, by reason alone
    TrafficReport(gateway="gw", started_at=START, ended_at=START, refusals=refusals)  # fits


def test_the_report_carries_requests_refusals_and_usage_and_keeps_them_when_it_fails() -> None:
    clock = FakeClock()
    seen = seen_over(clock)
    sink = Sink()
    reporter = TrafficReporter(
        TrafficWindows(clock), sink, gateway_id="gw", address=None, port=None, interval_s=5,
        seen=seen,
    )  # fmt: skip
    seen.served(summary(1))
    seen.refused(Refusal("app", "aaaaaaaaaaaa", "expired"))
    sink.fail_with = ClientError("control plane at http://cp did not answer in time")
    clock.advance(5)
    assert not asyncio.run(reporter.report_once())
    seen.served(summary(2, status=500))
    seen.refused(Refusal("app", "aaaaaaaaaaaa", "expired"))
    sink.fail_with = None
    clock.advance(5)
    assert asyncio.run(reporter.report_once())  # no traffic window: sent all the same
    (report,) = sink.reports
    assert report.windows == []
    assert [s.request_id for s in report.requests] == ["r1", "r2"]
    assert [(r.token, r.reason, r.count) for r in report.refusals] == [("app", "expired", 2)]
    assert [(u.requests, u.errors) for u in report.usage] == [(2, 1)]
    # A report the control plane refuses for good is not kept.
    seen.served(summary(3))
    sink.fail_with = ClientError("invalid report", status=422)
    assert not asyncio.run(reporter.report_once())
    assert not seen.take()
