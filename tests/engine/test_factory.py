"""One factory builds every engine: `LLM`, the server and the tuner, given the same options,
run the same engine (weights, layout, cache) and decode a prompt to the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.errors import CheckpointError
from engine.factory import EngineOptions, build_engine
from engine.llm import LLM
from engine.metrics import EngineMetrics
from engine.params import SamplingParams
from engine.serve import engine_options, load_served_model
from engine.serving import ServedModel, ServerState
from engine.tuning.grid import DecodeSetting
from engine.tuning.measure import InProcessRunner
from protocol.engine_config import ServeConfig

MAX_TOKENS = 8
SETTING = DecodeSetting(4, threshold=0.5)


@pytest.fixture(autouse=True)
def threads_restored() -> Iterator[None]:
    # `threads` is a process-wide torch setting: leave it as found.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def serve_config(checkpoint: Path, max_seq_len: int) -> ServeConfig:
    """A server configuration asking for what the LLM and the tuner below ask for."""
    return ServeConfig.model_validate(
        {
            "model": {
                "path": str(checkpoint),
                "dtype": "bf16",
                "max_seq_len": max_seq_len,
                "resident_weights": "stored",  # the library's default
            },
            "service": {"max_concurrent_requests": 2},
            "resources": {"device": "cpu", "threads": 1},
        }
    )


async def serve_one(served: ServedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens the served engine generates for PROMPT."""
    updates = served.engine.submit("factory", prompt, params)
    return [t async for u in served.engine.updates("factory", updates) for t in u.new_token_ids]


def test_llm_serve_and_tune_build_the_same_engine_from_the_same_options(
    tiny_checkpoint: Path,
) -> None:
    runner = InProcessRunner.load(
        tiny_checkpoint,
        ["The quick brown fox"],
        block_sizes=[SETTING.block_size],
        max_tokens=MAX_TOKENS,
        concurrency=2,
        heldout=None,
        heldout_count=0,
        dtype="bf16",
        device="cpu",
        threads=1,
    )
    assert torch.get_num_threads() == 1  # the tuner's threads, set by the factory
    tuned = runner.engine
    prompt = runner.prompts[0]
    seq = tuned.core.max_seq_len
    llm = LLM(tiny_checkpoint, dtype="bf16", max_batch_size=2, max_seq_len=seq)
    config = serve_config(tiny_checkpoint, seq)
    state = ServerState(config=config, metrics=EngineMetrics())
    served = load_served_model(config, state)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **SETTING.request_fields())
    try:
        served_tokens = asyncio.run(serve_one(served, prompt, params))
    finally:
        served.engine.shutdown()

    # What the server reports of its engine is what the other two hold.
    (info,) = [s.labels for m in state.metrics.model_info.collect() for s in m.samples]
    kv_total = state.metrics.registry.get_sample_value("dllm_kv_cache_total_bytes")
    for built in (llm.engine, tuned):
        assert built.model.dtype == torch.bfloat16
        assert info["dtype"] == "bfloat16"
        assert info["compute_dtype"] == str(built.model.compute_dtype).removeprefix("torch.")
        assert info["weights_layout"] == built.model.weights_layout
        assert kv_total == built.core.kv_cache_bytes_total
    (llm_out,) = llm.generate([prompt], params)
    tuned_tokens = runner.run(SETTING, max_tokens=MAX_TOKENS, concurrency=1).samples[0].units
    assert llm_out.token_ids == list(tuned_tokens) == served_tokens
    assert len(served_tokens) > 0


def test_the_server_config_reaches_the_factory_key_for_key(tiny_checkpoint: Path) -> None:
    config = ServeConfig.model_validate(
        {
            "model": {
                "path": str(tiny_checkpoint),
                "dtype": "fp16",
                "max_seq_len": 96,
                "resident_weights": "compute",
                "packed_weights": "off",
            },
            "service": {"max_concurrent_requests": 3},
            "resources": {"device": "cpu", "memory_fraction": 0.5, "threads": 2},
        }
    )
    assert engine_options(config) == EngineOptions(
        dtype="fp16",
        device="cpu",
        max_batch_size=3,
        max_seq_len=96,
        packed_weights="off",
        resident_weights="compute",
        memory_fraction=0.5,
        threads=2,
        track_experts=True,  # the server publishes per-expert token counts
    )


def test_the_cache_is_the_size_the_options_and_the_memory_plan_say(tiny_checkpoint: Path) -> None:
    options = EngineOptions(max_batch_size=3, max_seq_len=40)
    built = build_engine(tiny_checkpoint, options)
    assert built.options == options and built.device == "cpu"
    assert (built.core.max_batch_size, built.core.max_seq_len) == (3, 40)
    assert built.core.kv_cache_bytes_total == built.plan.kv_cache_bytes


def test_packed_weights_off_keeps_the_plain_layout(tiny_checkpoint: Path) -> None:
    built = build_engine(tiny_checkpoint, EngineOptions(dtype="fp32", packed_weights="off"))
    assert built.model.weights_layout == "plain"
    assert built.model.dtype == torch.float32


def test_an_unknown_dtype_is_a_checkpoint_error_naming_the_choices(tiny_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match=r"int8.*fp32, bf16, fp16"):
        build_engine(tiny_checkpoint, EngineOptions(dtype="int8"))


def test_a_model_type_no_family_serves_is_a_checkpoint_error_naming_those_served(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match=r"'llama'.*qwen3_moe"):
        build_engine(tmp_path)


def test_a_missing_checkpoint_is_a_checkpoint_error_saying_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        build_engine(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        build_engine(tmp_path)
