"""The shipped Prometheus files as promtool sees them, and what every alert must carry."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability.conftest import PROMETHEUS_DIR

ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts_test.yml"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_example_config_is_valid_next_to_a_targets_file(promtool: str, tmp_path: Path) -> None:
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(PROMETHEUS_DIR / name, tmp_path / name)
    (tmp_path / "targets.json").write_text("[]")
    result = run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in alert_rules()} == fired


def test_every_alert_says_how_bad_what_happened_and_which_command_to_run() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        assert rule["alert"].startswith("Dctl"), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= annotations.keys(), rule["alert"]
        assert "dctl " in annotations["runbook"], rule["alert"]
        # The figure that fired it, or what it is about, appears in the message.
        assert "$value" in annotations["summary"] or "$labels" in annotations["summary"]
