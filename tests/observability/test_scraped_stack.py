"""Every PromQL expression we ship, evaluated by a real Prometheus over a real scraped stack.

An expression that evaluates but returns nothing is as broken as one that errors (a typo in a
metric or label name reads as "all quiet"), so dashboard queries must return series and every
metric selector in an alert rule must match series, except where this stack cannot produce
them: `MAY_BE_EMPTY` says which and why.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from monitoring.grafana.dctl_dashboard import DASHBOARD
from tests.agent_e2e.conftest import wait_for
from tests.observability.conftest import PROMETHEUS_DIR, ObservedStack

# The session stack's start-up counts against the first test that asks for it: about 30 s on
# an idle 2-core machine, 260 s once while a CPU-bound job held both cores.
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
DENOISE = "dllm_denoise_step_seconds"
# What a Grafana dashboard variable stands for when "All" is picked, and a rate window that
# covers this stack's whole life.
SUBSTITUTIONS = {f"${v.name}": v.all_value for v in DASHBOARD.variables} | {
    "$__rate_interval": "1m"
}
MAY_BE_EMPTY = {
    "offset 1h": "compares with an hour ago; this Prometheus has a minute of history",
    "dctl_gateway_retries_total": "no request needed a second instance",
    "dctl_gateway_ejections_total": "no instance was ejected",
    'code=~"5.."': "a healthy stack answers no 5xx",
    'code="504"': "no request timed out",
    'state=~"not_ready|unreachable"': "every host of a healthy stack is ready",
}
# The engine's denoising-step histogram comes with issue 16's discovery half; until
# engine/metrics.py defines it its queries may be empty, and from then on they must not be.
if DENOISE not in (ROOT / "engine" / "metrics.py").read_text():
    MAY_BE_EMPTY[DENOISE] = "engine/metrics.py does not define it yet"
# A metric selector: one of our names (or `up`) with its label matchers, if any.
SELECTOR = re.compile(r"(?<![\w:])((?:dllm|dctl)_\w+|up)(?![\w(])(\{[^}]*\})?")
GROUPING = re.compile(r"\b(?:by|on|ignoring)\s*\(([^)]*)\)")


def may_be_empty(expr: str) -> str | None:
    """Why EXPR may return no series on this stack, or None when it must return some."""
    return next((why for key, why in MAY_BE_EMPTY.items() if key in expr), None)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, expression with the variables substituted) of every target."""
    found = []
    for panel in DASHBOARD.panels():
        for target in panel.targets:
            expr = target.expr
            for variable, value in SUBSTITUTIONS.items():
                expr = expr.replace(variable, value)
            found.append((panel.title, target.legend, expr))
    return found


def alert_rules() -> list[tuple[str, str]]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [(r["alert"], r["expr"]) for g in groups for r in g["rules"] if "alert" in r]


def test_every_reason_to_be_empty_still_applies_to_some_expression() -> None:
    exprs = [e for _, _, e in dashboard_queries()] + [e for _, e in alert_rules()]
    for key in MAY_BE_EMPTY:
        assert any(key in e for e in exprs), f"MAY_BE_EMPTY[{key!r}] matches nothing: drop it"


def test_every_target_is_scraped(observed: ObservedStack) -> None:
    up = observed.prometheus.query("up")
    assert {s["metric"]["role"] for s in up} == {"controlplane", "agent", "engine", "gateway"}
    assert all(s["value"][1] == "1" for s in up), up


def test_each_hosts_heartbeat_age_is_scraped_by_name(observed: ObservedStack) -> None:
    # What DctlHostHeartbeatLost selects once a host goes quiet (empty while all are ready).
    ages = observed.prometheus.query("dctl_host_heartbeat_age_seconds")
    assert ages and all(s["metric"]["state"] == "ready" and s["metric"]["host"] for s in ages)


def test_the_gateways_series_keep_their_own_version_label(observed: ObservedStack) -> None:
    # The MODEL:VERSION each request was for, not renamed to `exported_version` by a target label.
    series = observed.prometheus.query('dctl_gateway_requests_total{code="200"}')
    assert {s["metric"]["version"] for s in series} == {"demo:v1"}
    assert {s["metric"]["deployment"] for s in series} == {"demo"}


@pytest.mark.parametrize(
    ("title", "legend", "expr"), dashboard_queries(), ids=lambda v: str(v)[:40]
)
def test_every_dashboard_query_returns_series_with_its_legend_labels(
    observed: ObservedStack, title: str, legend: str, expr: str
) -> None:
    series = observed.prometheus.query(expr)
    why = may_be_empty(expr)
    if why is not None and not series:
        return  # it evaluated (`query` raises otherwise); empty here because of `why`
    assert series, f"{title}: no series for {expr}"
    labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    present = {name for s in series for name in s["metric"]}
    assert labels <= present, f"{title}: legend {legend!r} but the series have {present}"


@pytest.mark.parametrize(("alert", "expr"), alert_rules(), ids=lambda v: str(v)[:40])
def test_every_alert_evaluates_and_its_selectors_match_series(
    observed: ObservedStack, alert: str, expr: str
) -> None:
    observed.prometheus.query(expr)  # raises on any error
    selectors = [m.group(0) for m in SELECTOR.finditer(expr)]
    assert selectors, f"{alert}: no metric in {expr}"
    present: set[str] = set()
    for selector in selectors:
        series = observed.prometheus.query(selector)
        assert series or may_be_empty(selector), f"{alert}: no series for {selector}"
        if not series:  # empty for a stated reason: its labels, from the metric unfiltered
            series = observed.prometheus.query(selector.split("{")[0])
        present |= {name for s in series for name in s["metric"]}
    # A misspelt label in `by (...)` or `on (...)` groups everything into one series, quietly.
    grouped = {
        label.strip()
        for clause in GROUPING.findall(expr)
        for label in clause.split(",")
        if label.strip()
    }
    assert grouped - {"le"} <= present, f"{alert}: groups by labels no series has"


def test_prometheus_evaluates_every_shipped_rule_without_error(observed: ObservedStack) -> None:
    def evaluated() -> dict[str, tuple[str, str]] | None:
        groups = observed.prometheus.api("rules")["groups"]
        health = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups
                  for r in g["rules"]}  # fmt: skip
        return health if all(h != "unknown" for h, _ in health.values()) else None

    found = wait_for("every rule evaluated", evaluated, 30)
    assert set(found) == {name for name, _ in alert_rules()}
    assert all(v == ("ok", "") for v in found.values()), found
