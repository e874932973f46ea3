"""One instance over 2 CPU ranks (gloo), served by a real `python -m engine.serve --parallel 2`:
the official `openai` client gets what a single-process server answers, for both families; a
rank killed with SIGKILL stops the instance at once with no rank left; SIGTERM drains through
rank 0 and every rank exits 0; a plan the model does not split stops start-up naming the key
and the figures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo
from tests.engine_parallel.conftest import BRANCH_SCALE, rescaled_copy
from tests.engine_server.conftest import (
    MODEL,
    ROOT,
    ServerProcess,
    free_port,
    launch_server,
    start_server,
    wait_ready,
)
from tests.processes import alive, descendants, worker_ranks

TWO_RANKS = {"parallel": {"size": 2}}


@dataclass
class Pair:
    """The same checkpoint served by one process and by two ranks."""

    single: ServerProcess
    parallel: ServerProcess


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def dg_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DiffusionGemma demo with its residual branches scaled down: the random demo's
    canvas draws sit so close to ties that two ranks' sums, run in another order, would flip
    some (`tests.engine_parallel.conftest`)."""
    demo = create_diffusion_gemma_demo(tmp_path_factory.mktemp("dg") / "demo")
    factors = {
        ".post_attention_layernorm.weight": BRANCH_SCALE,
        ".post_feedforward_layernorm.weight": BRANCH_SCALE,
        "self_conditioning.down_proj.weight": BRANCH_SCALE,
    }
    return rescaled_copy(demo, demo.with_name("tempered"), factors)


@pytest.fixture(scope="module")
def pairs(
    tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path, dg_checkpoint: Path
) -> Iterator[dict[str, Pair]]:
    """SDAR and DiffusionGemma, each on one process and on two ranks; started together."""
    root = tmp_path_factory.mktemp("parallel-serve")
    # SDAR in steps mode (2 steps per block); DiffusionGemma has its own schedule.
    models: dict[str, tuple[Path, dict[str, Any]]] = {
        "sdar": (demo_checkpoint, {"steps": 2}),
        "dg": (dg_checkpoint, {}),
    }
    launched = {
        family: Pair(
            launch_server(root / family, checkpoint, **model),
            launch_server(root / family, checkpoint, sections=TWO_RANKS, **model),
        )
        for family, (checkpoint, model) in models.items()
    }
    try:
        for pair in launched.values():
            wait_ready(pair.single)
            wait_ready(pair.parallel)
        yield launched
    finally:
        for pair in launched.values():
            pair.single.stop()
            pair.parallel.stop()


def answers(server: ServerProcess) -> list[str]:
    """Seeded completions and a chat, as the openai client gets them."""
    client = client_of(server)
    texts = []
    for prompt, seed in (("Hello", 1), ("the cat sat", 7), ("1 2 3", 11)):
        done = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, seed=seed, temperature=0.8,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts.append(done.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=5
    )
    texts.append(chat.choices[0].message.content or "")
    return texts


@pytest.mark.parametrize("family", ["sdar", "dg"])
def test_two_ranks_answer_what_one_process_answers(pairs: dict[str, Pair], family: str) -> None:
    pair = pairs[family]
    single = answers(pair.single)
    assert any(single)
    assert answers(pair.parallel) == single


def test_metrics_show_the_instance_once_with_its_ranks(pairs: dict[str, Pair]) -> None:
    parallel, single = pairs["sdar"].parallel.metrics(), pairs["sdar"].single.metrics()
    assert parallel["dllm_parallel_ranks"] == 2
    assert single["dllm_parallel_ranks"] == 1
    info = next(k for k in parallel if k.startswith("dllm_model_info{"))
    assert "parallel_size=2" in info and "experts=expert" in info
    # Rank 0 counts each request once: the warm-up plus this module's requests, not per rank.
    assert (
        parallel["dllm_requests_finished_total{finish_reason=length}"]
        == (single["dllm_requests_finished_total{finish_reason=length}"])
    )


def test_a_killed_rank_stops_the_instance_at_once_leaving_no_rank(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    server = start_server(tmp_path, demo_checkpoint, sections=TWO_RANKS)
    try:
        group = descendants(server.proc.pid)
        (rank_one,) = worker_ranks(server.proc.pid)
        os.kill(rank_one, signal.SIGKILL)
        start = time.monotonic()
        assert server.proc.wait(15) == 1
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 5
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(group) == []  # no rank, no fork server left
        lost = [r for r in server.log_records() if r.get("msg", "").startswith("a rank of")]
        assert lost and lost[0]["rank"] == 1 and lost[0]["exit_code"] == -signal.SIGKILL
    finally:
        server.stop()


def test_sigterm_drains_through_rank_zero_and_every_rank_exits_0(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    server = start_server(tmp_path, demo_checkpoint, sections=TWO_RANKS)
    group = descendants(server.proc.pid)
    assert len(worker_ranks(server.proc.pid)) == 1
    answered: list[str] = []

    def ask() -> None:
        done = client_of(server).completions.create(
            model=MODEL, prompt="Hello", max_tokens=64, extra_body={"ignore_eos": True}
        )
        answered.append(done.choices[0].finish_reason)

    request = threading.Thread(target=ask)
    request.start()
    time.sleep(0.3)  # the request is in the engine when the signal comes
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    request.join(10)
    assert answered == ["length"]  # taken before the signal: answered in full
    stopped = [r for r in server.log_records() if r.get("msg") == "ranks stopped"]
    assert stopped and stopped[0]["exit_codes"] == {"1": 0}
    deadline = time.monotonic() + 5
    while alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(group) == []


def test_a_plan_the_model_does_not_split_stops_start_up_naming_the_key(
    demo_checkpoint: Path,
) -> None:
    # The tiny demo has 4 attention heads: 3 ranks cannot share them equally.
    done = subprocess.run(
        [sys.executable, "-m", "engine.serve", str(demo_checkpoint), "--parallel", "3",
         "--device", "cpu", "--port", str(free_port()), "--log-format", "kv"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "parallel.size 3 does not divide num_attention_heads (4)" in done.stdout + done.stderr
