"""Other engines under the agent: the command lines it builds, where their keys go, what it
checks before a start, and how their metrics reach the heartbeat."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.backends.launch import engine_of, plan_launch, probes, saved_api_key
from agent.backends.presence import EnginePresence
from agent.engine_metrics import EngineMetricsTracker, parse_metrics
from agent.instance_spec import InstanceSpec, SupervisorPolicy
from agent.supervisor import Supervisor
from protocol.engine_config import ServeConfigError
from protocol.wire import InstanceState
from tests.agent.fakes import FakeLauncher, Health
from tests.clock import FakeClock

KEY = "inst-key-7f3a9c"
PY = "/opt/venv/bin/python"


def server_spec(engine: dict, gpus: tuple[int, ...] = (0,), **sections: dict) -> InstanceSpec:
    return InstanceSpec(
        instance_id=3, deployment="chat", digest="d" * 64, snapshot_path="/snaps/qwen",
        port=9003, gpu_indices=gpus, engine_config={"engine": engine, **sections},
        bind_address="10.0.0.5", api_key=KEY,
    )  # fmt: skip


def plan(spec: InstanceSpec, tmp_path: Path):  # type: ignore[no-untyped-def]
    return plan_launch(spec, tmp_path / "instance-3.yaml", ["engine-bin"], lambda: 41000)


# --- vLLM and SGLang: golden command lines ---------------------------------------------------


def test_vllm_on_one_gpu_with_a_bf16_model(tmp_path: Path) -> None:
    spec = server_spec(
        {"kind": "vllm", "python": PY},
        model={"dtype": "bf16", "max_seq_len": 8192},
        service={"max_concurrent_requests": 64},
        resources={"memory_fraction": 0.9},
    )
    launch = plan(spec, tmp_path)
    config = str(tmp_path / "instance-3.yaml")
    assert launch.argv == [
        PY, "-m", "vllm.entrypoints.cli.main", "serve", "/snaps/qwen",
        "--served-model-name", "chat", "--host", "10.0.0.5", "--port", "9003",
        "--tensor-parallel-size", "1", "--dtype", "bfloat16", "--max-model-len", "8192",
        "--max-num-seqs", "64", "--gpu-memory-utilization", "0.9", "--config", config,
    ]  # fmt: skip
    assert launch.env == {}
    assert yaml.safe_load(launch.files[Path(config)]) == {
        "api-key": KEY, "served-model-name": "chat"
    }  # fmt: skip
    assert launch.marker == config


def test_vllm_on_eight_gpus_with_extra_arguments(tmp_path: Path) -> None:
    spec = server_spec(
        {
            "kind": "vllm",
            "extra_args": ["--enable-prefix-caching", "--max-num-seqs=8"],
        },
        gpus=tuple(range(8)),
    )
    argv = plan(spec, tmp_path).argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert argv[0] == sys.executable  # no engine.python: the agent's own interpreter
    assert argv[-2:] == ["--enable-prefix-caching", "--max-num-seqs=8"]
    assert "--dtype" not in argv  # not set: the server's own default, not ours


def test_sglang_on_one_and_eight_gpus(tmp_path: Path) -> None:
    one = plan(server_spec({"kind": "sglang", "python": PY}, model={"dtype": "bf16"}), tmp_path)
    config = str(tmp_path / "instance-3.yaml")
    assert one.argv == [
        PY, "-m", "sglang.launch_server", "--model-path", "/snaps/qwen",
        "--served-model-name", "chat", "--host", "10.0.0.5", "--port", "9003",
        "--tp-size", "1", "--enable-metrics", "--dtype", "bfloat16", "--config", config,
    ]  # fmt: skip
    eight = plan(
        server_spec(
            {"kind": "sglang", "extra_args": ["--enable-torch-compile"]},
            gpus=tuple(range(8)),
            model={"max_seq_len": 32768},
            service={"max_concurrent_requests": 128},
            resources={"memory_fraction": 0.8},
        ),
        tmp_path,
    ).argv
    assert eight[eight.index("--tp-size") + 1] == "8"
    assert eight[eight.index("--context-length") + 1] == "32768"
    assert eight[eight.index("--max-running-requests") + 1] == "128"
    assert eight[eight.index("--mem-fraction-static") + 1] == "0.8"
    assert eight[-1] == "--enable-torch-compile"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_key_is_never_on_the_command_line_or_in_the_environment(
    kind: str, tmp_path: Path
) -> None:
    launch = plan(server_spec({"kind": kind}), tmp_path)
    assert not any(KEY in arg for arg in launch.argv)
    assert not any(KEY in value for value in launch.env.values())
    assert KEY in launch.files[tmp_path / "instance-3.yaml"]


def test_tls_reaches_vllm_as_its_ssl_flags(tmp_path: Path) -> None:
    spec = server_spec({"kind": "vllm"})
    spec = InstanceSpec(**{**spec.__dict__, "tls_cert": "/etc/dctl/c.pem", "tls_key": "/k.pem"})
    argv = plan(spec, tmp_path).argv
    assert argv[argv.index("--ssl-certfile") + 1] == "/etc/dctl/c.pem"
    assert argv[argv.index("--ssl-keyfile") + 1] == "/k.pem"


def test_a_key_another_kind_ignores_fails_the_instance_not_the_agent(tmp_path: Path) -> None:
    with pytest.raises(ServeConfigError, match=r"model\.threshold is a setting of the dctl engine"):
        plan(server_spec({"kind": "vllm"}, model={"threshold": 0.5}), tmp_path)


# --- command engines ---------------------------------------------------------------------------


def command_spec(**engine: object) -> InstanceSpec:
    template = ["my-server", "--bind", "{host}:{port}", "--weights", "{model_path}",
                "--name", "{served_name}", "--gpus", "{gpus}"]  # fmt: skip
    return server_spec({"kind": "command", "command": template, **engine}, gpus=(2, 3))


def test_a_command_that_checks_no_key_runs_on_loopback_behind_the_proxy(tmp_path: Path) -> None:
    launch = plan(command_spec(), tmp_path)
    config_path = tmp_path / "instance-3.yaml"
    assert launch.argv == [sys.executable, "-m", "agent.backends.fronted", "--config",
                           str(config_path)]  # fmt: skip
    front = yaml.safe_load(launch.files[config_path])
    assert front["argv"] == ["my-server", "--bind", "127.0.0.1:41000", "--weights",
                             "/snaps/qwen", "--name", "chat", "--gpus", "2"]  # fmt: skip
    assert front["proxy"] == {
        "host": "10.0.0.5", "port": 9003, "upstream_port": 41000, "api_key": KEY,
        "open_paths": ["/health", "/metrics"], "tls_cert": None, "tls_key": None,
    }  # fmt: skip
    assert "key-checking proxy" in launch.note


def test_a_command_that_reads_its_key_from_the_environment_listens_itself(
    tmp_path: Path,
) -> None:
    launch = plan(command_spec(api_key_env="SERVER_KEY", drain_signal="SIGINT"), tmp_path)
    front = yaml.safe_load(launch.files[tmp_path / "instance-3.yaml"])
    assert "proxy" not in front
    assert front["argv"][2] == "10.0.0.5:9003"
    assert front["env"] == {"SERVER_KEY": KEY}
    assert front["drain_signal"] == "SIGINT"
    assert not any(KEY in arg for arg in launch.argv + front["argv"])


def test_a_command_given_the_key_file_gets_a_private_file_and_its_path(tmp_path: Path) -> None:
    template = ["srv", "--host", "{host}", "--port", "{port}", "--api-key-file", "{api_key_file}"]
    spec = server_spec({"kind": "command", "command": template})
    launch = plan(spec, tmp_path)
    key_file = tmp_path / "instance-3.key"
    assert launch.files[key_file] == KEY
    front = yaml.safe_load(launch.files[tmp_path / "instance-3.yaml"])
    assert front["argv"][-1] == str(key_file)
    assert "proxy" not in front


def test_adoption_reads_each_kinds_key_back(tmp_path: Path) -> None:
    config_path = tmp_path / "instance-3.yaml"
    for spec in (server_spec({"kind": "vllm"}), command_spec(), command_spec(api_key_env="K")):
        for path, text in plan(spec, tmp_path).files.items():
            path.write_text(text)
        assert saved_api_key(engine_of(spec), config_path) == KEY


def test_probe_paths_follow_the_kind() -> None:
    command = engine_of(command_spec(ready_path="/v1/models", metrics_path=None))
    assert probes(command).ready == "/v1/models"
    assert probes(command).live == "/v1/models"
    assert probes(command).metrics is None
    assert probes(engine_of(server_spec({"kind": "sglang"}))).ready == "/health"


# --- presence ---------------------------------------------------------------------------------


def test_a_missing_module_names_what_to_install(tmp_path: Path) -> None:
    presence = EnginePresence(sys.executable, path="/usr/bin:/bin")
    answer = presence.check(engine_of(server_spec({"kind": "vllm"})))
    assert answer is not None and not answer.found
    assert f"vllm is not installed for {sys.executable}" in answer.text
    assert "pip install vllm" in answer.text and "engine.python" in answer.text


def test_a_present_module_gives_its_version() -> None:
    calls: list[list[str]] = []

    def runner(argv: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "0.11.2\n", "")

    clock = FakeClock()
    presence = EnginePresence("/py", runner=runner, clock=clock.monotonic)
    engine = engine_of(server_spec({"kind": "sglang", "python": PY}))
    answer = presence.check(engine)
    assert answer is not None and answer.found and answer.text == f"sglang 0.11.2 ({PY})"
    assert calls[0][0] == PY and calls[0][-1] == "sglang"
    presence.check(engine)
    assert len(calls) == 1  # kept a minute
    clock.advance(61)
    presence.check(engine)
    assert len(calls) == 2


def test_a_missing_program_is_named() -> None:
    presence = EnginePresence(sys.executable, path="/nonexistent")
    answer = presence.check(engine_of(command_spec()))
    assert answer is not None and not answer.found
    assert "'my-server' is not on the agent's PATH" in answer.text


def test_an_instance_whose_engine_is_missing_fails_once_and_does_not_crash_loop(
    tmp_path: Path,
) -> None:
    launcher, clock, health = FakeLauncher(), FakeClock(), Health()
    sup = Supervisor(
        tmp_path / "run", launcher, health, clock=clock.monotonic,
        policy=SupervisorPolicy(probe_interval_s=1), env={"PATH": "/nonexistent"},
    )  # fmt: skip
    spec = command_spec()
    sup.ensure(spec)
    assert sup.state_of(3) == InstanceState.FAILED
    observed = sup.observed()[0]
    assert "engine not found" in observed.message and "my-server" in observed.message
    for _ in range(5):
        clock.advance(10)
        sup.tick()
        sup.ensure(spec)  # every heartbeat repeats the desired state
    assert launcher.launched == []
    assert sup.state_of(3) == InstanceState.FAILED


def test_the_supervisor_writes_every_file_private_and_probes_the_kinds_paths(
    tmp_path: Path,
) -> None:
    launcher, clock = FakeLauncher(), FakeClock()
    probed: list[str] = []

    def health(host: str, port: int, path: str) -> bool:
        probed.append(path)
        return (host, port, path) == ("10.0.0.5", 9003, "/ping")

    program = tmp_path / "bin" / "my-server"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    sup = Supervisor(
        tmp_path / "run", launcher, health, clock=clock.monotonic,
        policy=SupervisorPolicy(probe_interval_s=1), env={"PATH": str(program.parent)},
    )  # fmt: skip
    sup.ensure(command_spec(ready_path="/ping", metrics_path="/stats"))
    assert sup.state_of(3) == InstanceState.STARTING
    config = sup.config_path(3)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    sup.tick()
    assert sup.state_of(3) == InstanceState.READY
    assert probed == ["/ping"]
    assert sup.ready_endpoints() == {3: ("10.0.0.5", 9003, "/stats")}


# --- metrics ----------------------------------------------------------------------------------

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 3.0
vllm:num_requests_running{engine="1",model_name="chat"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="chat"} 4.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="chat"} 900.0
vllm:generation_tokens_total{engine="1",model_name="chat"} 100.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="chat"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="chat"} 2.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="chat"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="chat"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="chat"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="chat"} 1.5
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="chat"} 0.4
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12.0
"""

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="chat",tp_rank="0"} 6.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="chat",tp_rank="0"} 1.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="chat"} 4096.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="chat",tp_rank="0"} 0.2
"""


def test_vllm_figures_arrive_under_the_dctl_names_added_over_its_engine_cores() -> None:
    scrape = parse_metrics(VLLM_PAGE)
    assert scrape.gauges == {"dllm_requests_running": 5.0, "dllm_requests_waiting": 4.0}
    assert scrape.counters["dllm_generated_tokens_total"] == 1000.0
    assert scrape.counters['dllm_requests_finished_total{finish_reason="stop"}'] == 7.0
    assert scrape.counters['dllm_requests_finished_total{finish_reason="length"}'] == 2.0
    ttft = scrape.histograms["dllm_time_to_first_token_seconds"]
    assert ttft.count == 9.0 and ttft.sum == 1.5 and ttft.buckets == {"0.1": 5.0, "+Inf": 9.0}
    # vLLM's own other series stay on its /metrics; the process's generic ones pass as before.
    assert not any("vllm" in key for key in [*scrape.gauges, *scrape.counters])
    assert 'python_gc_objects_collected_total{generation="0"}' in scrape.counters


def test_sglang_figures_arrive_under_the_dctl_names() -> None:
    scrape = parse_metrics(SGLANG_PAGE)
    assert scrape.gauges == {"dllm_requests_running": 6.0, "dllm_requests_waiting": 1.0}
    assert scrape.counters == {"dllm_prompt_tokens_total": 4096.0}


def test_the_heartbeat_of_another_engine_has_no_diffusion_figures() -> None:
    tracker = EngineMetricsTracker()
    tracker.record(3, VLLM_PAGE)
    (metrics,) = tracker.deltas()
    assert tracker.latest_gauge(3, "dllm_requests_running") == 5.0
    assert not any(k.startswith(("dllm_denoising", "dllm_tokens_per_forward"))
                   for k in metrics.histograms)  # fmt: skip
