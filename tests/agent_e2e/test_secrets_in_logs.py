"""No secret leaks: drive the real stack with known secrets, then read every log file it wrote and
every API answer a viewer can get. The admin token, the agent's bootstrap token, the agent token,
the engine's API key and a rollout webhook's password, path and query string (the server posts
to it twice) must appear in none of them.

Runs on the module's shared stack (server, agent and engine processes on loopback)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from secrets import token_hex

import httpx
import yaml

from protocol.rest import TokenCreate
from tests.agent.loopback import LoopbackServer
from tests.agent_e2e.conftest import HOST, Stack, wait_for
from tests.controlplane.conftest import gpu, manifest

# Values for the path parameters of the viewer-visible routes, by parameter name.
PATH_VALUES = {"name": "demo", "version": "v1"}
# The deployment with the webhook, on a host that only ever sends one heartbeat.
HOOKED, HOOK_HOST = "hooked", "hook-host"


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


def _webhook_secrets() -> dict[str, str]:
    return {f"webhook {part}": f"{part}-{token_hex(12)}" for part in ("password", "path", "query")}


def _roll_out_with_a_webhook(stack: Stack, hook: str, receiver: LoopbackServer) -> int:
    """Deployment HOOKED, its rollout policy's notify URL HOOK set with the CLI, and a rollout of
    it started and aborted: two notifications the server posts. The rollout's id."""
    admin = {"Authorization": f"Bearer {stack.token}"}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for version, seed in (("v1", 1), ("v2", 7)):
            files = manifest("config.json", "model.safetensors", seed=seed)
            body = {"version": version, "source_uri": "/nonexistent", "manifest": files}
            registered = http.post(f"/api/v1/models/{HOOKED}/versions", json=body, headers=admin)
            assert registered.status_code == 201, registered.text
        boot = stack.api.create_token(TokenCreate(name="hook-boot", role="bootstrap", uses=1))
        joined = http.post("/api/v1/agents/register", json={"name": HOOK_HOST},
                           headers={"Authorization": f"Bearer {boot.secret}"})  # fmt: skip
        agent = {"Authorization": f"Bearer {joined.json()['agent_token']}"}
        beat = {"gpus": [gpu(i) for i in range(8)]}
        assert http.post("/api/v1/agents/heartbeat", json=beat, headers=agent).status_code == 200
        body = {"name": HOOKED, "model": HOOKED, "version": "v1",
                "placement": {"hosts": [HOOK_HOST]}, "instances_per_host": 2}  # fmt: skip
        created = http.post("/api/v1/deployments", json=body, headers=admin)
        assert created.status_code == 201, created.text
    policy = stack.home / "hook-policy.yaml"
    policy.write_text(yaml.safe_dump({"notify": hook, "interval_s": 60}))
    stack.dctl("deploy", "configure", HOOKED, "--rollout-policy", str(policy))
    stack.dctl("rollout", HOOKED, "--to", f"{HOOKED}:v2")
    wait_for("the rollout's first notification", lambda: len(receiver.seen) >= 1, 30)
    stack.dctl("rollout", "abort", HOOKED)
    wait_for("the abort's notification", lambda: len(receiver.seen) >= 2, 30)
    return stack.api.get_rollout(HOOKED).id


def _viewer_answers(stack: Stack, rollout: int) -> dict[str, str]:
    """Every GET route of the OpenAPI spec a viewer may call, with its answer's text (the
    deployment routes for both deployments)."""
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
            names = [HOST] if hosts else [PATH_VALUES["name"], HOOKED]
            for name in names:
                values = {**PATH_VALUES, "name": name, "rollout_id": str(rollout)}
                path = re.sub(r"{(\w+)(:\w+)?}", lambda m, v=values: v[m.group(1)], template)
                # A followed log is a stream: one second of it (its lines so far come first).
                query = {"max_s": 1, "after": 0} if template.endswith("/logs/follow") else None
                if path not in answers:
                    answers[path] = http.get(path, params=query).text
    assert any(p.startswith("/api/v1/deployments") for p in answers)
    assert any(p.startswith(f"/api/v1/hosts/{HOST}") for p in answers)
    return answers


def _log_files(stack: Stack) -> list[Path]:
    return [p for p in stack.home.rglob("*.log*") if p.is_file()]


def test_no_secret_appears_in_any_log_or_viewer_answer(stack: Stack) -> None:
    secrets = _secrets(stack)
    inst = stack.ready_instance()
    _drive(stack, secrets["engine API key"], inst.port)
    hook_secrets = _webhook_secrets()
    with LoopbackServer(lambda seen: (204, {}, b"")) as receiver:
        password, path, query = hook_secrets.values()
        hook = f"http://hook-user:{password}@127.0.0.1:{receiver.port}/hook/{path}?sig={query}"
        rollout = _roll_out_with_a_webhook(stack, hook, receiver)
    # The check can fail: the receiver got the password and the query string.
    assert hook_secrets["webhook query"] in receiver.seen[0].path
    assert receiver.seen[0].authorization
    secrets.update(hook_secrets)
    answers = _viewer_answers(stack, rollout)
    assert f"/api/v1/deployments/{HOOKED}/rollouts/{rollout}" in answers
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
