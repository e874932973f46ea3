"""The stack on loopback: `dctl server`, `dctl agent`, `dctl gateway` as child processes (the
demo's `cli.demo.children`: own sessions, parent-death signal, bounded stop), and the deployment
made with the CLI, as an operator would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .report import StepFailed, wait_for

if TYPE_CHECKING:
    from client.http import ControlPlaneClient

T = TypeVar("T")
MODEL_REF = "tiny-llama:v1"
DEPLOYMENT = "tiny"  # the served model name
HOST = "bench-gpu"
ENGINE_PORTS = 4
STOP_GRACE_S = 30.0
AGENT_STOP_GRACE_S = 60.0
GUIDELLM = Path(sys.executable).parent / "guidellm"


class BenchStack:
    """Control plane, agent and gateway on loopback under WORK, stopped in reverse order."""

    def __init__(self, work: Path, fake: bool, startup_grace_s: float) -> None:
        from cli.demo.children import Children

        self.work, self.fake, self.startup_grace_s = work, fake, startup_grace_s
        self.gpus = ["fake", "--fake-gpus", "1xH200"] if fake else ["nvml"]
        self.children = Children(work / "logs")
        home = work / "home"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
        # A home of its own: the credentials file and every cache stay in WORK.
        self.env = env | {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "config"),
            "XDG_DATA_HOME": str(home / "data"),
            "DCTL_DATA_DIR": str(work / "cp"),
            "DCTL_HEARTBEAT_INTERVAL_S": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        self.url = ""
        self.token = ""
        self.gateway_url = ""
        self.client_token = ""
        self._api: ControlPlaneClient | None = None

    @property
    def api(self) -> ControlPlaneClient:
        """The control plane's client, as admin."""
        assert self._api is not None, "start() first"
        return self._api

    @property
    def run_dir(self) -> Path:
        """Where the agent keeps its engines' 0600 configs, pid files and logs."""
        return self.work / "agent" / "agent" / "run"

    def dctl(self, *args: str) -> str:
        """Run a `dctl` command as the admin; its stdout, StepFailed with its error otherwise."""
        env = self.env | {"DCTL_URL": self.url, "DCTL_TOKEN": self.token}
        done = subprocess.run(self._argv(*args), capture_output=True, text=True, env=env,
                              timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise StepFailed(f"dctl {args[0]} {args[1]}", (done.stderr or done.stdout)[-800:])
        return done.stdout

    def until(self, what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
        """PROBE's first truthy answer while every part runs; StepFailed after TIMEOUT_S."""

        def checked() -> T | None:
            self.children.check()  # a part that died ends the wait with its log's name
            return probe()

        try:
            return wait_for(what, checked, timeout_s)
        except TimeoutError as exc:
            raise StepFailed("stack", str(exc)) from None

    def start(self) -> None:
        """Control plane, agent (its host registered with GPUs) and gateway, each awaited."""
        from cli.demo.ports import free_port_range
        from client.credentials import CredentialsFile
        from client.http import ClientError, ControlPlaneClient

        port = free_port_range(1)[0]
        self.url = f"http://127.0.0.1:{port}"
        print(f"starting the control plane on {self.url} (logs: {self.work / 'logs'})", flush=True)
        self.children.spawn(
            "control plane", self._argv("server", "--port", str(port), "--migrate"), self.env
        )

        def admin() -> ControlPlaneClient | None:
            try:  # the first start saved its admin token in the credentials file
                ctx = CredentialsFile(self.work / "home" / "config" / "dctl" / "credentials")
                token = ctx.load()[1]["default"].token or ""
                api = ControlPlaneClient(self.url, token)
                api.request("GET", "/readyz")
            except (ClientError, KeyError, OSError):
                return None
            self.token = token
            return api

        self._api = self.until("the control plane", admin, 120)
        boot = self.mint_token("bench-agent", "bootstrap", "--uses", "1")
        first, last = free_port_range(ENGINE_PORTS)
        # The agent copies the registered checkpoint straight from this disk (--model-root).
        agent = [
            "agent", "--control-plane", self.url, "--data-dir", str(self.work / "agent"),
            "--name", HOST, "--ports", f"{first}-{last}", "--gpu-backend", *self.gpus,
            "--metrics-port", "0", "--startup-grace-s", str(int(self.startup_grace_s)),
            "--stop-engines-on-exit", "--model-root", str(self.work / "checkpoints"),
        ]  # fmt: skip
        if os.geteuid() == 0:
            agent.append("--allow-root")
        print(f"starting the agent ({'fake GPUs' if self.fake else 'NVML'})", flush=True)
        self.children.spawn("agent", self._argv(*agent), self.env | {"DCTL_BOOTSTRAP_TOKEN": boot})

        def gpus_reported() -> list[Any] | None:
            try:
                return self.api.get_host(HOST).gpus or None
            except ClientError:
                return None

        found = self.until(f"host {HOST} to register and report its GPUs", gpus_reported, 180)
        print(f"host {HOST}: {', '.join(g.name for g in found)}", flush=True)
        self._start_gateway()

    def mint_token(self, name: str, role: str, *flags: str) -> str:
        """A new token's secret, made with `dctl token create`."""
        made = self.dctl("token", "create", name, "--role", role, *flags, "--json")
        return str(json.loads(made)["secret"])

    def _start_gateway(self) -> None:
        from cli.demo.ports import free_port_range

        token_file = self.work / "gateway-token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.mint_token("bench-gateway", "gateway") + "\n")
        self.client_token = self.mint_token("bench-client", "client")
        port = free_port_range(1)[0]
        self.gateway_url = f"http://127.0.0.1:{port}/v1"
        print(f"starting the gateway on {self.gateway_url}", flush=True)
        gateway = ["gateway", "--control-plane", self.url, "--token-file", str(token_file),
                   "--port", str(port)]  # fmt: skip
        self.children.spawn("gateway", self._argv(*gateway), self.env)

    def _argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli", *args]

    def log_tails(self, lines: int = 15, engine_lines: int = 60) -> str:
        """The last lines of every part's log and more of the engine's (a traceback), for a
        failure."""
        logs = [(log, lines) for log in sorted((self.work / "logs").glob("*.log"))]
        logs += [(log, engine_lines) for log in sorted((self.run_dir / "logs").glob("*.log"))]
        parts = []
        for log, count in logs:
            tail = log.read_text(errors="replace").splitlines()[-count:]
            parts.append(f"--- {log}\n" + "\n".join(line[:240] for line in tail))
        return "\n".join(parts)

    def stop(self) -> None:
        """Gateway, agent (draining its engine), leftover engines, then the control plane."""
        from cli.demo.children import stop_leftover_engines

        if self._api is not None:
            self._api.close()
        self.children.stop("gateway", STOP_GRACE_S)
        self.children.stop("agent", AGENT_STOP_GRACE_S)
        if "agent" in self.children.processes:
            stop_leftover_engines(self.run_dir, STOP_GRACE_S)
        self.children.stop("control plane", STOP_GRACE_S)
        self.children.close_logs()


def engine_config(fake: bool, python: str | None) -> dict[str, Any]:
    """The deployment's engine config: vLLM in PYTHON, or GuideLLM's mock server."""
    if fake:
        command = [str(GUIDELLM), "mock-server", "--host", "{host}", "--port", "{port}",
                   "--model", "{served_name}"]  # fmt: skip
        return {"engine": {"kind": "command", "command": command, "metrics_path": None}}
    return {
        "engine": {"kind": "vllm", "python": python, "extra_args": ["--enforce-eager"]},
        "model": {"max_seq_len": 512},
        "resources": {"memory_fraction": 0.3},
    }


def deploy(stack: BenchStack, checkpoint: Path, config: dict[str, Any]) -> None:
    """Register the checkpoint and deploy it on the host's one GPU with CONFIG."""
    import yaml

    print(f"registering {MODEL_REF} and deploying it as {DEPLOYMENT!r}", flush=True)
    stack.dctl("model", "register", MODEL_REF, str(checkpoint))
    config_file = stack.work / "engine-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    stack.dctl("deploy", "create", DEPLOYMENT, "--model", MODEL_REF, "--hosts", HOST,
               "--gpus-per-instance", "1", "--engine-config", str(config_file))  # fmt: skip
