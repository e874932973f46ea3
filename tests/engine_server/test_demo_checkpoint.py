"""`dctl model create-demo --random`: a real, deterministic random-weight checkpoint directory."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.demo_checkpoint import create_demo_checkpoint
from engine.loader import load_model, load_tokenizer
from tests.engine_server.conftest import ROOT

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"}  # fmt: skip


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_same_seed_same_bytes_other_seed_other_weights(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    again = create_demo_checkpoint(tmp_path / "again", seed=0, size="tiny")
    other = create_demo_checkpoint(tmp_path / "other", seed=1, size="tiny")
    assert set(digests(demo_checkpoint)) == FILES
    assert digests(again) == digests(demo_checkpoint)
    changed = {k for k, v in digests(other).items() if digests(demo_checkpoint)[k] != v}
    assert changed == {"model.safetensors"}


def test_layout_is_qwen3_moe_with_diffusion_fields(demo_checkpoint: Path) -> None:
    config = json.loads((demo_checkpoint / "config.json").read_text())
    tokenizer = json.loads((demo_checkpoint / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert config["model_type"] == "sdar_moe"
    assert config["mask_token_id"] == added["<|mask|>"]
    assert config["block_size"] == 4
    assert tokenizer["model"]["type"] == "BPE"
    assert tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    generation = json.loads((demo_checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    from safetensors import safe_open

    with safe_open(str(demo_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_loads_with_the_engine_loader_and_matches_transformers(demo_checkpoint: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = load_model(demo_checkpoint, dtype="fp32")
    tokenizer = load_tokenizer(demo_checkpoint)
    assert tokenizer.mask_token_id == model.config.mask_token_id
    text = "The quick brown fox, 2024."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    fields = json.loads((demo_checkpoint / "config.json").read_text())
    for key in ("model_type", "architectures", "mask_token_id", "block_size"):
        fields.pop(key)
    reference = Qwen3MoeForCausalLM.from_pretrained(
        demo_checkpoint, config=Qwen3MoeConfig(**fields)
    ).eval()
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        ours = model(ids, block_size=1)
        theirs = reference(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_chat_template_has_a_thinking_switch(demo_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(demo_checkpoint)
    messages = [{"role": "user", "content": "Hi"}]
    plain = tokenizer.apply_chat_template(messages, enable_thinking=True)
    direct = tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert direct == plain + "<think>\n\n</think>\n\n"


def test_cli_writes_it_and_refuses_a_non_empty_directory(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    dctl = [sys.executable, "-m", "cli", "model", "create-demo", "--random"]
    target = tmp_path / "cli"
    ok = subprocess.run([*dctl, str(target)], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert digests(target) == digests(demo_checkpoint)  # --size defaults to tiny
    again = subprocess.run([*dctl, str(target)], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1
    assert "not empty" in again.stderr


@pytest.mark.parametrize(
    ("kwargs", "needle"), [({"size": "huge"}, "tiny, small"), ({"seed": -1}, "seed")]
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        create_demo_checkpoint(tmp_path / "x", **kwargs)
