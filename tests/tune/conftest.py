"""The tiny random demo checkpoint (fp32, block size 4) with a prompt set and held-out text,
written once per session, and the `dctl` app run in-process (torch loads once)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from cli.app import app
from engine.demo_checkpoint import CORPUS, create_demo_checkpoint

PROMPTS = ["Tell me about the sea.", "What is wisdom?"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint plus prompts.txt and heldout.txt (paragraphs of three corpus lines,
    long enough for a 48-token prompt and a block)."""
    path = create_demo_checkpoint(tmp_path_factory.mktemp("tune") / "tiny", seed=0, size="tiny")
    (path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    lines = CORPUS.splitlines()
    paragraphs = [" ".join(lines[i : i + 3]) for i in range(0, len(lines) - 2, 3)]
    (path / "heldout.txt").write_text("\n\n".join(paragraphs) + "\n")
    return path


def dctl(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run `dctl ARGS` in this process; stdout and stderr apart."""
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """One CPU thread: on a busy 2-core machine a second one spins against other work and makes
    each forward many times slower."""
    import torch

    torch.set_num_threads(1)
