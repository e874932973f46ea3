"""Engine /metrics -> heartbeat deltas, from real prometheus_client exposition text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agent.engine_metrics import EngineMetricsTracker, parse_metrics


class FakeEngine:
    """The shape of the engine's dllm_ metrics, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.tokens = Counter("dllm_generated_tokens", "t", registry=r)
        self.errors = Counter("dllm_request_errors", "e", ["reason"], registry=r)
        self.ttft = Histogram("dllm_time_to_first_token_seconds", "h", buckets=(0.1, 1), registry=r)
        self.running = Gauge("dllm_requests_running", "g", registry=r)
        self.experts = Counter("dllm_expert_tokens", "x", ["layer", "expert"], registry=r)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_separates_counters_histograms_and_gauges() -> None:
    engine = FakeEngine()
    engine.tokens.inc(5)
    engine.errors.labels(reason="queue_full").inc()
    engine.ttft.observe(0.05)
    engine.running.set(2)
    engine.experts.labels(layer="0", expert="3").inc(9)
    scrape = parse_metrics(engine.text())
    assert scrape.counters["dllm_generated_tokens_total"] == 5
    assert scrape.counters['dllm_request_errors_total{reason="queue_full"}'] == 1
    assert scrape.histograms["dllm_time_to_first_token_seconds"].buckets == {
        "0.1": 1, "1.0": 1, "+Inf": 1}  # fmt: skip
    assert scrape.gauges["dllm_requests_running"] == 2
    assert not any("expert" in key for key in scrape.counters)


def test_samples_that_are_not_finite_stay_out_of_the_heartbeat() -> None:
    # The control plane refuses NaN and Infinity in a heartbeat: one such gauge of an engine
    # (any engine: the agent runs other engines' commands too) must not stop them all.
    engine = FakeEngine()
    engine.running.set(float("nan"))
    engine.tokens.inc(3)
    odd = Gauge("dllm_kv_headroom", "g", registry=engine.registry)
    odd.set(float("inf"))
    tracker = EngineMetricsTracker()
    tracker.record(1, engine.text())
    [delta] = tracker.deltas()
    assert "dllm_requests_running" not in delta.gauges
    assert "dllm_kv_headroom" not in delta.gauges
    assert delta.counters["dllm_generated_tokens_total"] == 3


def test_deltas_accumulate_until_acknowledged_and_survive_engine_restart() -> None:
    engine = FakeEngine()
    tracker = EngineMetricsTracker()
    engine.tokens.inc(10)
    engine.ttft.observe(0.5)
    tracker.record(1, engine.text())
    tracker.acknowledge()
    engine.tokens.inc(3)
    tracker.record(1, engine.text())
    engine.tokens.inc(4)  # heartbeat failed in between: nothing acknowledged
    engine.ttft.observe(0.05)
    tracker.record(1, engine.text())
    [delta] = tracker.deltas()
    assert delta.counters["dllm_generated_tokens_total"] == 7
    hist = delta.histograms["dllm_time_to_first_token_seconds"]
    assert hist.count == 1 and hist.buckets["0.1"] == 1 and hist.buckets["1.0"] == 1
    tracker.acknowledge()
    restarted = FakeEngine()  # counters start from zero again
    restarted.tokens.inc(2)
    tracker.record(1, restarted.text())
    assert tracker.deltas()[0].counters["dllm_generated_tokens_total"] == 2


def test_the_engines_denoise_step_histogram_travels_per_block_size() -> None:
    from engine.metrics import EngineMetrics

    engine = EngineMetrics()
    tracker = EngineMetricsTracker()
    engine.denoise_step.labels(block_size="4").observe(0.02)
    tracker.record(1, generate_latest(engine.registry).decode())
    tracker.acknowledge()
    engine.denoise_step.labels(block_size="4").observe(0.03)
    engine.denoise_step.labels(block_size="8").observe(2.0)
    tracker.record(1, generate_latest(engine.registry).decode())
    [delta] = tracker.deltas()
    four, eight = (
        delta.histograms[f'dllm_denoise_step_seconds{{block_size="{b}"}}'] for b in (4, 8)
    )
    assert (four.count, round(four.sum, 6)) == (1, 0.03)
    assert four.buckets["0.03"] == 1 and four.buckets["0.02"] == 0
    assert (eight.count, eight.sum, eight.buckets["1.0"], eight.buckets["2.0"]) == (1, 2.0, 0, 1)


def test_expert_tokens_travel_as_each_layers_load_skew_over_the_interval() -> None:
    engine = FakeEngine()
    tracker = EngineMetricsTracker()
    for expert, tokens in enumerate([100, 100, 100, 100]):  # balanced before
        engine.experts.labels(layer="0", expert=str(expert)).inc(tokens)
    tracker.record(1, engine.text())
    tracker.acknowledge()
    # This interval: expert 2 takes 60 of 100 tokens in layer 0; layer 1 routed nothing new.
    for expert, tokens in enumerate([10, 20, 60, 10]):
        engine.experts.labels(layer="0", expert=str(expert)).inc(tokens)
    engine.experts.labels(layer="1", expert="0").inc(0)
    tracker.record(1, engine.text())
    [delta] = tracker.deltas()
    assert delta.gauges['dllm_expert_load_skew{layer="0"}'] == 2.4  # 60 / mean 25
    assert delta.gauges['dllm_expert_load_hot_expert{layer="0"}'] == 2
    assert 'dllm_expert_load_skew{layer="1"}' not in delta.gauges
    assert not any("expert=" in key for key in delta.counters)  # never per expert
