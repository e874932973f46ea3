"""`dctl model create-demo --family diffusion-gemma --random`: a tiny DiffusionGemma checkpoint
that `transformers` loads as its own, with a tokenizer that fits the config."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo

ROOT = Path(__file__).resolve().parents[3]
DCTL = [sys.executable, "-m", "cli", "model", "create-demo"]
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"}  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I am fine."},
    {"role": "user", "content": "What is the weather?"},
]
RENDERED = (
    "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHello, how are you?<turn|>\n"
    "<|turn>model\nI am fine.<turn|>\n<|turn>user\nWhat is the weather?<turn|>\n<|turn>model\n"
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_diffusion_gemma_demo(tmp_path_factory.mktemp("dg") / "demo", seed=0)


def read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_transformers_loads_every_tensor_and_ties_the_stacks(demo_dir: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(
        demo_dir, output_loading_info=True
    )
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert info["error_msgs"] == []
    decoder, encoder = model.model.decoder, model.model.encoder.language_model
    assert torch.equal(model.lm_head.weight, decoder.embed_tokens.weight)
    for ours, tied in zip(encoder.layers, decoder.layers, strict=True):
        assert torch.equal(ours.self_attn.q_proj.weight, tied.self_attn.q_proj.weight)
        assert torch.equal(ours.layer_scalar, tied.layer_scalar)
    assert model.dtype == torch.float32
    assert model.generation_config.max_denoising_steps == 8
    assert model.generation_config.sampler_config.entropy_bound == 0.1


def test_config_files_are_what_transformers_writes(demo_dir: Path, tmp_path: Path) -> None:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaGenerationConfig

    DiffusionGemmaConfig.from_pretrained(demo_dir).save_pretrained(tmp_path)
    DiffusionGemmaGenerationConfig.from_pretrained(demo_dir).save_pretrained(tmp_path)
    for name in ("config.json", "generation_config.json"):
        rewritten = read_json(tmp_path / name)
        rewritten.pop("transformers_version")
        assert read_json(demo_dir / name) == rewritten, name
    config = read_json(demo_dir / "config.json")
    text = config["text_config"]
    assert config["model_type"] == "diffusion_gemma"
    assert config["canvas_length"] == 16
    assert config["vision_config"]["model_type"] == "gemma4_vision"
    assert set(text["layer_types"]) == {"sliding_attention", "full_attention"}
    assert text["layer_types"][-1] == "full_attention"
    assert text["num_attention_heads"] > text["num_key_value_heads"]  # GQA
    assert text["num_experts"] > text["top_k_experts"]
    assert text["final_logit_softcapping"] == 30.0


def test_same_seed_same_bytes_other_seed_other_weights(demo_dir: Path, tmp_path: Path) -> None:
    again = create_diffusion_gemma_demo(tmp_path / "again", seed=0)
    other = create_diffusion_gemma_demo(tmp_path / "other", seed=1)
    assert set(digests(demo_dir)) == FILES
    assert digests(again) == digests(demo_dir)
    changed = {k for k, v in digests(other).items() if digests(demo_dir)[k] != v}
    assert changed == {"model.safetensors"}


def test_tokenizer_defines_the_vocab_and_the_special_ids_the_config_names(demo_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    config = read_json(demo_dir / "config.json")
    text = config["text_config"]
    backend = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert backend.get_vocab_size(with_added_tokens=True) == text["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert len(tokenizer) == text["vocab_size"]
    named = {
        "<bos>": text["bos_token_id"],
        "<eos>": text["eos_token_id"],
        "<pad>": text["pad_token_id"],
        "<|image>": config["boi_token_id"],
        "<image|>": config["eoi_token_id"],
        "<|image|>": config["image_token_id"],
    }
    for token, token_id in named.items():
        assert backend.token_to_id(token) == token_id, token
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        text["bos_token_id"],
        text["eos_token_id"],
        text["pad_token_id"],
    )
    assert tokenizer.image_token_id == config["image_token_id"]
    sentence = "The quick brown fox, 2024."
    assert tokenizer.decode(tokenizer.encode(sentence, add_special_tokens=False)) == sentence


def test_chat_template_renders_gemma_turns(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    from engine.tokenizer import load_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert rendered == RENDERED
    image_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert tokenizer.apply_chat_template(image_turn, tokenize=False) == (
        "<bos><|turn>user\n<|image|>Hi<turn|>\n"
    )
    ours = load_tokenizer(demo_dir)
    assert ours.apply_chat_template(CONVERSATION) == RENDERED
    # A generation stops at the end of the model's turn as well as at EOS.
    generation = read_json(demo_dir / "generation_config.json")
    assert generation["eos_token_id"] == [ours.token_to_id("<eos>"), ours.token_to_id("<turn|>")]
    assert set(generation["eos_token_id"]) <= set(ours.eos_token_ids)


def test_cli_writes_it(demo_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "cli"
    run = subprocess.run(
        [*DCTL, str(target), "--family", "diffusion-gemma", "--random"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert digests(target) == digests(demo_dir)
    assert "DiffusionGemma" in run.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--family", "diffusion-gemma"], "add --random"),
        (["--family", "diffusion-gemma", "--random", "--size", "small"], "tiny only"),
        (["--family", "llama", "--random"], "'sdar', 'diffusion-gemma'"),
    ],
)
def test_cli_refuses_what_it_cannot_write(tmp_path: Path, flags: list[str], needle: str) -> None:
    target = tmp_path / "refused"
    run = subprocess.run([*DCTL, str(target), *flags], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2
    assert needle in run.stderr
    assert not target.exists()


def test_bad_arguments_are_refused(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        create_diffusion_gemma_demo(tmp_path / "x", seed=-1)
    with pytest.raises(ValueError, match="not empty"):
        create_diffusion_gemma_demo(demo_dir)
