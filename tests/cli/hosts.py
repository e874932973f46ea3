"""A host registered with a real `dctl server` the way its agent does, for tests that need GPUs
to deploy on (the CLI's own tests and `dctl tune --apply`'s)."""

from __future__ import annotations

import json

import httpx

from protocol.wire import HEARTBEAT_PATH, REGISTER_PATH, GpuStatus, Heartbeat, RegisterRequest
from tests.cli.conftest import Dctl, Server


def register_host(server: Server, dctl: Dctl, name: str, gpus: int = 2) -> str:
    """Register a host the way an agent does and send one heartbeat; returns its agent token."""
    created = dctl("token", "create", f"boot-{name}", "--role", "bootstrap", "--json")
    assert created.code == 0, (created.code, created.stdout, created.stderr)
    boot = json.loads(created.stdout)
    reply = httpx.post(
        server.url + REGISTER_PATH,
        json=RegisterRequest(name=name, labels={"zone": "a"}).model_dump(mode="json"),
        headers={"Authorization": f"Bearer {boot['secret']}"},
    )
    assert reply.status_code == 200, reply.text
    agent_token = str(reply.json()["agent_token"])
    beat = Heartbeat(
        gpus=[
            GpuStatus(index=i, uuid=f"GPU-{name}-{i}", name="H100", memory_total_bytes=80 << 30)
            for i in range(gpus)
        ]
    )
    hb = httpx.post(
        server.url + HEARTBEAT_PATH,
        json=beat.model_dump(mode="json"),
        headers={"Authorization": f"Bearer {agent_token}"},
    )
    assert hb.status_code == 200, hb.text
    return agent_token
