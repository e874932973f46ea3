"""The field's own clients, unchanged, against the real fleet: GuideLLM (the benchmark client
serving teams run before they trust a server) through the gateway and straight at one engine,
the LiteLLM SDK through the gateway, and a LiteLLM proxy (a company-wide router) with the
gateway as its OpenAI-compatible upstream.

GuideLLM runs with its defaults (chat completions, streamed, `/health` checked first, the vLLM
extensions `ignore_eos` and `stream_options.continuous_usage_stats` sent); only what a user
must say is given: the target, model and key, the demo checkpoint's tokenizer, synthetic data
with fixed prompt and output lengths, and a short synchronous and concurrent profile.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.agent_e2e.conftest import free_port, wait_for
from tests.gateway_e2e.conftest import Fleet
from tests.processes import stop

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
# (profile, requests): short, so the four runs take well under two minutes on two cores.
PROFILES = [("kind=synchronous", 6), ("kind=concurrent,streams=4", 12)]
GUIDELLM = Path(sys.executable).parent / "guidellm"
GUIDELLM_TIMEOUT_S = 240
LITELLM_PROXY = Path(sys.executable).parent / "litellm"
# It imports its whole server before it listens: 6 to 10 s here, more on two busy cores.
LITELLM_PROXY_START_S = 120


def run_guidellm(
    target: str, api_key: str, tokenizer: Path, profile: str, requests: int, out: Path
) -> dict[str, Any]:
    """One `guidellm run`; returns its JSON report's one benchmark (the console output is kept
    beside it, for the figures the README quotes)."""
    argv = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={target},model=demo,api_key={api_key}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={requests}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=GUIDELLM_TIMEOUT_S, env=env, check=False
    )
    out.with_suffix(".console.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return dict(benchmark)


def assert_clean_run(benchmark: dict[str, Any], requests: int) -> None:
    """0 errors, every request done, each with exactly the output tokens it asked for."""
    done = benchmark["requests"]
    assert done["errored"] == [] and done["incomplete"] == [], done["errored"][:1]
    assert len(done["successful"]) == requests
    for request in done["successful"]:
        sent = json.loads(request["request_args"])["body"]
        assert sent["ignore_eos"] is True  # GuideLLM's own extension, honoured
        assert sent["max_completion_tokens"] == OUTPUT_TOKENS
        assert request["output_tokens"] == OUTPUT_TOKENS
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS


def engine_target(fleet: Fleet) -> tuple[str, str]:
    """The stable engine's URL and the API key the agent gave it."""
    (inst,) = [
        i
        for i in fleet.api.get_deployment("demo").instances
        if i.version == "v1" and i.observed_state == "ready"
    ]
    config = fleet.stack.agent_data() / "agent" / "run" / f"instance-{inst.id}.yaml"
    key = yaml.safe_load(config.read_text())["service"]["api_key"]
    return f"http://127.0.0.1:{inst.port}", str(key)


@pytest.mark.parametrize(("profile", "requests"), PROFILES, ids=["synchronous", "concurrent"])
@pytest.mark.parametrize("through", ["gateway", "engine"])
def test_guidellm_runs_clean_with_its_defaults(
    fleet: Fleet, tmp_path: Path, through: str, profile: str, requests: int
) -> None:
    if through == "gateway":
        target, key = fleet.gateways[0].url, fleet.client_token
    else:
        target, key = engine_target(fleet)
    tokenizer = fleet.stack.home / "ckpt-v1"
    out = tmp_path / f"guidellm-{through}.json"
    benchmark = run_guidellm(target, key, tokenizer, profile, requests, out)
    assert_clean_run(benchmark, requests)


def litellm_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    # The SDK would otherwise fetch its model price list from the internet on import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def test_litellm_sdk_completes_and_streams_through_the_gateway(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    litellm = litellm_module(monkeypatch)
    common = {
        "model": "openai/demo",
        "api_base": f"{fleet.gateways[0].url}/v1",
        "api_key": fleet.client_token,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8,
    }
    answer = litellm.completion(**common)
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert 1 <= answer.usage.completion_tokens <= 8
    text = []
    for chunk in litellm.completion(**common, stream=True):
        text.append(chunk.choices[0].delta.content or "")
    assert "".join(text)  # the tiny random model still says something


@dataclass
class LiteLLMProxy:
    """A running `litellm` proxy process whose one model, `demo`, is the gateway's."""

    url: str
    master_key: str


@pytest.fixture
def litellm_proxy(fleet: Fleet, tmp_path: Path) -> Iterator[LiteLLMProxy]:
    """The proxy as its docs set it up: a config file listing the gateway as an `openai/`
    upstream with a client token, and a master key (it refuses to start without one). No
    database: the master key alone authenticates, as in a stateless router."""
    master_key = f"sk-{secrets.token_hex(16)}"
    config = {
        "model_list": [
            {
                "model_name": "demo",
                "litellm_params": {
                    "model": "openai/demo",
                    "api_base": f"{fleet.gateways[0].url}/v1",
                    "api_key": fleet.client_token,
                },
            }
        ],
        "general_settings": {"master_key": master_key},
    }
    config_file = tmp_path / "litellm.yaml"
    config_file.write_text(yaml.safe_dump(config))
    port, log = free_port(), tmp_path / "litellm-proxy.log"
    argv = [str(LITELLM_PROXY), "--config", str(config_file),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    # The price list from disk, not the internet; no key or database from the environment.
    env = {k: v for k, v in os.environ.items() if k not in {"LITELLM_MASTER_KEY", "DATABASE_URL"}}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    proxy = LiteLLMProxy(f"http://127.0.0.1:{port}", master_key)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"litellm exited: {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{proxy.url}/health/readiness", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for("the LiteLLM proxy to be ready", ready, LITELLM_PROXY_START_S)
        yield proxy
    finally:
        stop(proc, timeout_s=30)


def assert_through_the_gateway(fleet: Fleet, headers: Mapping[str, str]) -> None:
    """The proxy passes the upstream's headers on under `llm_provider-`: the gateway's own
    show that it, not something else at that address, chose the engine."""
    assert headers["x-litellm-model-api-base"] == f"{fleet.gateways[0].url}/v1"
    assert headers["llm_provider-x-dctl-version"] in {"demo:v1", "demo:v2"}
    instances = {i.id for i in fleet.api.get_deployment("demo").instances}
    assert int(headers["llm_provider-x-dctl-instance"]) in instances


def test_a_litellm_proxy_forwards_chat_to_the_gateway_streamed_and_not(
    fleet: Fleet, litellm_proxy: LiteLLMProxy
) -> None:
    client = openai.OpenAI(base_url=f"{litellm_proxy.url}/v1", api_key=litellm_proxy.master_key)
    request: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8,
    }
    raw = client.chat.completions.with_raw_response.create(**request)
    assert_through_the_gateway(fleet, raw.headers)
    answer = raw.parse()
    assert answer.choices[0].message.content  # the tiny random model still says something
    assert answer.choices[0].finish_reason in {"stop", "length"}
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens >= 1
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    with client.chat.completions.with_streaming_response.create(
        **request, stream=True, stream_options={"include_usage": True}
    ) as streamed:
        assert_through_the_gateway(fleet, streamed.headers)
        chunks = list(streamed.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"stop", "length"}
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.prompt_tokens >= 1 and 1 <= usage.completion_tokens <= 8
