"""Autoscaling under a stepped load: idle -> burst -> idle, on the tiny model.

A real fleet on this machine (`dctl up --demo` as a library: control plane, an agent with four
fake GPUs, engines of the tiny random checkpoint, a gateway). The demo deployment is given two
request slots per engine and a fast policy (min 1, max 3, target queue 1 per instance, up after
2 s, down after 10 s, cooldown 2 s, one standby). Then, per round: idle until it sits at one
serving instance, a burst of closed-loop clients through the gateway for `--burst-s`, idle
again until it is back at one. Sampled every 0.25 s from the control plane: the instances
placed (each holds one GPU) and the queue per ready serving instance.

Figures: time from the burst's start to the first added instance (the scale-up decision, and
that instance in the gateway's routes: a promoted standby needs no model load), the time the
queue stayed over target, requests failed (must be 0), and GPU-seconds used against a fixed
fleet sized for the peak (its serving instances, all the time). Medians over `--rounds`.
`--smoke`: one short round, for the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.demo.stack import DEPLOYMENT, DemoStack  # noqa: E402
from client.http import ControlPlaneClient  # noqa: E402
from protocol.autoscale import AutoscalePolicy  # noqa: E402
from protocol.rest import DeploymentOut, DeploymentUpdate, TokenCreate  # noqa: E402

POLICY = AutoscalePolicy(
    min=1, max=3, target_queue=1, target_utilization=0.5, up_after_s=2, down_after_s=10,
    cooldown_s=2, standby=1,
)  # fmt: skip
ENGINE = {"resources": {"threads": 1}, "service": {"max_concurrent_requests": 2, "max_queue": 64},
          "model": {"dtype": "fp32", "max_seq_len": 512}}  # fmt: skip
BODY = {"model": DEPLOYMENT, "prompt": "Hello there", "max_tokens": 8}
SAMPLE_S = 0.25


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Burst:
    """CLIENTS closed-loop clients through the gateway until stopped; every status kept."""

    url: str
    key: str
    clients: int
    statuses: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        return threads

    def _client(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=120, headers=headers) as http:
            while not self.stop.is_set():
                try:
                    status = http.post(f"{self.url}/completions", json=BODY).status_code
                except httpx.HTTPError:
                    status = 0
                self.statuses.append(status)


@dataclass
class Round:
    to_decision_s: float
    to_routed_s: float
    over_target_s: float
    failed: int
    requests: int
    gpu_seconds: float
    fixed_gpu_seconds: float
    peak: int


def wait(what: str, probe: object, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def at_rest(api: ControlPlaneClient) -> bool:
    """One serving instance and the standby ready, nothing retiring."""
    d = api.get_deployment(DEPLOYMENT)
    ready = [i for i in d.instances if i.observed_state == "ready" and i.on_version]
    return (
        len(d.instances) == 2
        and len(ready) == 2
        and sum(i.standby for i in ready) == 1
        and not any(i.retiring for i in d.instances)
    )


def one_round(api: ControlPlaneClient, gateway: ControlPlaneClient, url: str, key: str,
              idle_s: float, burst_s: float, clients: int) -> Round:  # fmt: skip
    """IDLE_S idle, BURST_S of CLIENTS, idle again until back at rest (IDLE_S at least)."""
    wait("the deployment at rest (1 serving + 1 standby)", lambda: at_rest(api))
    seen_ups = len(api.list_events(kind="autoscale.up").items)
    burst = Burst(url, key, clients)
    samples: list[tuple[float, DeploymentOut]] = []
    idle_from = time.monotonic()
    while time.monotonic() - idle_from < idle_s:
        samples.append((time.monotonic(), api.get_deployment(DEPLOYMENT)))
        time.sleep(SAMPLE_S)
    start = time.monotonic()
    start_wall = time.time()
    threads = burst.run()
    routed_at: float | None = None
    first_serving = {i.id for i in api.get_deployment(DEPLOYMENT).instances if not i.standby}
    while True:
        now = time.monotonic()
        deployment = api.get_deployment(DEPLOYMENT)
        samples.append((now, deployment))
        if routed_at is None:
            table = gateway.routes()
            if table is not None:
                pool = {i.id for r in table.deployments for i in r.stable.instances}
                if pool - first_serving:
                    routed_at = now
        if not burst.stop.is_set() and now - start >= burst_s:
            burst.stop.set()
        rested = now - start >= burst_s + idle_s
        if burst.stop.is_set() and rested and at_rest(api):
            break
        if now - start > burst_s + 300:
            raise SystemExit("the deployment did not come back to rest")
        time.sleep(SAMPLE_S)
    for thread in threads:
        thread.join(timeout=120)
    ups = api.list_events(kind="autoscale.up").items[seen_ups:]
    if not ups or routed_at is None:
        raise SystemExit("the burst scaled nothing up")
    over = 0.0
    gpu_seconds = 0.0
    peak = 0
    for (t0, d), (t1, _next) in itertools.pairwise(samples):
        status = d.autoscale_status
        if status is not None and (status.queue_per_instance or 0) > POLICY.target_queue:
            over += t1 - t0
        gpu_seconds += len(d.instances) * (t1 - t0)  # one GPU each, standby and retiring too
        peak = max(peak, sum(1 for i in d.instances if not i.standby and not i.retiring))
    elapsed = samples[-1][0] - samples[0][0]
    failed = sum(1 for s in burst.statuses if s != 200)
    if failed:
        print(f"statuses: {dict(Counter(burst.statuses))}", file=sys.stderr)
    return Round(
        to_decision_s=ups[0].time.timestamp() - start_wall,
        to_routed_s=routed_at - start,
        over_target_s=over,
        failed=failed,
        requests=len(burst.statuses),
        gpu_seconds=gpu_seconds,
        fixed_gpu_seconds=peak * elapsed,
        peak=peak,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--burst-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="one short round, for the tests")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    burst_s = 8.0 if args.smoke else args.burst_s
    idle_s = 4.0 if args.smoke else args.idle_s
    with tempfile.TemporaryDirectory(prefix="dctl-bench-autoscale-") as tmp:
        home = Path(tmp)
        config = home / "config" / "dctl"
        config.mkdir(parents=True)
        # Four fake GPUs for the demo's agent (its environment is cleaned of DCTL_ variables;
        # the config file is read from the throwaway XDG home).
        # No per-token rate limit at the gateway: the burst is to queue at the engines.
        (config / "config.toml").write_text(
            '[agent]\nfake_gpus = "4xH200"\n\n[gateway]\nrate_limit_rps = 0\n'
        )
        os.environ.update(XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"))
        stack = DemoStack(home / "demo", free_port(), "tiny", 600.0, say=lambda _l: None,
                          traffic_rps=0.0)  # fmt: skip
        try:
            endpoints = stack.start()
            token = (home / "demo" / "admin-token").read_text().strip()
            api = ControlPlaneClient(endpoints.control_plane, token)
            gateway_token = api.create_token(TokenCreate(name="bench-gw", role="gateway")).secret
            gateway = ControlPlaneClient(endpoints.control_plane, gateway_token)
            api.update_deployment(DEPLOYMENT, DeploymentUpdate(engine_config=ENGINE))
            api.set_autoscale(DEPLOYMENT, POLICY)
            results = [
                one_round(
                    api,
                    gateway,
                    endpoints.base_url,
                    endpoints.api_key,
                    idle_s,
                    burst_s,
                    args.clients,
                )
                for _ in range(rounds)
            ]
        finally:
            stack.stop()

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}"

    print(f"autoscale bench, {rounds} round(s) of {idle_s:g} s idle -> {burst_s:g} s burst of "
          f"{args.clients} clients -> idle until back at rest (>= {idle_s:g} s), "
          f"{datetime.now(UTC):%Y-%m-%d}")  # fmt: skip
    print(f"policy: min {POLICY.min}, max {POLICY.max}, target queue {POLICY.target_queue:g}, "
          f"up after {POLICY.up_after_s:g} s, down after {POLICY.down_after_s:g} s, "
          f"standby {POLICY.standby}; 2 request slots per engine")  # fmt: skip
    print(f"burst -> scale-up decided: median {med([r.to_decision_s for r in results])} s "
          f"(up-after {POLICY.up_after_s:g} s + the engines' next report and a round)")  # fmt: skip
    routed = med([r.to_routed_s for r in results])
    print(f"burst -> first added instance in the gateway's routes: median {routed} s "
          "(the standby, promoted: no model load)")  # fmt: skip
    print(f"queue over target: median {med([r.over_target_s for r in results])} s per burst")
    failed = sum(r.failed for r in results)
    print(f"requests failed: {failed} of {sum(r.requests for r in results)} (must be 0)")
    used = [r.gpu_seconds for r in results]
    fixed = [r.fixed_gpu_seconds for r in results]
    print(f"GPU-seconds: autoscaled median {med(used)}, a fixed fleet of the peak "
          f"({max(r.peak for r in results)} instances) {med(fixed)}: ratio "
          f"{statistics.median(used) / statistics.median(fixed):.2f}")  # fmt: skip
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
