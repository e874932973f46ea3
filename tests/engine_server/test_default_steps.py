"""`model.steps`: a deployment can make steps mode the default, and requests can still choose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.api_requests import sampling_params
from protocol.engine_config import ModelSection, load_serve_config
from protocol.openai import CompletionRequest

CHECKPOINT_BLOCK = 4


def params(checkpoint: Path, defaults: dict[str, Any], body: dict[str, Any]) -> Any:
    model = ModelSection(path=str(checkpoint), **defaults)
    request = CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **body})
    return sampling_params(request, model, 8, None, CHECKPOINT_BLOCK)


@pytest.mark.parametrize(
    ("defaults", "body", "steps", "threshold"),
    [
        ({"steps": 3}, {}, 3, 0.9),  # no mode asked for: the deployment's steps
        ({"steps": 3}, {"threshold": 0.7}, None, 0.7),  # a threshold asks for threshold mode
        ({"steps": 3}, {"steps": 1}, 1, 0.9),  # the request's own steps win
        ({"steps": 3}, {"block_size": 2}, 2, 0.9),  # capped at a smaller block
        ({"steps": 3, "block_size": 8}, {}, 3, 0.9),
        ({}, {}, None, 0.9),  # unset: threshold mode, as before
    ],
)
def test_default_steps_apply_only_to_requests_that_choose_no_mode(
    demo_checkpoint: Path, defaults: dict[str, Any], body: dict[str, Any], steps: Any,
    threshold: float,
) -> None:  # fmt: skip
    chosen = params(demo_checkpoint, defaults, body)
    assert (chosen.steps, chosen.threshold) == (steps, threshold)
    chosen.validate(4096, 2, CHECKPOINT_BLOCK)  # the engine accepts what it gets


def test_the_steps_flag_sets_it(demo_checkpoint: Path) -> None:
    config = load_serve_config(None, {"model.path": str(demo_checkpoint), "model.steps": "2"})
    assert config.model.steps == 2
    config = load_serve_config(None, {"model.path": str(demo_checkpoint), "model.steps": "null"})
    assert config.model.steps is None
