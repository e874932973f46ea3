"""The Vector and Promtail configs in monitoring/logs: every field they read is one the gateway's
request log (`protocol.logs.RequestSummary`) or the engines' log format (`runtime.logs`) writes,
so renaming a field breaks this test rather than an operator's dashboards; request_id is never a
label; the paths match where the agent writes engine logs.

Neither binary installs here (no Debian package, no wheel): the files are checked by parsing
them, not by running Vector or Promtail.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from agent.supervisor import Supervisor
from protocol.logs import RequestSummary
from runtime.logs import JsonFormatter, KeyValueFormatter
from tests.observability.conftest import ROOT

LOGS_DIR = ROOT / "monitoring" / "logs"
REQUEST_FIELDS = set(RequestSummary.model_fields)
# Labels per request stream: a handful of values each (deployments, two pools, status classes).
REQUEST_LABELS = {"deployment", "pool", "status_class"}
# What a config derives itself (not read from a line), and what Vector sets on every event.
DERIVED = {"status_class", "instance"}
VECTOR_OWN = {"message", "timestamp", "file"}


def engine_log_fields() -> set[str]:
    """The keys of an engine's log line with a request id, in both formats `runtime.logs` writes."""
    record = logging.makeLogRecord(
        {"name": "dctl.engine", "levelname": "INFO", "levelno": 20, "msg": "done",
         "request_id": "r-1"}
    )  # fmt: skip
    as_json = set(json.loads(JsonFormatter().format(record)))
    as_kv = {pair.split("=", 1)[0] for pair in KeyValueFormatter().format(record).split(" ")}
    assert as_json == as_kv
    return as_json


def engine_log_path() -> Path:
    """Where the agent writes instance 12's engine log, under data dir /opt/dctl/data (the
    agent's run dir is DATA/agent/run; `log_path` reads only that attribute)."""
    run_dir = SimpleNamespace(run_dir=Path("/opt/dctl/data/agent/run"))
    return Supervisor.log_path(run_dir, 12)  # type: ignore[arg-type]


# --- Promtail -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtail() -> dict[str, Any]:
    return yaml.safe_load((LOGS_DIR / "promtail.yml").read_text())


def job(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in config["scrape_configs"] if j["job_name"] == name)


def stages(job: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every stage of a job's pipeline, those nested in `match` included, as (kind, settings)."""
    found: list[tuple[str, Any]] = []
    pending = list(job["pipeline_stages"])
    while pending:
        [(kind, settings)] = pending.pop(0).items()
        found.append((kind, settings))
        if kind == "match":
            pending.extend(settings["stages"])
    return found


def extracted(job: dict[str, Any]) -> dict[str, set[str]]:
    """Per parsing stage kind, the fields of the line it reads (`name: ""` reads `name`)."""
    read: dict[str, set[str]] = {}
    for kind, settings in stages(job):
        if kind == "json":
            read.setdefault(kind, set()).update(
                (source or name) for name, source in settings["expressions"].items()
            )
        elif kind == "logfmt":
            read.setdefault(kind, set()).update(
                (source or name) for name, source in settings["mapping"].items()
            )
    return read


def used(job: dict[str, Any]) -> set[str]:
    """What the job's stages use of the extracted map: labels, metadata, sources."""
    names: set[str] = set()
    for kind, settings in stages(job):
        if kind in ("labels", "structured_metadata"):
            names.update(settings)
        elif kind in ("timestamp", "template", "regex") and settings.get("source") != "filename":
            names.add(settings["source"])
    return names


def labels_of(job: dict[str, Any]) -> set[str]:
    return {name for kind, settings in stages(job) if kind == "labels" for name in settings}


def test_promtail_reads_only_fields_of_the_request_summary(promtail: dict[str, Any]) -> None:
    requests = job(promtail, "dctl-gateway-requests")
    [read] = extracted(requests).values()
    assert read <= REQUEST_FIELDS, read - REQUEST_FIELDS
    assert used(requests) <= read | DERIVED
    assert labels_of(requests) == REQUEST_LABELS
    metadata = {n for kind, s in stages(requests) if kind == "structured_metadata" for n in s}
    assert metadata == {"request_id"}
    [when] = [s for kind, s in stages(requests) if kind == "timestamp"]
    assert when["source"] == "time"


def test_promtail_status_class_is_the_first_digit() -> None:
    # The regex stage's RE2 expression reads the same in Python's `re`.
    requests = job(yaml.safe_load((LOGS_DIR / "promtail.yml").read_text()), "dctl-gateway-requests")
    [regex] = [s for kind, s in stages(requests) if kind == "regex"]
    found = {status: re.match(regex["expression"], str(status)) for status in (200, 429, 504, 0)}
    classes = {s: m.group("status_class") if m else None for s, m in found.items()}
    assert classes == {200: "2", 429: "4", 504: "5", 0: None}
    [template] = [s for kind, s in stages(requests) if kind == "template"]
    assert template["source"] == "status_class" and "xx" in template["template"]


def test_promtail_reads_the_engine_logs_where_the_agent_writes_them(
    promtail: dict[str, Any],
) -> None:
    engines = job(promtail, "dctl-engines")
    [target] = engines["static_configs"]
    assert fnmatch(str(engine_log_path()), target["labels"]["__path__"])
    [regex] = [s for kind, s in stages(engines) if kind == "regex"]
    assert re.search(regex["expression"], engine_log_path().name)["instance"] == "12"  # type: ignore[index]
    fields = engine_log_fields()
    read = extracted(engines)
    assert set(read) == {"json", "logfmt"}  # both formats an engine may write
    assert read["json"] == read["logfmt"] and read["json"] <= fields, read["json"] - fields
    assert used(engines) <= read["json"] | DERIVED
    assert labels_of(engines) == {"instance", "level"}
    assert "request_id" not in labels_of(engines)


# --- Vector ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vector() -> dict[str, Any]:
    return tomllib.loads((LOGS_DIR / "vector.toml").read_text())


# `.name` at the root of the event (not `fields.name`, not `\.log` in a regex).
ROOT_PATH = re.compile(r"(?<![\w)\]\\])\.([A-Za-z_]\w*)")
TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")


def templates(sink: dict[str, Any]) -> set[str]:
    """The event fields a sink's labels and structured metadata name."""
    values = [*sink.get("labels", {}).values(), *sink.get("structured_metadata", {}).values()]
    return {name for value in values for name in TEMPLATE.findall(value)}


def test_vector_reads_only_fields_of_the_request_summary(vector: dict[str, Any]) -> None:
    remap = vector["transforms"]["dctl_requests"]
    sink = vector["sinks"]["dctl_loki_requests"]
    read = set(ROOT_PATH.findall(remap["source"])) | templates(sink)
    assert read - VECTOR_OWN - DERIVED <= REQUEST_FIELDS, read - VECTOR_OWN - DERIVED
    assert {"status", "time", "deployment", "pool", "request_id"} <= read
    assert ".status_class =" in remap["source"]  # derived here, not read
    assert set(sink["labels"]) - {"job"} == REQUEST_LABELS
    assert set(sink["structured_metadata"]) == {"request_id"}


def test_vector_reads_the_engine_logs_where_the_agent_writes_them(vector: dict[str, Any]) -> None:
    [include] = vector["sources"]["dctl_engine_logs"]["include"]
    assert fnmatch(str(engine_log_path()), include)
    remap = vector["transforms"]["dctl_engines"]["source"]
    assert set(re.findall(r"\bfields\.(\w+)", remap)) <= engine_log_fields()
    assert re.findall(r"\bfound\.(\w+)", remap) == ["instance"]
    assert set(ROOT_PATH.findall(remap)) <= VECTOR_OWN | DERIVED | {"level"}
    sink = vector["sinks"]["dctl_loki_engines"]
    assert set(sink["labels"]) == {"job", "host", "instance", "level"}
    assert templates(sink) == {"instance", "level"}


def test_vector_sources_are_the_files_the_configs_name_and_no_env_interpolation(
    vector: dict[str, Any], promtail: dict[str, Any]
) -> None:
    # Vector 0.57 no longer expands ${VAR}: a config that relied on it would read "${VAR}".
    lines = (LOGS_DIR / "vector.toml").read_text().splitlines()
    assert not [line for line in lines if "${" in line and not line.startswith("#")]
    request_log = job(promtail, "dctl-gateway-requests")["static_configs"][0]["labels"]["__path__"]
    assert vector["sources"]["dctl_gateway_requests"]["include"] == [request_log]
    for sink in vector["sinks"].values():
        assert "request_id" not in sink["labels"]
