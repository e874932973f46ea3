"""`dctl model create-demo`: the trained demo model, copied from package data, one digest a seed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from engine.errors import CheckpointError
from engine.loader import load_model, load_tokenizer
from engine.trained_demo import install_trained_demo, trained_demo_files
from protocol.manifest import compute_manifest
from tests.engine_server.conftest import ROOT

DCTL = [sys.executable, "-m", "cli", "model", "create-demo"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The trained model installed with seed 0 and with seed 7."""
    root = tmp_path_factory.mktemp("trained")
    return install_trained_demo(root / "s0"), install_trained_demo(root / "s7", seed=7)


def test_seeds_share_the_weights_but_not_the_snapshot_digest(seeds: tuple[Path, Path]) -> None:
    zero, seven = seeds
    names = trained_demo_files()
    assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= set(names)
    assert sorted(p.name for p in zero.iterdir()) == names
    for name in names:
        if name != "generation_config.json":
            assert (zero / name).read_bytes() == (seven / name).read_bytes(), name
    gen0 = json.loads((zero / "generation_config.json").read_text())
    gen7 = json.loads((seven / "generation_config.json").read_text())
    assert (gen0["dctl_demo_seed"], gen7["dctl_demo_seed"]) == (0, 7)
    assert list(gen0) == list(gen7)  # key order kept: only the value moved
    assert {**gen7, "dctl_demo_seed": 0} == gen0
    assert compute_manifest(zero).digest() != compute_manifest(seven).digest()
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in seven.iterdir())


def test_seed_zero_reproduces_the_packaged_files(seeds: tuple[Path, Path]) -> None:
    packaged = files("engine") / "demo_model"
    for name in trained_demo_files():
        assert (seeds[0] / name).read_bytes() == packaged.joinpath(name).read_bytes(), name


def test_seeds_decode_exactly_the_same(seeds: tuple[Path, Path]) -> None:
    tokenizer = load_tokenizer(seeds[0])
    ids = torch.tensor([tokenizer.encode("In the beginning")])
    with torch.no_grad():
        logits = [load_model(path)(ids, block_size=1) for path in seeds]
    assert torch.equal(logits[0], logits[1])


def test_loads_and_renders_a_chat(seeds: tuple[Path, Path]) -> None:
    model = load_model(seeds[0])
    tokenizer = load_tokenizer(seeds[0])
    assert model.config.hidden_size == 256
    assert tokenizer.mask_token_id == model.config.mask_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = "And God said, Let there be light."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_negative_seed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed must be >= 0"):
        install_trained_demo(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_a_non_empty_or_non_directory_target_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        install_trained_demo(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
    with pytest.raises(ValueError, match="not a directory"):
        install_trained_demo(tmp_path / "mine.txt")
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_a_broken_install_names_the_missing_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("engine.trained_demo.files", lambda package: tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "demo_model"))):
        install_trained_demo(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_default_is_the_trained_model(tmp_path: Path) -> None:
    target = tmp_path / "trained"
    done = subprocess.run([*DCTL, str(target), "--seed", "3"], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"trained demo model (seed 3) written to {target}" in done.stdout
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 256
    assert (target / "training.json").is_file()
    assert json.loads((target / "generation_config.json").read_text())["dctl_demo_seed"] == 3


def test_cli_random_writes_the_tiny_random_checkpoint(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    target = tmp_path / "random"
    done = subprocess.run([*DCTL, str(target), "--random", "--size", "tiny"], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert compute_manifest(target).digest() == compute_manifest(demo_checkpoint).digest()
    assert not (target / "training.json").exists()


def test_cli_size_without_random_is_a_usage_error(tmp_path: Path) -> None:
    target = tmp_path / "nothing"
    done = subprocess.run([*DCTL, str(target), "--size", "tiny"], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 2
    assert "--random" in done.stderr
    assert not target.exists()
