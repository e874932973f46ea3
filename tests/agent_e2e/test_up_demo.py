"""`dctl up --demo`: one command brings up control plane, agent and engine; Ctrl-C stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from client.credentials import CredentialsFile
from tests.agent_e2e.conftest import free_port


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_up_demo_serves_keeps_existing_contexts_and_stops_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "config"
    credentials = config / "dctl" / "credentials"
    credentials.parent.mkdir(parents=True)
    original = 'current = "demo"\n[contexts.demo]\nurl = "http://10.0.0.1:8700"\ntoken = "mine"\n'
    credentials.write_text(original)
    credentials.chmod(0o600)
    data_dir = tmp_path / "demo-data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(config), XDG_DATA_HOME=str(tmp_path))
    port = free_port()
    up = subprocess.Popen(
        # No --size: the trained demo model, as a user gets it.
        [sys.executable, "-m", "cli", "up", "--demo", "--data-dir", str(data_dir),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 420
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert up.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        output = "".join(lines)
        assert "creating the trained demo model" in output
        match = re.search(r"^OpenAI base URL: (http://127\.0\.0\.1:\d+/v1)$", output, re.M)
        assert match, output
        base_url = match.group(1)
        key = re.search(r"^OpenAI API key: (\S+)$", output, re.M)
        assert key, output
        assert f"Authorization: Bearer {key.group(1)}" in output  # the sample curl uses it
        assert key.group(1).startswith("dctl_")  # a client token of the gateway
        refused = httpx.get(f"{base_url}/models", timeout=30)
        assert refused.status_code == 401  # the gateway wants the client token
        reply = httpx.post(
            f"{base_url}/chat/completions",
            headers={"Authorization": f"Bearer {key.group(1)}"},
            json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4},
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-dctl-version"] == "demo:v1"  # it went through the gateway
        engine = re.search(
            r"^Engine, bypassing the gateway: (http://127\.0\.0\.1:\d+/v1) \(API key (\S+)\)$",
            output,
            re.M,
        )
        assert engine and engine.group(1) != base_url, output
        direct = httpx.get(
            f"{engine.group(1)}/models",
            headers={"Authorization": f"Bearer {engine.group(2)}"},
            timeout=30,
        )
        assert direct.status_code == 200 and direct.json()["data"][0]["id"] == "demo"
        assert "dctl status" in output and "dctl tui" in output and "curl " in output
        if os.geteuid() == 0:
            assert output.count("running as root") == 1
        _, contexts = CredentialsFile(credentials).load()
        assert contexts["demo"].url == "http://10.0.0.1:8700"  # never overwritten
        assert credentials.read_text().startswith(original)
        assert contexts["demo-2"].url == f"http://127.0.0.1:{port}"
        api = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/deployments/demo",
            headers={"Authorization": f"Bearer {contexts['demo-2'].token}"},
        )
        assert api.json()["instances"][0]["observed_state"] == "ready"
        assert _processes_mentioning(str(data_dir))  # server, agent and engine are running
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=90)
        reader.join(timeout=10)
    assert code == 0, "".join(lines)
    assert "stopping the demo" in "".join(lines)
    assert _processes_mentioning(str(data_dir)) == []
