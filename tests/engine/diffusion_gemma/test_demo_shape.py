"""`create_diffusion_gemma_demo(..., shape=DemoShape(...))`: a random checkpoint of another size
(the benchmark's), complete for transformers and for our loader alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from engine.families.diffusion_gemma.demo import TINY, create_diffusion_gemma_demo
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import load_model, load_tokenizer

WIDER = replace(TINY, vocab_size=640, hidden=96, intermediate=160, canvas_length=8, experts=6)


def test_a_shape_sizes_the_config_weights_and_tokenizer(tmp_path: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    directory = create_diffusion_gemma_demo(tmp_path / "wider", shape=WIDER)
    config = json.loads((directory / "config.json").read_text())
    text = config["text_config"]
    assert (config["canvas_length"], text["vocab_size"], text["hidden_size"]) == (8, 640, 96)
    assert (text["intermediate_size"], text["num_experts"]) == (160, 6)
    reference, info = DiffusionGemmaForBlockDiffusion.from_pretrained(
        directory, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert reference.model.decoder.embed_tokens.weight.shape == (640, 96)
    ours = load_model(directory, dtype=torch.float32)
    assert isinstance(ours, DiffusionGemmaModel)
    assert (ours.config.vocab_size, ours.config.hidden_size, ours.config.canvas_length) == (
        640,
        96,
        8,
    )
    assert torch.equal(ours.embed.weight, reference.model.decoder.embed_tokens.weight)
    assert load_tokenizer(directory).vocab_size == 640  # every id the canvas can draw has a token
