"""The field's own clients, unchanged, against the real fleet: GuideLLM (the benchmark client
serving teams run before they trust a server) through the gateway and straight at one engine,
and the LiteLLM SDK through the gateway.

GuideLLM runs with its defaults (chat completions, streamed, `/health` checked first, the vLLM
extensions `ignore_eos` and `stream_options.continuous_usage_stats` sent); only what a user
must say is given: the target, model and key, the demo checkpoint's tokenizer, synthetic data
with fixed prompt and output lengths, and a short synchronous and concurrent profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.gateway_e2e.conftest import Fleet

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
# (profile, requests): short, so the four runs take well under two minutes on two cores.
PROFILES = [("kind=synchronous", 6), ("kind=concurrent,streams=4", 12)]
GUIDELLM = Path(sys.executable).parent / "guidellm"
GUIDELLM_TIMEOUT_S = 240


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
