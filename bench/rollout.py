"""How fast rollouts act: from `dctl rollout` to the first request the canary serves, and from a
failing analysis to weight 0 in the routing table the gateways poll.

A real fleet on this machine (`dctl up --demo` as a library: control plane, agent with fake
GPUs, two engines of the tiny random checkpoint, gateway), demo:v2 and demo:v3 registered, a
closed-loop load of 3 clients through the gateway. Each round:

1. `POST .../rollout` of v2 (canary 50%); the time until a response says `x-dctl-version:
   demo:v2` (the agent fetches nothing new after the first round: the snapshot is kept). Then
   the rollout is aborted and both instances wait ready on v1 again.
2. A rollout of v3 whose engine config answers every request with a 500 (`chaos`), a short
   interval and failure limit 1; a watcher polls the routing table as a gateway does (every
   50 ms here; gateways poll every `routes_poll_s`, 1 s by default) and notes when the canary
   weight there drops to 0. Figure: that moment minus the failing analysis's time (both on this
   machine's clock). Goal: under 2 s including the gateway's poll. Argo Rollouts and Flagger
   act at their next reconcile: seconds to a minute.

Medians over `--rounds` rounds. `--smoke`: one round, for the test suite.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.demo.stack import DemoStack  # noqa: E402
from client.http import ControlPlaneClient  # noqa: E402
from engine.demo_checkpoint import create_demo_checkpoint  # noqa: E402
from protocol.rest import TokenCreate  # noqa: E402
from protocol.rollout_policy import RolloutPolicy  # noqa: E402
from protocol.rollouts import RolloutAction, RolloutCreate, RolloutState  # noqa: E402

GATEWAY_POLL_S = 1.0  # the gateway's default routes_poll_s
CHAOS = {
    "resources": {"threads": 1},
    "model": {"dtype": "fp32", "max_seq_len": 512},
    "chaos": {"error_rate": 1.0},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Load:
    """Closed-loop clients through the gateway; remembers when each version first answered."""

    def __init__(self, url: str, key: str, clients: int = 3) -> None:
        self.url, self.key = url, key
        self.first: dict[str, float] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 4}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=60, headers=headers) as http:
            while not self.stop.is_set():
                try:
                    response = http.post(f"{self.url}/completions", json=body)
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                version = response.headers.get("x-dctl-version", "")
                self.first.setdefault(version, time.monotonic())

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def wait(what: str, probe: object, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def all_on(api: ControlPlaneClient, version: str) -> bool:
    instances = api.get_deployment("demo").instances
    return len(instances) == 2 and all(
        i.version == version and i.observed_state == "ready" and i.on_version for i in instances
    )


def time_to_first_canary_request(api: ControlPlaneClient, load: Load) -> float:
    load.first.pop("demo:v2", None)
    started = time.monotonic()
    api.start_rollout("demo", RolloutCreate(to="v2", canary=50))
    wait("a response from the canary", lambda: "demo:v2" in load.first)
    took = load.first["demo:v2"] - started
    api.rollout_action("demo", "abort", RolloutAction(reason="bench round done"))
    wait("both instances back on v1", lambda: all_on(api, "v1"))
    return took


def abort_to_weight_zero(api: ControlPlaneClient, gateway_api: ControlPlaneClient) -> float:
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        # What a gateway polls: the routing table (here every 50 ms, wall clock noted).
        while not stop.is_set():
            table = gateway_api.routes()
            if table is not None:
                route = next(r for r in table.deployments if r.deployment == "demo")
                if route.canary is not None and route.canary_weight > 0:
                    seen["weighted"] = time.time()
                elif "weighted" in seen and "zero" not in seen:
                    seen["zero"] = time.time()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # Longer than the gateway's 5 s report windows: an interval needs one that fits in it.
    policy = RolloutPolicy(interval_s=6, failure_limit=1, min_requests=5)
    created = api.start_rollout(
        "demo", RolloutCreate(to="v3", engine_config=CHAOS, canary=50, policy=policy)
    )
    wait(
        "the rollout to abort",
        lambda: api.rollout_by_id("demo", created.id).state == RolloutState.ABORTED,
    )
    wait("the watcher to see weight 0", lambda: "zero" in seen, 10)
    stop.set()
    watcher.join()
    out = api.rollout_by_id("demo", created.id)
    assert out.analysis is not None and out.analysis.verdict == "fail", out
    verdict = out.analysis.time.timestamp()
    wait("both instances back on v1", lambda: all_on(api, "v1"))
    return seen["zero"] - verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round, for the test suite")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory(prefix="dctl-bench-rollout-") as tmp:
        home = Path(tmp)
        # The demo saves a context and data under the XDG dirs: keep them in the throwaway home.
        os.environ.update(XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"))
        stack = DemoStack(home / "demo", free_port(), "tiny", 600.0, say=lambda _l: None,
                          traffic_rps=0.0)  # fmt: skip
        try:
            endpoints = stack.start()
            # The admin token the demo minted, in its 0600 file.
            token = (home / "demo" / "admin-token").read_text().strip()
            api = ControlPlaneClient(endpoints.control_plane, token)
            for version, seed in (("v2", 2), ("v3", 3)):
                path = home / f"ckpt-{version}"
                create_demo_checkpoint(path, size="tiny", seed=seed)
                register(endpoints.control_plane, token, version, path)
            gateway_token = api.create_token(TokenCreate(name="bench-gw", role="gateway")).secret
            gateway_api = ControlPlaneClient(endpoints.control_plane, gateway_token)
            load = Load(endpoints.base_url, endpoints.api_key)
            try:
                first = [time_to_first_canary_request(api, load) for _ in range(rounds)]
                zero = [abort_to_weight_zero(api, gateway_api) for _ in range(rounds)]
            finally:
                load.close()
        finally:
            stack.stop()
    print(f"rollout bench, {rounds} round(s), {datetime.now(UTC):%Y-%m-%d}")
    print(
        f"dctl rollout -> first canary request served: median {statistics.median(first):.2f} s "
        f"({', '.join(f'{x:.2f}' for x in first)}): the agent restarts one engine on the new "
        "version, the gateway routes to it once it is ready"
    )
    worst = max(zero) + GATEWAY_POLL_S
    print(
        f"failing analysis -> weight 0 in the routing table: median "
        f"{statistics.median(zero) * 1000:.0f} ms ({', '.join(f'{x * 1000:.0f}' for x in zero)})"
        f"; a gateway polls it every {GATEWAY_POLL_S:g} s (routes_poll_s), so every gateway "
        f"routes by weight 0 within {worst:.2f} s of the verdict (goal < 2 s; Argo Rollouts / "
        "Flagger: their next reconcile, seconds to a minute)"
    )


def register(url: str, token: str, version: str, path: Path) -> None:
    """Register a checkpoint directory as demo:VERSION, as a user does."""
    env = {**os.environ, "DCTL_URL": url, "DCTL_TOKEN": token}
    subprocess.run(
        [sys.executable, "-m", "cli", "model", "register", f"demo:{version}", str(path)],
        check=True, capture_output=True, env=env,
    )  # fmt: skip


if __name__ == "__main__":
    main()
