"""`dctl model register` stores what an instance's ranks split (heads, K/V heads, experts,
vocabulary) with the memory plan, for both families, read from the checkpoint's config alone."""

from __future__ import annotations

import json
from pathlib import Path

from cli.cmd_model import memory_plan
from engine.demo_checkpoint import create_demo_checkpoint
from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo


def test_an_sdar_checkpoint_stores_its_heads_and_experts(tmp_path: Path) -> None:
    directory = create_demo_checkpoint(tmp_path / "sdar")
    config = json.loads((directory / "config.json").read_text())
    plan, note = memory_plan(directory)
    assert plan is not None, note
    assert plan.num_heads == config["num_attention_heads"]
    assert plan.num_kv_heads == [config["num_key_value_heads"]]
    assert plan.num_experts == config["num_experts"] > 0
    assert plan.vocab_size == config["vocab_size"]


def test_a_diffusion_gemma_checkpoint_stores_each_distinct_kv_head_count(tmp_path: Path) -> None:
    directory = create_diffusion_gemma_demo(tmp_path / "dg")
    text = json.loads((directory / "config.json").read_text())["text_config"]
    plan, note = memory_plan(directory)
    assert plan is not None, note
    assert plan.num_heads == text["num_attention_heads"]
    # Sliding and full-attention layers have K/V heads of their own: both counts are checked.
    assert plan.num_kv_heads is not None and len(plan.num_kv_heads) == 2
    assert text["num_key_value_heads"] in plan.num_kv_heads
    assert plan.num_experts == text["num_experts"] > 0
    assert plan.vocab_size == text["vocab_size"]
