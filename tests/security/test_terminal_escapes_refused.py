"""Threat: an agent (or an operator token) stores strings that later drive an operator's
terminal: escape sequences in labels, host facts, preflight checks, GPU names and instance
messages, which the CLI and the TUI print.

The API refuses control characters (C0 but tab, DEL, C1) in all of them: 422 naming the field,
nothing stored. Registration, heartbeats and the REST bodies that carry labels or reasons are
sent as an attacker sends them, to a real control plane on loopback (SQLite and PostgreSQL).
The agent's own reports, which quote engine logs and exceptions, leave it printable, so an
honest agent is never refused.
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.hostile_terminal import (
    C1_CSI,
    ERASE_LINE,
    HOSTILE,
    OSC_LINK,
    OSC_TITLE,
    SHORT,
)
from tests.security.live_controlplane import LiveControlPlane, V, live

REFUSED = "control character U+"


def assert_refused(reply: httpx.Response, field: str) -> None:
    """422 whose message starts with FIELD and says what to send instead."""
    assert reply.status_code == 422, reply.text
    message = reply.json()["message"]
    assert message.startswith(f"{field}: "), message
    assert REFUSED in message and "printable text" in message, message
    assert "pwned" not in reply.text and "evil" not in reply.text  # never echoed back


def instance(**extra: Any) -> dict[str, Any]:
    return {"instance_id": 1, "state": "failed", **extra}


# (field as the 422 names it, heartbeat body putting the hostile string there)
HEARTBEAT_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("facts.hostname", {"facts": {"hostname": HOSTILE}}),
    ("facts.os", {"facts": {"os": HOSTILE}}),
    ("facts.agent_version", {"facts": {"agent_version": SHORT}}),
    ("facts.driver_version", {"facts": {"driver_version": SHORT}}),
    ("facts.cuda_driver_version", {"facts": {"cuda_driver_version": SHORT}}),
    ("facts.preflight.0.name", {"facts": {"preflight": [{"name": SHORT, "status": "fail"}]}}),
    (
        "facts.preflight.0.reason",
        {"facts": {"preflight": [{"name": "disk", "status": "fail", "reason": HOSTILE}]}},
    ),
    (
        "facts.snapshot_failures.0.error",
        {"facts": {"snapshot_failures": [{"digest": "0" * 64, "error": HOSTILE}]}},
    ),
    ("gpus.0.name", {"gpus": [{"index": 0, "uuid": "GPU-0", "name": HOSTILE}]}),
    ("gpus.0.uuid", {"gpus": [{"index": 0, "uuid": HOSTILE}]}),
    ("instances.0.message", {"instances": [instance(message=HOSTILE)]}),
    ("instances.0.last_exit.reason", {"instances": [instance(last_exit={"reason": HOSTILE})]}),
]


def test_a_heartbeat_carrying_escape_sequences_is_refused_naming_the_field(
    live: LiveControlPlane,
) -> None:
    agent = live.register("gpu-1")
    for field, body in HEARTBEAT_FIELDS:
        assert_refused(live.heartbeat(agent, **body), field)
    host = live.call("GET", f"{V}/hosts/gpu-1", live.admin).json()
    assert "\x1b" not in str(host) and host["gpus"] == [] and host["facts"] is None


def test_every_control_character_is_refused_in_a_label(live: LiveControlPlane) -> None:
    boot = live.token("bootstrap", uses=10)
    for hostile in [OSC_TITLE, ERASE_LINE, OSC_LINK, C1_CSI, "two\nlines", "nul\x00", "del\x7f"]:
        body = {"name": "gpu-1", "labels": {"zone": hostile}}
        assert_refused(live.call("POST", f"{V}/agents/register", boot, json=body), "labels.zone")
    assert live.call("GET", f"{V}/hosts/gpu-1", live.admin).status_code == 404


def test_a_registration_with_hostile_facts_is_refused(live: LiveControlPlane) -> None:
    body = {"name": "gpu-1", "facts": {"hostname": HOSTILE}}
    reply = live.call("POST", f"{V}/agents/register", live.token("bootstrap"), json=body)
    assert_refused(reply, "facts.hostname")


def test_a_tab_and_markup_are_text_and_taken(live: LiveControlPlane) -> None:
    # Markup is harmless as data: the printers show it as text (see the pty tests).
    labels = {"zone": "a\tb", "note": "[bold red]x[/]"}
    body = {"name": "gpu-1", "labels": labels}
    reply = live.call("POST", f"{V}/agents/register", live.token("bootstrap"), json=body)
    assert reply.status_code == 200, reply.text
    agent = reply.json()["agent_token"]
    gpu = {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3"}
    assert live.heartbeat(agent, gpus=[gpu], facts={"os": "Linux\t6.1"}).status_code == 200


def test_operator_bodies_with_escape_sequences_are_refused(live: LiveControlPlane) -> None:
    live.register("gpu-1")
    admin = live.admin
    deployment = {"name": "web", "model": "demo", "version": "v1",
                  "placement": {"labels": {"zone": OSC_TITLE}}}  # fmt: skip
    assert_refused(
        live.call("POST", f"{V}/deployments", admin, json=deployment), "placement.labels.zone"
    )
    change = {"labels": {"zone": ERASE_LINE}}
    assert_refused(live.call("PATCH", f"{V}/hosts/gpu-1/labels", admin, json=change), "labels.zone")
    token = {"name": "boot", "role": "bootstrap", "labels": {"zone": OSC_LINK}}
    assert_refused(live.call("POST", f"{V}/tokens", admin, json=token), "labels.zone")
    rollout = {"to": "v2", "reason": OSC_TITLE}
    assert_refused(live.call("POST", f"{V}/deployments/web/rollout", admin, json=rollout), "reason")


# --- the agent's own reports stay printable ---------------------------------------------------


def test_an_engine_log_with_colours_and_carriage_returns_makes_a_valid_exit_reason(
    tmp_path: Path,
) -> None:
    from agent.supervised_instance import exit_info
    from protocol.wire import Heartbeat

    log = tmp_path / "instance-1.log"
    log.write_text("loading 10%\r20%\r\x1b[31mCUDA error: out of memory\x1b[0m\nTraceback\n")
    died = exit_info(log, 1, "exited with code 1")
    # Line breaks (\r too) join as ' | ', the colours go: what the control plane takes.
    assert died.reason == (
        "exited with code 1; log: loading 10% | 20% | CUDA error: out of memory | Traceback"
    )
    beat = Heartbeat.model_validate_json(
        Heartbeat(instances=[instance(last_exit=died.model_dump(mode="json"))]).model_dump_json()
    )
    assert beat.instances[0].last_exit == died
