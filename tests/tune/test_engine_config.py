"""The recommended engine config decodes like the setting it was measured with."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.llm import LLM
from engine.params import SamplingParams
from engine.tuning.grid import DecodeSetting
from engine.tuning.report import engine_config_keys

PROMPTS = ["The river runs past the old mill", "Hello"]


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(checkpoint, dtype="fp32", max_batch_size=2, max_seq_len=64)


@pytest.mark.parametrize("steps", [2, 3])
def test_steps_mode_maps_onto_keys_the_engine_config_has(llm: LLM, steps: int) -> None:
    # The keys written (`model.steps` among them) must give the same tokens as the setting.
    # steps=3 over 4 masks is the uneven split (2, 1, 1).
    setting = DecodeSetting(4, steps=steps)
    measured = llm.generate(PROMPTS, SamplingParams(max_tokens=12, **setting.request_fields()))
    keys = engine_config_keys(setting)
    assert keys["steps"] == steps
    configured = llm.generate(PROMPTS, SamplingParams(max_tokens=12, **keys))
    for a, b in zip(measured, configured, strict=True):
        assert a.token_ids == b.token_ids
        assert a.stats is not None and b.stats is not None
        assert a.stats.steps_per_block == b.stats.steps_per_block


def test_threshold_mode_keys_are_the_setting() -> None:
    assert engine_config_keys(DecodeSetting(8, threshold=0.9)) == {
        "block_size": 8, "threshold": 0.9, "min_steps": 1, "max_steps": 8,
    }  # fmt: skip
