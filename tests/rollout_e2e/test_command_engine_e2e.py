"""A third-party OpenAI-compatible server as a `command` engine, with real processes: GuideLLM's
mock server (`guidellm mock-server`) deployed by `dctl deploy create --engine-config`, run by a
real agent under `agent.backends.fronted` behind its key-checking proxy, served by a real
gateway to the official `openai` client. It drains on SIGTERM, comes back after a SIGKILL, is
never scraped (it has no /metrics) while the gateway counts its traffic, a missing program
fails its instance and a bad template is refused; and a deployment on the dctl engine is rolled
out to it, judged on the gateway's figures, and rolled back. The tests share one fleet, in file
order: deployment `demo` (dctl engine, two instances, under load) beside deployment `mock`.

GuideLLM 0.8.1's mock server cannot load a tokenizer (`--processor`) under transformers 5 (it
calls the abstract `PreTrainedTokenizer.from_pretrained`), so it runs with its own word
tokenizer and the template passes no `{model_path}`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from client import calls
from controlplane.heartbeat.samples import SAMPLE_BUCKET_S
from protocol.rest import InstanceOut, SeriesOut
from protocol.rollout_states import RolloutState
from protocol.rollouts import RolloutOut
from tests.agent_e2e.conftest import Stack, boot_stack, wait_for
from tests.processes import alive, children, descendants
from tests.rollout_e2e.conftest import RolloutFleet, serving_fleet

HOST = "cmd-host"
MOCK = "mock"
GUIDELLM = str(Path(sys.executable).parent / "guidellm")
# The mock server's latencies: a short TTFT and 10 ms a token, up to 2000 tokens (its default
# caps an answer at 128), so a long stream lasts seconds and the usual one a few dozen ms.
MOCK_COMMAND = [
    GUIDELLM, "mock-server", "--host", "{host}", "--port", "{port}", "--model", "{served_name}",
    "--ttft-ms", "20", "--itl-ms", "10", "--output-tokens", "2000",
]  # fmt: skip
COMMAND_CONFIG = {"engine": {"kind": "command", "command": MOCK_COMMAND, "metrics_path": None}}
INTERVAL_S = 8


@pytest.fixture(scope="module")
def command_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutFleet]:
    """Deployment `demo` (dctl engine, two instances) on a host with six fake GPUs (room for
    `mock` and a broken one beside it), a gateway and a steady load on `demo`."""
    home = tmp_path_factory.mktemp("cmdfleet")
    stack = boot_stack(home, HOST)
    stack.agent_args = ["6xH200" if arg == "2xH200" else arg for arg in stack.agent_args]

    def register(stack: Stack) -> None:
        stack.dctl("model", "create-demo", str(home / "ckpt"), "--random")
        stack.dctl("model", "register", "demo:v1", str(home / "ckpt"))

    with serving_fleet(home, stack, register, load_threads=2, host=HOST) as ro:
        yield ro


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def instance_of(ro: RolloutFleet, deployment: str) -> InstanceOut:
    (inst,) = ro.api.get_deployment(deployment).instances
    return inst


def ready_instance(ro: RolloutFleet, deployment: str, timeout_s: float = 120) -> InstanceOut:
    def probe() -> InstanceOut | None:
        instances = ro.api.get_deployment(deployment).instances
        return (
            instances[0] if len(instances) == 1 and instances[0].observed_state == "ready" else None
        )

    try:
        return wait_for(f"{deployment}'s instance ready", probe, timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ro.fleet.stack.diagnostics()}") from None


def run_dir(ro: RolloutFleet) -> Path:
    return ro.fleet.stack.agent_data() / "agent" / "run"


def front_config(ro: RolloutFleet, inst: InstanceOut) -> dict[str, Any]:
    """What the agent gave the instance's `agent.backends.fronted` (argv, proxy, key)."""
    return dict(yaml.safe_load((run_dir(ro) / f"instance-{inst.id}.yaml").read_text()))


def instance_log(ro: RolloutFleet, inst: InstanceOut) -> str:
    return (run_dir(ro) / "logs" / f"instance-{inst.id}.log").read_text(errors="replace")


def mock_server(front_pid: int) -> int:
    """The engine process below the fronted wrapper FRONT_PID."""
    (engine,) = children(front_pid)
    assert "mock-server" in cmdline(engine)
    return engine


def client_of(ro: RolloutFleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{ro.fleet.gateways[0].url}/v1", api_key=ro.fleet.client_token, max_retries=0
    )


def routed(ro: RolloutFleet, timeout_s: float = 30) -> None:
    """Wait until the gateway routes to `mock`'s ready instance (it polls its routes)."""

    def answered() -> bool:
        body = {"model": MOCK, "prompt": "Hello", "max_tokens": 1}
        headers = {"Authorization": f"Bearer {ro.fleet.client_token}"}
        url = f"{ro.fleet.gateways[0].url}/v1/completions"
        return httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200

    wait_for("the gateway to route to mock", answered, timeout_s)


def demo_runs(ro: RolloutFleet, program: str, timeout_s: float = 120) -> list[InstanceOut]:
    """Wait until both of `demo`'s instances are ready with PROGRAM on their command line
    (`engine.serve`, `agent.backends.fronted`): a version whose weights are the stable's is
    reported ready by the engine it replaces too, so readiness alone says nothing here."""

    def running() -> list[InstanceOut] | None:
        instances = ro.api.get_deployment("demo").instances
        ready = [i for i in instances if i.observed_state == "ready" and i.pid is not None]
        ok = len(ready) == 2 and all(program in cmdline(i.pid) for i in ready if i.pid)
        return ready if ok else None

    try:
        return wait_for(f"both demo instances ready on {program}", running, timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ro.fleet.stack.diagnostics()}") from None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def status(ro: RolloutFleet) -> RolloutOut:
    result = ro.dctl("rollout", "status", "demo", "--json")
    assert result.returncode == 0, result.stderr
    return RolloutOut.model_validate(json.loads(result.stdout))


@pytest.mark.parametrize(
    ("command", "named"),
    [
        (["/srv/bin/server", "--host", "{host}", "--port", "{prot}"], "unknown placeholder {prot}"),
        (["/srv/bin/server", "--host", "{host}"], "{port}"),
    ],
)
def test_a_bad_template_is_refused_at_deploy_create(
    command_fleet: RolloutFleet, tmp_path: Path, command: list[str], named: str
) -> None:
    ro = command_fleet
    config = write_config(
        tmp_path / "bad.yaml", {"engine": {"kind": "command", "command": command}}
    )
    result = ro.dctl(
        "deploy", "create", "bad", "--model", "demo:v1", "--hosts", HOST,
        "--gpus-per-instance", "1", "--engine-config", str(config),
    )  # fmt: skip
    assert result.returncode != 0
    assert "engine.command" in result.stderr and named in result.stderr, result.stderr
    assert "bad" not in {d.name for d in ro.api.list_deployments()}


def test_the_mock_server_serves_the_openai_client_behind_the_key_proxy(
    command_fleet: RolloutFleet, tmp_path: Path
) -> None:
    ro = command_fleet
    config = write_config(tmp_path / "mock.yaml", COMMAND_CONFIG)
    result = ro.dctl(
        "deploy", "create", MOCK, "--model", "demo:v1", "--hosts", HOST,
        "--gpus-per-instance", "1", "--engine-config", str(config),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    inst = ready_instance(ro, MOCK)
    # The mock server checks no key: it listens on loopback, the agent's proxy on the port.
    front = front_config(ro, inst)
    argv, proxy = front["argv"], front["proxy"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert int(argv[argv.index("--port") + 1]) == proxy["upstream_port"] != inst.port
    assert argv[argv.index("--model") + 1] == MOCK
    routed(ro)
    client = client_of(ro)
    chat = client.chat.completions.with_raw_response.create(
        model=MOCK, messages=[{"role": "user", "content": "Hi there"}], max_tokens=8
    )
    assert chat.headers["x-dctl-version"] == "demo:v1"
    done = chat.parse()
    assert done.model == MOCK  # the served name the template passed
    assert done.choices[0].message.content and done.usage is not None
    assert done.usage.completion_tokens == 8
    with client.chat.completions.with_streaming_response.create(
        model=MOCK, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    ) as streamed:  # fmt: skip
        chunks = list(streamed.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text and usage and usage[-1].completion_tokens == 12
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    # Straight at the instance's port: the proxy wants the instance's key.
    url = f"http://127.0.0.1:{inst.port}/v1/chat/completions"
    body = {"model": MOCK, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    key = {"Authorization": f"Bearer {proxy['api_key']}"}
    served = httpx.post(url, json=body, headers=key, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 4
    # The probe path passes without a key, as the dctl engine's do.
    assert httpx.get(f"http://127.0.0.1:{inst.port}/health", timeout=10).status_code == 200


def test_an_engine_without_metrics_is_not_scraped_and_the_gateway_counts_its_traffic(
    command_fleet: RolloutFleet,
) -> None:
    ro = command_fleet
    inst = ready_instance(ro, MOCK)
    running = datetime.now(UTC)  # the instance runs (and would be scraped) from before now
    client = client_of(ro)
    seen: list[Any] = []

    def traffic() -> list[Any]:
        result = ro.dctl("deploy", "traffic", MOCK, "--json")
        assert result.returncode == 0, result.stderr
        seen[:] = versions = json.loads(result.stdout)["versions"]
        return list(versions)

    # What the gateway has reported of the earlier tests' requests, once it stopped growing
    # (its windows reach the control plane every few seconds): these requests come on top.
    before = wait_for("the earlier figures to settle", _settled(traffic), 60)
    sent_tokens = 0
    for n in range(6):
        done = client.completions.create(model=MOCK, prompt="Hello", max_tokens=5 + n)
        assert done.usage is not None
        sent_tokens += done.usage.completion_tokens
    assert sent_tokens == sum(5 + n for n in range(6))
    want_tokens = before["output_tokens"] + sent_tokens

    def counted() -> dict[str, Any] | None:
        versions = traffic()
        done = versions and versions[0]["output_tokens"] >= want_tokens
        return dict(versions[0]) if done else None

    try:
        row = wait_for("the gateway's figures for mock", counted, 90)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: {before} then {seen}\n{ro.fleet.stack.diagnostics()}"
        ) from None
    assert row["version"] == "demo:v1" and row["output_tokens"] == want_tokens, row
    assert row["requests"] >= 9 and row["errors_5xx"] == 0, row
    assert row["latency_p95_s"] is not None
    # The dctl engines' /metrics reach the control plane in 10 s samples, written once their
    # bucket has passed: once the dctl engines' bucket holding RUNNING is there, the mock
    # server's instance has none in it, nor before; and the agent never asked it for any (the
    # proxy forwards every path, so a scrape would be in the mock server's access log).
    demo_ids = {i.id for i in ro.api.get_deployment("demo").instances}
    bucket = running - timedelta(seconds=SAMPLE_BUCKET_S)

    def engine_series() -> list[SeriesOut] | None:
        series = ro.api.send(calls.host_samples(HOST, minutes=5))
        ok = any(s.instance_id in demo_ids and s.points[-1][0] > bucket for s in series)
        return list(series) if ok else None

    series = wait_for("the dctl engines' samples of this moment", engine_series, 60)
    assert [s.name for s in series if s.instance_id == inst.id] == []
    log = instance_log(ro, inst)
    assert "GET http" in log and "/health 200" in log  # its access log: the probes are there
    assert "/metrics" not in log
    assert instance_of(ro, MOCK).observed_state == "ready"
    assert instance_of(ro, MOCK).restart_count == inst.restart_count


def test_a_killed_engine_restarts_its_instance_and_leaves_no_process(
    command_fleet: RolloutFleet,
) -> None:
    ro = command_fleet
    before = ready_instance(ro, MOCK)
    assert before.pid is not None
    front = before.pid
    engine = mock_server(front)
    old = [front, *descendants(front)]
    os.kill(engine, signal.SIGKILL)

    def restarted() -> InstanceOut | None:
        inst = instance_of(ro, MOCK)
        ok = inst.observed_state == "ready" and inst.pid not in (None, front)
        return inst if ok else None

    after = wait_for("the instance restarted and ready", restarted, 120)
    assert after.restart_count == before.restart_count + 1
    assert after.last_exit is not None
    assert not alive(old), [(p, cmdline(p)) for p in alive(old)]
    assert after.pid is not None
    mock_server(after.pid)  # one engine under the new front
    routed(ro)
    done = client_of(ro).completions.create(model=MOCK, prompt="Hello", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens == 4


@dataclass
class Stream:
    """A long streamed chat completion read in a thread; what arrived, and when it ended."""

    client: openai.OpenAI
    tokens: int
    first: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    chunks: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._read, daemon=True)
        thread.start()
        return thread

    def _read(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MOCK, messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=self.tokens, stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                self.chunks.append(chunk)
                self.first.set()
        except BaseException as exc:  # the test reports it
            self.error = exc
        finally:
            self.ended.set()
            self.first.set()


def test_scaling_to_zero_drains_a_streamed_request_to_its_end(command_fleet: RolloutFleet) -> None:
    ro = command_fleet
    inst = ready_instance(ro, MOCK)
    assert inst.pid is not None
    processes = [inst.pid, *descendants(inst.pid)]
    # 800 tokens at 10 ms: eight seconds of stream, while the drain reaches the engine.
    stream = Stream(client_of(ro), tokens=800)
    reader = stream.start()
    assert stream.first.wait(30) and stream.error is None, stream.error
    result = ro.dctl("deploy", "scale", MOCK, "0")
    assert result.returncode == 0, result.stdout + result.stderr
    wait_for("the drain signal", lambda: "draining: SIGTERM" in instance_log(ro, inst), 30)
    assert not stream.ended.is_set()  # the engine got SIGTERM mid-stream
    reader.join(60)
    assert stream.error is None, stream.error
    usage = [c.usage for c in stream.chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 800
    assert any(c.choices and c.choices[0].finish_reason for c in stream.chunks)
    wait_for("the instance gone", lambda: not ro.api.get_deployment(MOCK).instances, 60)
    wait_for("its processes gone", lambda: not alive(processes), 30)
    assert "Server Stopped" in instance_log(ro, inst)  # the mock server's own clean exit


def test_a_missing_program_fails_the_instance_naming_it(
    command_fleet: RolloutFleet, tmp_path: Path
) -> None:
    ro = command_fleet
    command = ["/nonexistent/server", "--host", "{host}", "--port", "{port}"]
    missing = {"engine": {"kind": "command", "command": command}}
    config = write_config(tmp_path / "missing.yaml", missing)
    result = ro.dctl(
        "deploy", "create", "broken", "--model", "demo:v1", "--hosts", HOST,
        "--gpus-per-instance", "1", "--engine-config", str(config),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

    def failed_instance() -> InstanceOut | None:
        inst = instance_of(ro, "broken")
        return inst if inst.observed_state == "failed" else None

    failed = wait_for("the instance failed", failed_instance, 60)
    assert "/nonexistent/server" in failed.message, failed.message
    assert failed.pid is None and failed.restart_count == 0
    # Not retried: while the agent sends four more heartbeats (a restart would come after a
    # second of backoff), it stays failed and nothing is started.
    failed_by = ro.api.get_host(HOST).last_seen_at
    states = set()

    def later_heartbeats() -> bool:
        inst = instance_of(ro, "broken")
        states.add((inst.observed_state, inst.restart_count, inst.pid))
        return bool(ro.api.get_host(HOST).last_seen_at - failed_by >= timedelta(seconds=4))

    wait_for("four more heartbeats", later_heartbeats, 30)
    assert states == {("failed", 0, None)}
    shown = ro.dctl("deploy", "show", "broken")
    assert "/nonexistent/server" in shown.stdout, shown.stdout
    deleted = ro.dctl("deploy", "delete", "broken", "--yes")
    assert deleted.returncode == 0, deleted.stderr


def test_a_rollout_from_the_dctl_engine_to_the_command_engine_is_judged_on_the_gateway(
    command_fleet: RolloutFleet, tmp_path: Path
) -> None:
    ro = command_fleet
    config = write_config(tmp_path / "command.yaml", COMMAND_CONFIG)
    start = time.monotonic()
    result = ro.dctl(
        "rollout", "demo", "--engine-config", str(config), "--canary", "50",
        "--interval", f"{INTERVAL_S}s", "--min-requests", "10",
        "--max-latency-ratio", "20", "--max-ttft-ratio", "20", "--wait", timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + ro.fleet.stack.diagnostics()
    out = status(ro)
    assert out.state == RolloutState.PROMOTED and out.from_ == "demo:v1", out
    assert out.to.startswith("demo:v1-config-"), out.to
    # The step held until an interval passed (a first one may be starved or inconclusive); none
    # failed.
    verdicts = [a.verdict for a in out.analyses]
    assert verdicts and verdicts[-1] == "pass" and "fail" not in verdicts, verdicts
    for analysis in out.analyses:
        rows = {m.metric: m for m in analysis.metrics}
        # The diffusion figures: the command engine has none, and they never pass.
        for metric in ("steps per block", "tokens per forward"):
            assert rows[metric].verdict in ("n/a", "inconclusive"), rows[metric]
            assert rows[metric].canary is None and "command" in rows[metric].note
    # Judged on the gateway's figures of both pools.
    passed = {m.metric: m for m in out.analyses[-1].metrics}
    assert min(out.analyses[-1].canary_requests, out.analyses[-1].stable_requests) >= 10
    for metric in ("error rate", "p95 latency", "p95 TTFT"):
        row = passed[metric]
        assert row.verdict == "pass" and row.stable is not None and row.canary is not None, row
    instances = demo_runs(ro, "agent.backends.fronted")
    assert {i.version for i in instances} == {out.to.split(":", 1)[1]}
    assert all(i.pid is not None and mock_server(i.pid) for i in instances)
    assert ro.api.get_deployment("demo").engine_config == COMMAND_CONFIG
    answers = ro.load.since(start)
    assert answers and all(a.status == 200 for a in answers), [
        a for a in answers if a.status != 200
    ][:5]
    assert {a.version for a in answers} == {"demo:v1", out.to}


def test_a_rollback_to_the_dctl_engine_serves_and_fails_no_request(
    command_fleet: RolloutFleet,
) -> None:
    ro = command_fleet
    start = time.monotonic()
    result = ro.dctl("rollback", "demo", "--reason", "e2e")
    assert result.returncode == 0, result.stdout + result.stderr
    out = status(ro)
    assert (out.kind, out.state, out.to) == ("rollback", RolloutState.ROLLED_BACK, "demo:v1")
    assert "engine" not in ro.api.get_deployment("demo").engine_config  # the dctl engine's
    instances = demo_runs(ro, "engine.serve")
    assert {i.version for i in instances} == {"v1"}
    settled = time.monotonic()
    wait_for("answers from the dctl engines", lambda: len(ro.load.since(settled)) >= 10, 60)
    served = ro.load.since(settled)
    assert {(a.status, a.version) for a in served} == {(200, "demo:v1")}
    # The rollback replaces one instance at a time, so the other serves meanwhile.
    failed = [a for a in ro.load.since(start) if a.status != 200]
    assert not failed, f"{len(failed)} requests failed during the rollback: {failed[:3]}"


def _settled(traffic: Callable[[], list[Any]]) -> Callable[[], dict[str, Any] | None]:
    """A condition: the first version's figures, once two reads 3 s apart agree (and exist)."""
    last: list[Any] = []

    def check() -> dict[str, Any] | None:
        versions = traffic()
        now = dict(versions[0]) if versions else None
        if now is not None and last and last[0] == now:
            return now
        last[:] = [now]
        time.sleep(3)
        return None

    return check
