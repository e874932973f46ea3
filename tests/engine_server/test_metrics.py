"""/metrics, parsed with prometheus_client's parser, agrees with the requests we sent."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from engine import packing
from tests.engine_server.conftest import MODEL, ServerProcess


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counts_match_the_requests_sent(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    server.wait_idle()
    before = server.metrics()
    usages = []
    for prompt, max_tokens in [("Hello", 5), ("The river runs", 8), ("One two", 3)]:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        usages.append(result.usage)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6
    )
    usages.append(chat.usage)
    # Refusals, each counted under its reason.
    for body, status in [
        ({"model": MODEL, "prompt": "x", "threshold": 7}, 400),
        ({"model": MODEL, "prompt": [1, 2], "max_tokens": 5000}, 400),
        ({"model": "other", "prompt": "x"}, 404),
    ]:
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == status
    server.wait_idle()
    after = server.metrics()

    assert all(u is not None for u in usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages if u)
    completion_tokens = sum(u.completion_tokens for u in usages if u)
    assert delta(after, before, "dllm_prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "dllm_generated_tokens_total") == completion_tokens
    finished = sum(
        delta(after, before, f"dllm_requests_finished_total{{finish_reason={r}}}")
        for r in ("stop", "length")
    )
    assert finished == 4
    assert delta(after, before, "dllm_e2e_request_latency_seconds_count") == 4
    assert delta(after, before, "dllm_e2e_request_latency_seconds_sum") > 0
    assert delta(after, before, "dllm_time_to_first_token_seconds_count") == 4
    assert delta(after, before, "dllm_request_queue_seconds_count") == 4
    queue_s = delta(after, before, "dllm_request_queue_seconds_sum")
    assert 0 <= queue_s <= delta(after, before, "dllm_e2e_request_latency_seconds_sum")
    assert delta(after, before, "dllm_tokens_per_forward_count") == 4
    # One histogram sample per decoded block; 4 requests decode at least one block each.
    assert delta(after, before, "dllm_denoising_steps_per_block_count") >= 4
    assert delta(after, before, "dllm_batch_size_count") > 0
    assert delta(after, before, "dllm_request_errors_total{reason=invalid_request}") == 1
    assert delta(after, before, "dllm_request_errors_total{reason=context_length_exceeded}") == 1
    assert delta(after, before, "dllm_request_errors_total{reason=model_not_found}") == 1
    assert after["dllm_requests_running"] == 0


def test_gauges_model_info_and_expert_counts(server: ServerProcess) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    info = families["dllm_model_info"].samples[0]
    assert info.name == "dllm_model_info"
    assert info.labels["model"] == MODEL
    assert info.labels["snapshot_digest"] == "sha256:demo0"
    # The dtype activations are computed in, as the engine chose it for this CPU.
    assert (info.labels["dtype"], info.labels["compute_dtype"]) == ("float32", "float32")
    # packed_weights: auto packs fp32 projections, leaving the MoE's few-row ones to MKL on an
    # Intel CPU (the server runs on this machine).
    layout = "packed_except_experts" if packing.sgemm_leads_few_rows() else "packed"
    assert info.labels["weights_layout"] == layout
    assert families["dllm_kv_cache_total_bytes"].samples[0].value > 0
    # The shared server's service.max_queue, so alerts can say how full the queue is.
    assert families["dllm_max_queue"].samples[0].value == 4
    assert "dllm_kv_cache_used_bytes" in families
    experts = families["dllm_expert_tokens"].samples
    # The tiny demo model: 2 MoE layers x 4 experts, top-2 routing.
    assert {(s.labels["layer"], s.labels["expert"]) for s in experts} == {
        (str(layer), str(e)) for layer in range(2) for e in range(4)
    }
    per_layer = [sum(s.value for s in experts if s.labels["layer"] == str(i)) for i in range(2)]
    # Top-2 routing: every routed token adds 2. The last layer may route fewer tokens (its MLP
    # runs only where logits are needed), never more.
    assert all(total > 0 and total % 2 == 0 for total in per_layer)
    assert per_layer[0] >= per_layer[1]
    expected = {
        "dllm_requests_running", "dllm_requests_waiting", "dllm_tokens_per_forward",
        "dllm_denoising_steps_per_block", "dllm_time_to_first_token_seconds",
        "dllm_e2e_request_latency_seconds", "dllm_batch_size", "dllm_request_errors",
        "dllm_prompt_tokens", "dllm_generated_tokens", "dllm_requests_finished",
    }  # fmt: skip
    assert expected <= set(families)


def test_each_denoising_forward_is_timed_by_block_size(server: ServerProcess) -> None:
    server.wait_idle()
    before = server.metrics()
    body = {"model": MODEL, "prompt": "The river runs", "max_tokens": 8}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    server.wait_idle()
    after = server.metrics()
    # The demo checkpoint decodes in blocks of 4: 8 tokens are at least 2 blocks, each of at
    # least one denoising forward.
    key = "dllm_denoise_step_seconds_{}{{block_size=4}}"
    forwards = delta(after, before, key.format("count"))
    assert forwards >= 2
    assert 0 < delta(after, before, key.format("sum")) < 10 * forwards
    infinite = "dllm_denoise_step_seconds_bucket{block_size=4,le=+Inf}"
    assert delta(after, before, infinite) == forwards
    # Buckets span 1 ms to 10 s.
    for bound in ("0.001", "10.0"):
        assert f"dllm_denoise_step_seconds_bucket{{block_size=4,le={bound}}}" in after
