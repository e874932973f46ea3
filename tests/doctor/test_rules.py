"""The doctor's rules stated with figures: a snapshot in, findings out (no server, no I/O)."""

from __future__ import annotations

from doctor import diagnose, hardware, has_error, load, serving, uptime
from doctor.findings import FleetSnapshot, Points
from protocol.gateway import DeploymentTraffic, VersionTraffic
from protocol.version_ref import VersionRef
from protocol.wire import HostFacts, MemoryPlan, PreflightCheck, SnapshotFailure
from tests.doctor.builders import (
    GIB,
    T0,
    deployment,
    exited,
    fleet,
    gpu,
    host,
    instance,
    points,
    version,
)

WAITING, RUNNING = "dllm_requests_waiting", "dllm_requests_running"
FULL = 'dllm_request_errors_total{reason="queue_full"}'
TIMEOUT = 'dllm_request_errors_total{reason="timeout"}'
DONE = 'dllm_requests_finished_total{finish_reason="stop"}'


def test_a_healthy_fleet_has_no_findings() -> None:
    series = {1: {WAITING: points(0, 1, 0), RUNNING: points(3, 3, 3), DONE: points(50, 50),
                  FULL: points(0, 0)}}  # fmt: skip
    assert diagnose(fleet(deployment(instance(1)), series=series)) == []


def test_a_corrupt_snapshot_names_its_file() -> None:
    error = ("snapshot aaaaaaaaaaaa: file shards/model.safetensors does not match the manifest "
             "(expected 1f.., got 9c..); the source is corrupt")  # fmt: skip
    facts = HostFacts(snapshot_failures=[SnapshotFailure(digest="a" * 64, error=error)])
    [found] = load.snapshot_failures(fleet(deployment(instance(1)), host(facts=facts)))
    assert found.severity == "error" and found.subject == "host/gpu-1"
    assert found.evidence["file"] == "shards/model.safetensors"
    assert found.evidence["version"] == "demo:v1"


def test_a_failure_of_another_version_is_not_ours() -> None:
    facts = HostFacts(snapshot_failures=[SnapshotFailure(digest="b" * 64, error="file x: bad")])
    assert load.snapshot_failures(fleet(deployment(instance(1)), host(facts=facts))) == []


def test_memory_plan_larger_than_the_gpus() -> None:
    # 150 GiB of weights + 2 MiB/token x 1 slot x 4096 tokens = 158 GiB; one 80 GiB GPU at
    # 0.85 = 68 GiB.
    plan = MemoryPlan(weights_bytes=150 * GIB, kv_bytes_per_token=2 * 2**20)
    config = {"service": {"max_concurrent_requests": 1}}
    snap = fleet(deployment(instance(1), gpus_per_instance=1, engine_config=config), host(gpus=4))
    snap.versions[VersionRef("demo", "v1")] = version(plan)
    [found] = load.memory_plan(snap)
    assert found.severity == "error"
    assert found.evidence["needed_gib"] == 158.0 and found.evidence["available_gib"] == 68.0
    assert "--gpus-per-instance 3" in found.fix  # 158 / 68 -> 3 GPUs
    assert "INT8" in found.fix and "expert parallelism" in found.fix


def test_memory_plan_that_fits_says_nothing() -> None:
    # 20 GiB + 1 KiB x 32 slots x 4096 tokens = 20.1 GiB on 2 x 80 GiB x 0.85 = 136 GiB.
    plan = MemoryPlan(weights_bytes=20 * GIB, kv_bytes_per_token=2**10)
    snap = fleet(deployment(instance(1)))
    snap.versions[VersionRef("demo", "v1")] = version(plan)
    assert load.memory_plan(snap) == []


def test_a_small_memory_fraction_makes_it_not_fit() -> None:
    # 2 x 80 GiB at 0.2 = 32 GiB < 40 GiB of weights; lowering max_seq_len cannot help.
    plan = MemoryPlan(weights_bytes=40 * GIB, kv_bytes_per_token=2**20)
    config = {"resources": {"memory_fraction": 0.2}}
    snap = fleet(deployment(instance(1), engine_config=config))
    snap.versions[VersionRef("demo", "v1")] = version(plan)
    [found] = load.memory_plan(snap)
    assert found.evidence["memory_fraction"] == 0.2 and found.evidence["available_gib"] == 32.0
    assert "raise resources.memory_fraction" in found.fix and "max_seq_len" not in found.fix


def test_kv_for_every_slot_is_what_does_not_fit() -> None:
    # 40 GiB of weights fit 2 x 80 GiB x 0.85 = 136 GiB; KV of 1 MiB x 32 slots x 4096 tokens
    # (128 GiB) does not: 96 GiB left hold 98304 tokens, 24 slots or 3072 tokens each.
    plan = MemoryPlan(weights_bytes=40 * GIB, kv_bytes_per_token=2**20)
    snap = fleet(deployment(instance(1)))
    snap.versions[VersionRef("demo", "v1")] = version(plan)
    [found] = load.memory_plan(snap)
    assert found.evidence["needed_gib"] == 168.0 and found.evidence["available_gib"] == 136.0
    assert "max_concurrent_requests to 24" in found.fix and "max_seq_len to 3072" in found.fix


def test_a_driver_cuda_mismatch_from_preflight() -> None:
    reason = ("driver supports CUDA 12.4 but torch was built for CUDA 12.8: upgrade the driver "
              "or install a torch build for CUDA <= 12.4")  # fmt: skip
    facts = HostFacts(preflight=[PreflightCheck(name="cuda_compat", status="fail", reason=reason)])
    [found] = load.preflight(fleet(deployment(), host(facts=facts)))
    assert found.severity == "error" and "driver/CUDA mismatch" in found.summary
    assert found.fix.startswith("upgrade the driver")


def test_a_crash_looping_instance() -> None:
    inst = instance(1, observed_state="crash_loop", restart_count=7, message="restarting in 300 s",
                    last_exit=exited("exited with code 1"))  # fmt: skip
    [found] = load.failed_instances(fleet(deployment(inst)))
    assert found.severity == "error"
    assert found.evidence["restart_count"] == 7 and found.evidence["exit_code"] == 1
    assert "instance-1.log" in found.fix


def test_an_unhealthy_instance_is_a_warning() -> None:
    inst = instance(1, observed_state="unhealthy", message="liveness probe failed")
    [found] = load.failed_instances(fleet(deployment(inst)))
    assert found.severity == "warning" and found.evidence["message"] == "liveness probe failed"


def test_a_silent_host_with_instances_is_an_error() -> None:
    silent = host(state="not_ready")
    [found] = hardware.host_silent(fleet(deployment(instance(1)), silent))
    assert found.severity == "error" and found.evidence["instances"] == 1
    assert found.evidence["state"] == "not_ready"


def test_readiness_slower_than_the_grace() -> None:
    why = "not ready within the start-up grace of 600 s"
    inst = instance(1, observed_state="backoff", restart_count=2, last_exit=exited(why, None))
    [found] = diagnose(fleet(deployment(inst)))
    assert found.rule == "load.readiness" and found.severity == "warning"
    assert found.evidence == {"startup_grace_s": 600.0, "restart_count": 2, "state": "backoff"}
    assert "--startup-grace-s 1200" in found.fix


def test_queue_overflow_share_of_requests() -> None:
    # 30 refused of 30 + 70 requests: 30 % >= 5 % -> error.
    series = {1: {FULL: points(10, 20), DONE: points(35, 35)}}
    snap = fleet(deployment(instance(1), engine_config={"service": {"max_queue": 2}}),
                 series=series)  # fmt: skip
    [found] = serving.overflow_and_timeouts(snap)
    assert found.rule == "serving.queue_overflow" and found.severity == "error"
    assert found.evidence["share"] == 0.3 and found.evidence["max_queue"] == 2
    assert "service.max_queue to 8" in found.fix and "dctl deploy scale web 2" in found.fix


def test_a_rare_429_is_a_warning_and_none_is_nothing() -> None:
    rare = fleet(deployment(instance(1)), series={1: {FULL: points(2), DONE: points(98)}})
    assert [f.severity for f in serving.overflow_and_timeouts(rare)] == ["warning"]
    none = fleet(deployment(instance(1)), series={1: {FULL: points(0), DONE: points(98)}})
    assert serving.overflow_and_timeouts(none) == []


def test_gateway_timeouts() -> None:
    counts = VersionTraffic(
        version_id=1, version="demo:v1", requests=200, errors_timeout=20, error_rate=0.1
    )
    traffic = DeploymentTraffic(deployment="web", since=T0, until=T0, step_s=10, gateways=1,
                                versions=[counts], series=[])  # fmt: skip
    snap = fleet(deployment(instance(1)), traffic={"web": traffic})
    [found] = serving.overflow_and_timeouts(snap)
    assert found.rule == "serving.timeouts" and found.severity == "error"
    assert found.evidence["timeouts_504"] == 20 and found.evidence["share"] == 0.1


def test_queue_depth_at_its_limit() -> None:
    config = {"service": {"max_queue": 10}}
    snap = fleet(deployment(instance(1), engine_config=config),
                 series={1: {WAITING: points(2, 9, 4)}})  # fmt: skip
    [found] = serving.queue_at_limit(snap)
    assert found.evidence == {"queue_depth_peak": 9, "max_queue": 10}


def test_slow_decoding_in_threshold_mode() -> None:
    # 1.2 tokens per forward, 26 of 32 positions as steps: threshold 0.95 lets little through.
    series = {1: {"dllm_tokens_per_forward_sum": points(12), "dllm_tokens_per_forward_count":
                  points(10), "dllm_denoising_steps_per_block_sum": points(260),
                  "dllm_denoising_steps_per_block_count": points(10)}}  # fmt: skip
    config = {"model": {"threshold": 0.95, "block_size": 32}}
    [found] = serving.slow_generation(fleet(deployment(instance(1), engine_config=config),
                                             series=series))  # fmt: skip
    assert found.evidence == {"threshold": 0.95, "block_size": 32, "tokens_per_forward": 1.2,
                              "steps_per_block": 26.0}  # fmt: skip
    assert "lower model.threshold (now 0.95; e.g. 0.85)" in found.fix


def test_idle_gpu_while_the_queue_grows() -> None:
    idle = host()
    idle.gpus = [gpu(0, utilization_percent=10.0), gpu(1, utilization_percent=14.0)]
    series = {1: {WAITING: points(1, 3, 6), RUNNING: points(2, 2, 2)}}
    [found] = serving.queue_vs_compute(fleet(deployment(instance(1)), idle, series=series))
    assert found.rule == "slow.gpu_idle_queue_growing"
    assert found.evidence["gpu_utilization_percent"] == 12.0
    assert (found.evidence["queue_first"], found.evidence["queue_last"]) == (1, 6)


def test_queue_wait_dominates_when_busy_gpus_have_a_long_queue() -> None:
    busy = host()
    busy.gpus = [gpu(0, utilization_percent=95.0), gpu(1, utilization_percent=95.0)]
    series = {1: {WAITING: points(20, 20), RUNNING: points(8, 8)}}
    [found] = serving.queue_vs_compute(fleet(deployment(instance(1)), busy, series=series))
    assert found.rule == "slow.queue_wait" and found.evidence == {"waiting": 20, "running": 8}


def test_one_gpu_hotter_and_busier_than_its_peers() -> None:
    hot = host(gpus=4)
    hot.gpus[2] = gpu(2, temperature_c=81.0, utilization_percent=99.0)
    found = hardware.gpu_outliers(fleet(deployment(), hot))
    assert [(f.rule, f.subject) for f in found] == [
        ("hardware.gpu_hot", "host/gpu-1/gpu2"),
        ("hardware.gpu_busy", "host/gpu-1/gpu2"),
    ]
    assert found[0].evidence == {"temperature_c": 81.0, "peer_median_c": 50.0}


def test_a_gpu_over_the_absolute_limit_is_hot_even_alone() -> None:
    alone = host(gpus=1)
    alone.gpus = [gpu(0, temperature_c=90.0)]
    [found] = hardware.gpu_outliers(fleet(deployment(), alone))
    assert found.evidence == {"temperature_c": 90.0, "peer_median_c": "?"}


def test_expert_load_skew_max_over_mean() -> None:
    # Per heartbeat interval the agent sent layer 1's max / mean: 2.4, 2.8, 2.8 (mean 2.67).
    series = {1: {'dllm_expert_load_skew{layer="1"}': points(2.4, 2.8, 2.8),
                  'dllm_expert_load_skew{layer="0"}': points(1.1, 1.2, 1.0),
                  'dllm_expert_load_hot_expert{layer="1"}': points(0, 0, 3)}}  # fmt: skip
    [found] = hardware.expert_skew(fleet(deployment(instance(1)), series=series))
    assert found.evidence == {"layer": "1", "max_over_mean": 2.67, "intervals": 3,
                              "expert": "3"}  # fmt: skip
    balanced = {1: {'dllm_expert_load_skew{layer="0"}': points(1.4, 1.6, 1.5)}}
    assert hardware.expert_skew(fleet(deployment(instance(1)), series=balanced)) == []


def _steps(total_s: float, count: float, buckets: int = 3) -> dict[str, Points]:
    name = 'dllm_denoise_step_seconds_{}{{block_size="32"}}'
    return {name.format("sum"): points(*[total_s / buckets] * buckets),
            name.format("count"): points(*[count / buckets] * buckets)}  # fmt: skip


def test_one_instance_steps_slower_than_the_fleet() -> None:
    # Peers' mean forwards: 10 ms and 12 ms (median 11 ms); instance 3: 30 ms, 2.73x.
    dep = deployment(instance(1), instance(2), instance(3))
    series = {1: _steps(1.0, 100), 2: _steps(1.2, 100), 3: _steps(3.0, 100)}
    [found] = hardware.step_jitter(fleet(dep, series=series))
    assert found.subject.startswith("instance/3")
    assert found.evidence["step_mean_ms"] == 30.0 and found.evidence["fleet_median_ms"] == 11.0
    assert found.evidence["ratio"] == 2.73


def test_erratic_steps_on_one_instance() -> None:
    name = 'dllm_denoise_step_seconds_{}{{block_size="32"}}'
    series = {1: {name.format("sum"): points(0.1, 0.5, 0.1, 0.9),
                  name.format("count"): points(10, 10, 10, 10)}}  # fmt: skip
    [found] = hardware.step_jitter(fleet(deployment(instance(1)), series=series))
    assert float(found.evidence["step_cv"]) >= 0.5 and "jittery" in found.summary


def test_latency_creeping_up_over_uptime() -> None:
    # Mean latency per bucket 1, 1, 1 s then 2, 2, 2 s: 2x over the window.
    series = {
        1: {
            "dllm_e2e_request_latency_seconds_sum": points(10, 10, 10, 20, 20, 20),
            "dllm_e2e_request_latency_seconds_count": points(10, 10, 10, 10, 10, 10),
        }
    }
    [found] = uptime.creeping(fleet(deployment(instance(1)), series=series))
    assert found.rule == "degradation.uptime" and found.evidence["ratio"] == 2.0
    assert "dctl restart web" in found.fix


def test_gpu_memory_creeping_up_but_not_a_load() -> None:
    growing = {"gpu0.memory_used_bytes": points(*[(40 + 4 * i) * GIB for i in range(6)])}
    loaded = {"gpu0.memory_used_bytes": points(*[1 * GIB] + [60 * GIB] * 5)}
    for gpu_series, expected in ((growing, 1), (loaded, 0)):
        snap = fleet(deployment(instance(1)), host_series={"gpu-1": gpu_series})
        assert len(uptime.creeping(snap)) == expected


def test_errors_first_and_the_exit_flag() -> None:
    inst = instance(1, observed_state="failed", message="engine config refused: bad key")
    snap: FleetSnapshot = fleet(deployment(inst), host(gpus=1))
    snap.hosts[0].gpus = [gpu(0, temperature_c=95.0)]
    found = diagnose(snap)
    assert [f.severity for f in found] == ["error", "warning"] and has_error(found)


def test_a_deployment_on_another_engine_is_told_which_figures_it_lacks() -> None:
    vllm = deployment(instance(1), engine_config={"engine": {"kind": "vllm"}})
    series = {1: {RUNNING: points(3, 3), WAITING: points(0, 0)}}
    (finding,) = [f for f in diagnose(fleet(vllm, series=series)) if f.rule == "engine.figures"]
    assert finding.severity == "info"
    assert "runs on the vllm engine" in finding.summary
    assert "no denoising steps per block, no tokens per forward" in finding.summary
    assert finding.evidence["figures_arriving"] == "yes"
    # A ready vLLM whose figures never arrive: the panels would read as an idle engine.
    (silent,) = [f for f in diagnose(fleet(vllm)) if f.rule == "engine.figures"]
    assert silent.severity == "warning" and "/metrics" in silent.fix
    # A command engine without metrics lacks the queue figures too, and that is expected.
    mock = {"kind": "command", "command": ["srv", "{host}", "{port}"], "metrics_path": None}
    command = deployment(instance(1), engine_config={"engine": mock})
    (quiet,) = [f for f in diagnose(fleet(command)) if f.rule == "engine.figures"]
    assert quiet.severity == "info"
    assert "no queue and running requests" in quiet.summary
    assert quiet.evidence["reported"] == "nothing (engine.metrics_path is null)"
    # The bundled engine reports everything: nothing to say.
    assert not [f for f in diagnose(fleet(deployment(instance(1)))) if f.rule == "engine.figures"]
