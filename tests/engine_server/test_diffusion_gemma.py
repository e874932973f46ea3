"""A DiffusionGemma checkpoint served by `python -m engine.serve`, used through the official
`openai` client: completions and chat, streamed one committed canvas at a time, the family's
`dllm_*` figures, and the family's 400s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo
from tests.engine_server.conftest import MODEL, ServerProcess, launch_server, start_server

CANVAS = 16  # the demo's canvas_length


@pytest.fixture(scope="module")
def dg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("dg-server")
    checkpoint = create_diffusion_gemma_demo(root / "demo")
    proc = start_server(root, checkpoint, {"max_concurrent_requests": 4, "max_queue": 4})
    yield proc
    proc.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_completions_and_chat_answer_through_the_openai_client(dg_server: ServerProcess) -> None:
    client = client_of(dg_server)
    done = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=24, seed=3, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 24
    again = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=24, seed=3, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == done.choices[0].text  # a seed fixes the canvas draws
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_a_stream_sends_one_chunk_per_committed_canvas(dg_server: ServerProcess) -> None:
    client = client_of(dg_server)
    stream = client.completions.create(
        model=MODEL,
        prompt="once upon",
        max_tokens=3 * CANVAS,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 3 * CANVAS
    # Text is released per canvas (3), never per denoising step (several per canvas); a
    # canvas whose text is held back at a word's edge may share a chunk with the next.
    assert 1 <= len(texts) <= 3
    whole = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=3 * CANVAS, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(texts) == whole.choices[0].text


def test_metrics_report_denoising_steps_per_canvas(dg_server: ServerProcess) -> None:
    client_of(dg_server).completions.create(
        model=MODEL, prompt="a b c", max_tokens=CANVAS, seed=2, extra_body={"max_steps": 3}
    )
    dg_server.wait_idle()
    metrics = dg_server.metrics()
    steps = metrics["dllm_denoising_steps_per_block_count"]
    assert steps >= 1
    assert metrics["dllm_denoising_steps_per_block_sum"] <= 8 * steps  # the demo caps at 8
    assert metrics["dllm_tokens_per_forward_count"] >= 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"threshold": 0.5}, "threshold"), ({"block_size": 4}, "block_size"), ({"top_k": 3}, "top_k")],
)
def test_masked_diffusion_settings_are_a_400_naming_them(
    dg_server: ServerProcess, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client_of(dg_server).completions.create(
            model=MODEL, prompt="hi", max_tokens=4, extra_body=extra
        )
    assert info.value.body["param"] == param  # type: ignore[index]
    assert "diffusion-gemma" in info.value.body["message"]  # type: ignore[index]


def test_an_image_part_is_a_400_and_the_log_says_the_vision_tower_is_not_loaded(
    dg_server: ServerProcess,
) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        client_of(dg_server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image]}],  # type: ignore[list-item,misc]
            max_tokens=4,
        )
    assert "image" in info.value.body["message"]  # type: ignore[index]
    assert any("vision tower not loaded" in r.get("msg", "") for r in dg_server.log_records())


def test_a_bad_diffusion_gemma_config_stops_start_up_naming_the_field(tmp_path: Path) -> None:
    # The family is chosen by config.json alone: a bad DiffusionGemma config stops start-up
    # with the field named, not a stack trace.
    checkpoint = create_diffusion_gemma_demo(tmp_path / "demo")
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(
        config.replace('"canvas_length": 16', '"canvas_length": 0')
    )
    server = launch_server(tmp_path, checkpoint)
    assert server.proc.wait(120) != 0
    assert "canvas_length" in server.log_path.read_text()


def test_a_server_default_the_family_refuses_stops_start_up_naming_the_key(
    tmp_path: Path,
) -> None:
    # An SDAR deployment's config (steps mode by default) on a DiffusionGemma checkpoint: served,
    # every request would be a 400 that gateways and rollouts count as the client's fault.
    checkpoint = create_diffusion_gemma_demo(tmp_path / "demo")
    server = launch_server(tmp_path, checkpoint, steps=2)
    assert server.proc.wait(120) != 0
    log = server.log_path.read_text()
    assert "model.steps in the engine config" in log and "masked-diffusion" in log
