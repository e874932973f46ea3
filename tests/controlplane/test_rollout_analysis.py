"""The canary analysis on figures built by hand: what passes, fails, or is too thin to judge."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from controlplane.rollouts.analysis import (
    Interval,
    analyse,
    binomial_tail,
    failing_reason,
    is_starved,
    share_above,
    starved_reason,
)
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S, VersionTraffic
from protocol.rollout_policy import DEFAULT_POLICY

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def buckets(**at: int) -> list[int]:
    """Counts by the bucket that holds a latency given as `s0_3=12` (12 requests at 0.3 s)."""
    out = [0] * BUCKET_COUNT
    for key, count in at.items():
        seconds = float(key[1:].replace("_", "."))
        out[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= seconds)] += count
    return out


def pool(version: str, latency: list[int], errors: int = 0, **extra: Any) -> VersionTraffic:
    n = sum(latency)
    return VersionTraffic(
        version_id=int(version.removeprefix("m:v")), version=version, requests=n,
        errors_5xx=errors, latency_buckets=latency, ttft_buckets=latency,
        error_rate=errors / n if n else None, **extra,
    )  # fmt: skip


def judge(
    stable: VersionTraffic,
    canary: VersionTraffic,
    restarts: int = 0,
    weight: int = 10,
    families: tuple[str | None, str | None] = (None, None),
) -> Any:
    interval = Interval(NOW, NOW, 1, weight, stable, canary, restarts, *families)
    result = analyse(interval, DEFAULT_POLICY)
    return result, {m.metric: m for m in result.metrics}


def test_binomial_tail_matches_the_exact_sum() -> None:
    def exact(n: int, k: int, p: float) -> float:
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))

    for n, k, p in ((46, 5, 0.05), (100, 30, 0.05), (10, 0, 0.3), (20, 20, 0.5)):
        assert binomial_tail(n, k, p) == pytest.approx(exact(n, k, p), rel=1e-9)
    assert binomial_tail(100_000, 6_000, 0.05) < 1e-40  # no overflow on big counts


def test_share_above_interpolates_inside_a_bucket() -> None:
    counts = buckets(s0_3=10)  # all in (0.25, 0.5]
    assert share_above(counts, 0.25) == pytest.approx(1.0)
    assert share_above(counts, 0.375) == pytest.approx(0.5)
    assert share_above(counts, 0.5) == pytest.approx(0.0)


def test_a_slower_canary_fails_but_a_few_slow_requests_do_not() -> None:
    stable = pool("m:v1", buckets(s0_04=600, s0_8=20))
    slow = pool("m:v2", buckets(s0_8=60))
    result, by = judge(stable, slow)
    assert result.verdict == "fail" and by["p95 latency"].verdict == "fail"
    assert "p95 latency" in failing_reason(result)
    # 46 requests of which 4 hit the same host pause as stable's: a noisy p95, not a regression.
    unlucky = pool("m:v2", buckets(s0_04=42, s0_8=4))
    result, by = judge(stable, unlucky)
    assert by["p95 latency"].canary is not None and by["p95 latency"].canary > 0.3
    assert by["p95 latency"].verdict == "pass" and result.verdict == "pass"


def test_error_rate_restarts_and_too_few_requests() -> None:
    stable = pool("m:v1", buckets(s0_04=100))
    result, by = judge(stable, pool("m:v2", buckets(s0_04=40), errors=20))
    assert by["error rate"].verdict == "fail" and result.verdict == "fail"
    result, by = judge(stable, pool("m:v2", buckets(s0_04=40)), restarts=1)
    assert by["canary restarts"].verdict == "fail" and result.verdict == "fail"
    result, _ = judge(stable, pool("m:v2", buckets(s0_04=5)))
    assert result.verdict == "inconclusive"  # 5 < min_requests: never promoted on no data


def test_diffusion_figures_compare_decoding_speed() -> None:
    stable = pool("m:v1", buckets(s0_04=100), steps_per_block=4.0, tokens_per_forward=4.0)
    same = pool("m:v2", buckets(s0_04=40), steps_per_block=4.2, tokens_per_forward=3.8)
    assert judge(stable, same)[0].verdict == "pass"
    slower = pool("m:v2", buckets(s0_04=40), steps_per_block=8.0, tokens_per_forward=2.0)
    result, by = judge(stable, slower)
    assert by["steps per block"].verdict == "fail" and by["tokens per forward"].verdict == "fail"
    missing = pool("m:v2", buckets(s0_04=40))
    result, by = judge(stable, missing)
    assert by["steps per block"].verdict == "inconclusive" and result.verdict == "pass"


def test_diffusion_figures_of_two_families_are_shown_but_not_judged() -> None:
    # SDAR: 2 steps per 4-token block; DiffusionGemma: 8 steps per 16-token canvas. A step of
    # one is not a step of the other: neither figure says the canary decodes worse.
    sdar = pool("m:v1", buckets(s0_04=100), steps_per_block=2.0, tokens_per_forward=1.33)
    gemma = pool("m:v2", buckets(s0_04=40), steps_per_block=8.0, tokens_per_forward=0.44)
    result, by = judge(sdar, gemma, families=("sdar", "diffusion-gemma"))
    assert result.verdict == "pass", failing_reason(result)
    for metric, (stable, canary) in {
        "steps per block": (2.0, 8.0), "tokens per forward": (1.33, 0.44),
    }.items():  # fmt: skip
        row = by[metric]
        assert (row.stable, row.canary, row.verdict) == (stable, canary, "inconclusive")
        assert row.note == (
            "not comparable: sdar vs diffusion-gemma (each family decodes its own way)"
        )
    # What means the same for both families is still judged: errors fail the interval.
    result, by = judge(
        sdar, pool("m:v2", buckets(s0_04=40), errors=20), families=("sdar", "diffusion-gemma")
    )
    assert by["error rate"].verdict == "fail" and result.verdict == "fail"


@pytest.mark.parametrize(
    "families", [("sdar", "sdar"), ("sdar", None), (None, "diffusion-gemma"), (None, None)]
)
def test_diffusion_figures_are_judged_unless_both_families_are_known_to_differ(
    families: tuple[str | None, str | None],
) -> None:
    stable = pool("m:v1", buckets(s0_04=100), steps_per_block=2.0, tokens_per_forward=2.0)
    slower = pool("m:v2", buckets(s0_04=40), steps_per_block=4.0, tokens_per_forward=1.0)
    result, by = judge(stable, slower, families=families)
    assert by["steps per block"].verdict == "fail" and by["tokens per forward"].verdict == "fail"
    assert result.verdict == "fail"


def test_few_canary_requests_fail_only_when_their_errors_already_break_the_limit() -> None:
    stable = pool("m:v1", buckets(s0_04=100))
    # 10 requests, 8 errors: even 20 more successes would leave 8/30 > 1%: a certain failure.
    result, by = judge(stable, pool("m:v2", buckets(s0_04=10), errors=8))
    assert by["error rate"].verdict == "fail" and result.verdict == "fail"
    # 10 requests, 0 errors: too few to say anything.
    result, by = judge(stable, pool("m:v2", buckets(s0_04=10)))
    assert by["error rate"].verdict == "inconclusive" and result.verdict == "inconclusive"


def test_every_row_carries_its_unit() -> None:
    stable = pool("m:v1", buckets(s0_04=100), steps_per_block=4.0, tokens_per_forward=4.0)
    canary = pool("m:v2", buckets(s0_04=40), steps_per_block=4.0, tokens_per_forward=4.0)
    _, by = judge(stable, canary)
    assert {name: m.unit for name, m in by.items()} == {
        "error rate": "ratio",
        "p95 latency": "seconds",
        "p95 TTFT": "seconds",
        "steps per block": "number",
        "tokens per forward": "number",
        "canary restarts": "count",
        "served share": "ratio",
    }


def test_a_canary_served_far_less_than_its_weight_is_starved() -> None:
    # Weight 20, but the gateways ejected it: 14 of 700 requests (2%).
    stable, canary = pool("m:v1", buckets(s0_04=686)), pool("m:v2", buckets(s0_04=14))
    result, by = judge(stable, canary, weight=20)
    assert result.verdict == "starved"
    share = by["served share"]
    assert share.verdict == "starved" and share.canary == pytest.approx(0.02)
    assert share.stable == pytest.approx(0.98) and share.note == "14 of 700 requests"
    reason = starved_reason(result)
    assert "14 of 700 requests (2%) at weight 20%" in reason
    # The same split at its weight is judged as usual.
    fair = pool("m:v2", buckets(s0_04=170))
    result, by = judge(stable, fair, weight=20)
    assert result.verdict == "pass" and by["served share"].verdict == "pass"


def test_errors_that_fail_the_canary_outrank_starved() -> None:
    stable = pool("m:v1", buckets(s0_04=686))
    result, by = judge(stable, pool("m:v2", buckets(s0_04=14), errors=12), weight=20)
    assert by["served share"].verdict == "starved" and result.verdict == "fail"


def test_starved_means_under_half_the_weight_significantly_over_enough_requests() -> None:
    minimum = 30
    # Under half the weight over many requests.
    assert is_starved(990, 10, 5, minimum)  # 1% at weight 5
    # At half the weight or above: not starved, however many requests.
    assert not is_starved(900, 100, 20, minimum)  # 10% at weight 20
    # Too few requests in both pools together to say.
    assert not is_starved(25, 0, 50, minimum)
    # A low weight over few requests: none to the canary happens often by chance (13% here).
    assert not is_starved(200, 0, 1, minimum)
    assert is_starved(2000, 0, 1, minimum)
    # No weight to fall short of (promoting, or a canary at 0).
    assert not is_starved(1000, 0, 100, minimum) and not is_starved(1000, 0, 0, minimum)


@pytest.mark.parametrize(("engines", "named"), [(("dctl", "vllm"), "vllm"),
                                                (("command", "dctl"), "command")])  # fmt: skip
def test_figures_an_engine_does_not_report_are_not_analysed_never_passed(
    engines: tuple[str, str], named: str
) -> None:
    # Rolling from the bundled engine to vLLM (or back from a command engine): the dctl side has
    # diffusion figures, the other none. Not analysed, shown as n/a, and not a pass.
    dctl = {"steps_per_block": 2.0, "tokens_per_forward": 2.0}
    stable = pool("m:v1", buckets(s0_04=100), **(dctl if engines[0] == "dctl" else {}))
    canary = pool("m:v2", buckets(s0_04=40), **(dctl if engines[1] == "dctl" else {}))
    interval = Interval(NOW, NOW, 1, 10, stable, canary, 0, stable_engine=engines[0],
                        canary_engine=engines[1])  # fmt: skip
    result = analyse(interval, DEFAULT_POLICY)
    by = {m.metric: m for m in result.metrics}
    for metric in ("steps per block", "tokens per forward"):
        assert by[metric].verdict == "n/a"
        assert by[metric].note == f"n/a: the {named} engine does not report it"
    # Judged on what every engine has: the gateway's errors and latency.
    assert result.verdict == "pass"
    bad = pool("m:v2", buckets(s0_04=40), errors=20)
    failed = analyse(Interval(NOW, NOW, 1, 10, stable, bad, 0, stable_engine=engines[0],
                              canary_engine=engines[1]), DEFAULT_POLICY)  # fmt: skip
    assert failed.verdict == "fail"
