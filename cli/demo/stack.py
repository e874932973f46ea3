"""The demo's stack: control plane, agent, engines and gateway started in order, stopped in
reverse.

The control plane (SQLite under the data dir), the agent and the gateway are child processes
(`cli.demo.children`); `stop` ends them in order, each with a bounded wait: the gateway, the
agent (it drains its engines; any it leaves running are stopped after it), then the control
plane. Every step of `start` is idempotent, so running `dctl up --demo` again on the same data
dir reuses the checkpoint, the registration, the agent's identity, the deployment, the gateway's
port and the demo's tokens.

The deployment runs two instances, one GPU each, so a canary has room (it never takes the last
stable instance); a short rollout policy and the demo traffic (`cli.demo.traffic`) let
`dctl rollout demo --to demo:v2` be analysed and promoted within minutes.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cli.demo.children import Children, stop_leftover_engines
from cli.demo.ports import kept_port, kept_port_range, port_is_free
from cli.demo.traffic import DEFAULT_RPS, DemoTraffic
from cli.exits import CliError

if TYPE_CHECKING:
    from client.http import ControlPlaneClient

DEPLOYMENT = "demo"
MODEL, VERSION = "demo", "v1"
ENGINE_PORTS = 8  # consecutive free ports offered to the agent
CANARY_INSTANCES = 2  # a canary takes one instance and never the last stable one
# Three steps (10 -> 50 -> 100) of 30 s: a demo rollout takes about a minute and a half. At the
# demo traffic's 4 requests/s an interval analyses about 100 requests, so the 10% canary gets
# about 10: asking 10 would extend the first step about every other time, 5 one time in 40.
ROLLOUT_INTERVAL_S = 30.0
ROLLOUT_MIN_REQUESTS = 5
# Bounded waits when stopping, then SIGKILL. The agent's own drain of its engines takes at most
# its stop grace (30 s) + 5 s.
STOP_GRACE_S = 30.0
AGENT_STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class DemoEndpoints:
    """What the demo prints once it is up."""

    control_plane: str
    base_url: str  # the gateway's
    api_key: str  # a client token, good for every deployment
    engine_url: str  # the engine itself, bypassing the gateway
    engine_key: str
    context: str
    context_is_current: bool
    instances: int  # ready instances of the deployment: a canary needs CANARY_INSTANCES


def _engine_ready(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class DemoStack:
    """Starts, watches and stops the demo's processes."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        size: str | None = None,
        timeout_s: float = 600.0,
        say: Callable[[str], None] = print,
        *,
        traffic_rps: float = DEFAULT_RPS,
    ) -> None:
        self.data_dir = data_dir
        self.port = port
        self.size = size  # None: the trained demo model; tiny | small: random weights
        self.timeout_s = timeout_s
        self.say = say
        self.traffic_rps = traffic_rps  # 0: no demo traffic
        self.url = f"http://127.0.0.1:{port}"
        self.children = Children(data_dir / "logs")
        self._traffic: DemoTraffic | None = None

    # --- processes -----------------------------------------------------------------------------

    def _dctl(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli", *args]

    def _run(self, argv: list[str], env: dict[str, str], what: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
            raise CliError(f"{what} failed: {' '.join(detail) or f'exit {done.returncode}'}")

    def _wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.children.check()
            if ready():
                return
            time.sleep(0.5)
        raise CliError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    # --- steps ---------------------------------------------------------------------------------

    def _admin_token(self, database_url: str) -> str:
        """Migrate the database and mint (or reuse) the demo's admin token."""
        from controlplane import migrate
        from controlplane.bootstrap import ensure_admin_token
        from controlplane.db import make_engine

        token_file = self.data_dir / "admin-token"
        migrate.upgrade(database_url, "head")
        engine = make_engine(database_url)
        try:
            secret = ensure_admin_token(engine)
        finally:
            engine.dispose()
        if secret is not None:
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secret + "\n")
            return secret
        if not token_file.is_file():
            raise CliError(
                f"the demo database in {self.data_dir} has an admin token but {token_file} is "
                "missing: remove the data dir or pass another --data-dir"
            )
        return token_file.read_text().strip()

    def _save_context(self, token: str) -> tuple[str, bool]:
        """Add a `demo` context (never overwriting one); returns its name and if it is current."""
        from client.credentials import CredentialsError, CredentialsFile

        store = CredentialsFile()
        try:
            current, contexts = store.load()
            for name, ctx in contexts.items():
                if ctx.url == self.url and ctx.token == token:
                    return name, name == current
            added = store.add(self.url, token, name="demo", make_current=current is None)
            return added.name, store.load()[0] == added.name
        except CredentialsError as exc:
            self.say(f"warning: credentials not saved: {exc}")
            return "", False

    def _secret(self, name: str, mint: Callable[[], str]) -> str:
        """A token the demo keeps in a 0600 file of its data dir, minted on the first run."""
        path = self.data_dir / name
        if path.is_file() and (saved := path.read_text().strip()):
            return saved
        secret = mint()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secret + "\n")
        return secret

    def _start_gateway(self, api: ControlPlaneClient, env: dict[str, str]) -> tuple[str, str]:
        """Start the gateway; returns its OpenAI base URL and the client token the demo prints.

        It routes only to ready instances, so it may start while the engines load.
        """
        from protocol.rest import TokenCreate

        def mint(role: Literal["gateway", "client"]) -> Callable[[], str]:
            name = f"demo-{role}-{secrets.token_hex(3)}"
            return lambda: api.create_token(TokenCreate(name=name, role=role)).secret

        self._secret("gateway-token", mint("gateway"))
        client_key = self._secret("client-token", mint("client"))
        port = kept_port(self.data_dir / "gateway-port")
        self.say(f"starting the gateway on http://127.0.0.1:{port}")
        self.children.spawn(
            "gateway",
            self._dctl("gateway", "--control-plane", self.url, "--token-file",
                       str(self.data_dir / "gateway-token"), "--port", str(port)),
            env,
        )  # fmt: skip
        return f"http://127.0.0.1:{port}/v1", client_key

    def _wait_until_gateway_serves(self, base_url: str, client_key: str) -> None:
        """Wait until a chat completion through the gateway succeeds."""
        import httpx

        probe = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 1}  # fmt: skip

        def serves() -> bool:
            try:
                reply = httpx.post(
                    f"{base_url}/chat/completions", json=probe, timeout=30,
                    headers={"Authorization": f"Bearer {client_key}"},
                )  # fmt: skip
            except httpx.HTTPError:
                return False
            return reply.status_code == 200

        self._wait_for("a request through the gateway to succeed", serves, 120)

    def _deploy(self, api: ControlPlaneClient, host: str) -> int:
        """Create the demo deployment, or bring an earlier run's to the demo's shape, with the
        demo's rollout policy. Returns how many instances it runs."""
        from client.http import ClientError
        from protocol.rest import DeploymentCreate, DeploymentUpdate, Placement
        from protocol.rollout_policy import RolloutPolicy

        try:
            gpus = len(api.get_host(host).gpus)
        except ClientError as exc:
            raise CliError(f"the control plane did not answer: {exc}") from exc
        # One GPU each leaves room for a canary; a host with one GPU keeps one instance on it.
        instances = CANARY_INSTANCES if gpus >= CANARY_INSTANCES else 1
        per_instance = 1 if instances > 1 else None  # None: all of the host's GPUs
        try:
            current = api.get_deployment(DEPLOYMENT)
        except ClientError as exc:
            if exc.status != 404:
                raise CliError(f"the control plane did not answer: {exc}") from exc
            self.say(
                f"deploying {MODEL}:{VERSION} as {DEPLOYMENT!r} on {host}: {instances} "
                f"instance(s), {'one GPU each' if per_instance else 'on all its GPUs'}"
            )
            # On a CPU each engine would otherwise spin torch threads on every core, fighting
            # the other one for them.
            threads = max(1, (os.cpu_count() or 1) // instances)
            current = api.create_deployment(
                DeploymentCreate(
                    name=DEPLOYMENT,
                    model=MODEL,
                    version=VERSION,
                    placement=Placement(hosts=[host]),
                    instances_per_host=instances,
                    gpus_per_instance=per_instance,
                    engine_config={"resources": {"threads": threads}},
                )
            )
        policy = RolloutPolicy(interval_s=ROLLOUT_INTERVAL_S, min_requests=ROLLOUT_MIN_REQUESTS)
        change: dict[str, Any] = {}
        if current.instances_per_host != instances:
            change["instances_per_host"] = instances
        if current.gpus_per_instance != per_instance:
            change["gpus_per_instance"] = per_instance or 0  # 0: back to all GPUs
        if current.rollout_policy != policy:
            # DeploymentCreate has no policy: a new deployment gets it here.
            change["rollout_policy"] = policy
        if change.keys() & {"instances_per_host", "gpus_per_instance"}:
            self.say(f"bringing {DEPLOYMENT!r} (from an earlier run) to {instances} instance(s)")
        if change:
            api.update_deployment(DEPLOYMENT, DeploymentUpdate(**change))
        return instances

    def start(self) -> DemoEndpoints:
        """Bring the whole stack up and wait until every demo instance is ready."""
        from client.http import ClientError, ControlPlaneClient
        from protocol.rest import TokenCreate

        if not port_is_free(self.port):
            raise CliError(f"port {self.port} is in use: pass --port with a free port")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cp_dir = self.data_dir / "controlplane"
        cp_dir.mkdir(exist_ok=True)
        database_url = f"sqlite:///{cp_dir / 'dctl.db'}"
        token = self._admin_token(database_url)
        context, current = self._save_context(token)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
        server_env = {**env, "DCTL_DATA_DIR": str(cp_dir), "DCTL_DATABASE_URL": database_url,
                      "DCTL_HEARTBEAT_INTERVAL_S": "2"}  # fmt: skip
        self.say(f"starting the control plane on {self.url} (logs: {self.data_dir / 'logs'})")
        self.children.spawn(
            "control plane", self._dctl("server", "--port", str(self.port)), server_env
        )
        api = ControlPlaneClient(self.url, token, timeout=10.0)

        def answers() -> bool:
            try:
                api.request("GET", "/readyz")
            except ClientError:
                return False
            return True

        self._wait_for("the control plane", answers, 120)
        cli_env = {**env, "DCTL_URL": self.url, "DCTL_TOKEN": token}
        checkpoint = self.data_dir / "checkpoints" / "demo"
        if not (checkpoint / "config.json").is_file():
            create = self._dctl("model", "create-demo", str(checkpoint))
            if self.size is None:
                self.say(f"creating the trained demo model in {checkpoint}")
            else:
                self.say(f"creating the {self.size} random-weight demo checkpoint in {checkpoint}")
                create += ["--random", "--size", self.size]
            self._run(create, cli_env, "creating the demo checkpoint")
        self.say(f"registering {MODEL}:{VERSION}")
        self._run(
            self._dctl("model", "register", f"{MODEL}:{VERSION}", str(checkpoint)),
            cli_env,
            f"registering {MODEL}:{VERSION}",
        )
        from agent.host_facts import default_host_name

        host = default_host_name()
        try:
            api.get_host(host)
        except ClientError as exc:
            if exc.status != 404:
                raise CliError(f"the control plane did not answer: {exc}") from exc
            bootstrap = api.create_token(
                TokenCreate(
                    name=f"demo-agent-{secrets.token_hex(3)}",
                    role="bootstrap",
                    expires_in_s=3600,
                    uses=1,
                )
            ).secret
        else:
            # Registered by an earlier run: the agent reuses its saved identity, and should it
            # have lost it, only a re-key token (bound to this host) may register it again.
            bootstrap = api.rekey_host(host).secret
        # An earlier run's ports while free: the instances keep them, and the URL printed.
        first, last = kept_port_range(self.data_dir / "engine-ports", ENGINE_PORTS)
        # The demo's agent may copy the checkpoint it registered straight from this disk.
        agent_args = ["agent", "--control-plane", self.url, "--data-dir",
                      str(self.data_dir / "agent"), "--name", host, "--ports", f"{first}-{last}",
                      "--metrics-port", "0", "--stop-engines-on-exit",
                      "--model-root", str(checkpoint.parent)]  # fmt: skip
        if os.geteuid() == 0:
            self.say("warning: running as root; the demo lets its local agent run as root")
            agent_args.append("--allow-root")
        self.say(f"starting the agent for host {host}")
        self.children.spawn(
            "agent", self._dctl(*agent_args), {**env, "DCTL_BOOTSTRAP_TOKEN": bootstrap}
        )

        def registered() -> bool:
            try:
                # Its GPUs come with its first heartbeat; the deployment's shape depends on them.
                return bool(api.get_host(host).gpus)
            except ClientError:
                return False

        self._wait_for(f"host {host} to register and report its GPUs", registered, 300)
        wanted = self._deploy(api, host)
        base_url, client_key = self._start_gateway(api, env)
        ready_instances: list[tuple[int, int]] = []  # (instance id, port), oldest first

        def instances_ready() -> bool:
            try:
                deployment = api.get_deployment(DEPLOYMENT)
            except ClientError:
                return False
            # The stored state may be left over from an earlier run: ask the engine itself too.
            ready_instances[:] = sorted(
                (i.id, i.port)
                for i in deployment.instances
                if i.observed_state == "ready" and _engine_ready(i.port)
            )
            return len(ready_instances) >= wanted

        self.say(f"waiting for {wanted} engine(s) to load the model and become ready")
        self._wait_for("the demo instances to become ready", instances_ready, self.timeout_s)
        self._wait_until_gateway_serves(base_url, client_key)
        api.close()
        if self.traffic_rps > 0:
            self._traffic = DemoTraffic(base_url, client_key, self.traffic_rps, say=self.say)
            self._traffic.start()
        instance_id, port = ready_instances[0]
        return DemoEndpoints(
            self.url,
            base_url,
            client_key,
            f"http://127.0.0.1:{port}/v1",
            self._engine_key(instance_id),
            context,
            current,
            len(ready_instances),
        )

    def _engine_key(self, instance_id: int) -> str:
        """The demo engine's API key, read from the 0600 config its (local) agent wrote.

        The API never shows instance keys to an operator; the demo owns the agent's data dir.
        """
        import yaml

        config = self._agent_run_dir() / f"instance-{instance_id}.yaml"
        try:
            key = yaml.safe_load(config.read_text())["service"]["api_key"]
        except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
            raise CliError(f"cannot read the demo engine's API key from {config}: {exc}") from exc
        return str(key)

    def watch(self, stop: threading.Event) -> None:
        """Block until STOP is set; a child that dies ends the demo with an error."""
        while not stop.wait(0.5):
            self.children.check()

    def _agent_run_dir(self) -> Path:
        """Where the demo's agent keeps its engines' configs and pid files."""
        return self.data_dir / "agent" / "agent" / "run"

    def stop(self) -> None:
        """Stop the demo traffic, the gateway, the agent (draining its engines), then the control
        plane; each with a bounded wait, then SIGKILL."""
        if self._traffic is not None:
            self._traffic.stop()
        self.children.stop("gateway", STOP_GRACE_S)
        self.children.stop("agent", AGENT_STOP_GRACE_S)
        # Only engines of an agent this run started: those of another `dctl up` on the same
        # data dir (this one then failed to start) are not ours to stop.
        if "agent" in self.children.processes:
            stop_leftover_engines(self._agent_run_dir(), STOP_GRACE_S)
        self.children.stop("control plane", STOP_GRACE_S)
        self.children.close_logs()
