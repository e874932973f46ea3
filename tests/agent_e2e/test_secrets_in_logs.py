"""No secret leaks: drive the real stack with known secrets, then read every log file it wrote and
every API answer a viewer can get. The admin token, the agent's bootstrap token, the agent token
and the engine's API key must appear in none of them.

Runs on the module's shared stack (server, agent and engine processes on loopback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

from protocol.rest import TokenCreate
from tests.agent_e2e.conftest import HOST, Stack

# Values for the path parameters of the viewer-visible routes, by parameter name.
PATH_VALUES = {"name": "demo", "version": "v1", "rollout_id": "1"}


def _secrets(stack: Stack) -> dict[str, str]:
    inst = stack.ready_instance()
    run = stack.agent_data() / "agent" / "run"
    config = yaml.safe_load((run / f"instance-{inst.id}.yaml").read_text())
    agent_token = next(
        p.read_text().strip()
        for p in (stack.agent_data() / "agent").iterdir()
        if p.is_file() and p.read_text().strip().startswith("dctl_")
    )
    found = {
        "admin token": stack.token,
        "bootstrap token": stack.env["DCTL_BOOTSTRAP_TOKEN"],
        "agent token": agent_token,
        "engine API key": config["service"]["api_key"],
    }
    assert all(value and len(value) > 20 for value in found.values()), found.keys()
    return found


def _drive(stack: Stack, key: str, port: int) -> None:
    """What users and attackers do: requests with the right key, a wrong one, CLI listings."""
    engine = f"http://127.0.0.1:{port}/v1"
    ok = httpx.post(
        f"{engine}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    wrong = httpx.get(f"{engine}/models", headers={"Authorization": f"Bearer {key}x"}, timeout=30)
    assert wrong.status_code == 401
    for args in (("status",), ("host", "list"), ("deploy", "show", "demo"), ("events",)):
        stack.dctl(*args)


def _viewer_answers(stack: Stack) -> dict[str, str]:
    """Every GET route of the OpenAPI spec a viewer may call, with its answer's text."""
    viewer = stack.api.create_token(TokenCreate(name="leak-check", role="viewer")).secret
    spec = httpx.get(f"{stack.url}/openapi.json", timeout=30).json()
    answers: dict[str, str] = {}
    with httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {viewer}"}, timeout=30
    ) as http:
        for template, methods in spec["paths"].items():
            if "get" not in methods or template.endswith("/files/{path}"):
                continue  # weight files are the model's bytes, not the API's
            hosts = template.startswith("/api/v1/hosts")
            values = {**PATH_VALUES, "name": HOST} if hosts else PATH_VALUES
            path = re.sub(r"{(\w+)(:\w+)?}", lambda m, v=values: v[m.group(1)], template)
            answer = http.get(path)
            answers[path] = answer.text
    assert any(p.startswith("/api/v1/deployments") for p in answers)
    assert any(p.startswith(f"/api/v1/hosts/{HOST}") for p in answers)
    return answers


def _log_files(stack: Stack) -> list[Path]:
    return [p for p in stack.home.rglob("*.log*") if p.is_file()]


def test_no_secret_appears_in_any_log_or_viewer_answer(stack: Stack) -> None:
    secrets = _secrets(stack)
    inst = stack.ready_instance()
    _drive(stack, secrets["engine API key"], inst.port)
    answers = _viewer_answers(stack)
    logs = _log_files(stack)
    names = {p.name for p in logs}
    assert {"server.log", "agent.log", f"instance-{inst.id}.log"} <= names, names
    leaks = []
    for what, secret in secrets.items():
        for path in logs:
            if secret in path.read_text(errors="replace"):
                leaks.append(f"{what} in {path.relative_to(stack.home)}")
        for route, text in answers.items():
            if secret in text:
                leaks.append(f"{what} in the viewer's answer to {route}")
    assert leaks == []
    # The check can fail: the engine's key is where it belongs, in its 0600 config.
    config = stack.agent_data() / "agent" / "run" / f"instance-{inst.id}.yaml"
    assert secrets["engine API key"] in config.read_text()
    assert config.stat().st_mode & 0o777 == 0o600
    assert json.loads(answers["/api/v1/deployments/demo"])["instances"]
