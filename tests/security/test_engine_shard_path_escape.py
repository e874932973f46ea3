"""Threat: a published checkpoint's index makes the engine read files outside the checkpoint.

`model.safetensors.index.json` names the shard files. Before, the loader opened
`root / name` for any name: `../../etc/passwd`, an absolute path, or a shard that is a symlink
out of the directory was read as weights (a device such as /dev/zero, or a FIFO, would never end).
Now every weight file must resolve inside the checkpoint directory and be a regular file, or the
load stops with a CheckpointError naming the shard.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.demo_checkpoint import create_demo_checkpoint
from engine.errors import CheckpointError
from engine.loader import load_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("shards") / "tiny", seed=0, size="tiny")


@pytest.fixture(scope="module")
def tensors(demo: Path) -> list[str]:
    """Names of the demo checkpoint's tensors."""
    from safetensors import safe_open

    with safe_open(str(demo / "model.safetensors"), framework="pt") as reader:
        return list(reader.keys())


@pytest.fixture
def checkpoint(demo: Path, tmp_path: Path) -> Path:
    """A private copy of the demo checkpoint, inside a directory of its own."""
    return Path(shutil.copytree(demo, tmp_path / "hub" / "tiny"))


def index_to(checkpoint: Path, tensors: list[str], shard: object) -> None:
    """Write an index that lists every tensor in one shard named SHARD."""
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, shard)}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))


def test_the_demo_checkpoint_loads_through_an_index(checkpoint: Path, tensors: list[str]) -> None:
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00001.safetensors")
    index_to(checkpoint, tensors, "model-00001-of-00001.safetensors")
    assert load_model(checkpoint).config.num_layers == 2


@pytest.mark.parametrize("shard", ["../../etc/passwd", "/etc/passwd", "../outside.safetensors"])
def test_a_shard_name_leading_out_of_the_checkpoint_is_refused(
    checkpoint: Path, tensors: list[str], shard: str
) -> None:
    # A valid weight file outside, so only the path check can stop the load.
    shutil.copy(checkpoint / "model.safetensors", checkpoint.parent / "outside.safetensors")
    index_to(checkpoint, tensors, shard)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        load_model(checkpoint)
    assert repr(shard) in str(info.value)


def test_a_shard_that_is_a_symlink_out_of_the_checkpoint_is_refused(
    checkpoint: Path, tensors: list[str]
) -> None:
    outside = checkpoint.parent / "elsewhere.safetensors"
    (checkpoint / "model.safetensors").rename(outside)
    (checkpoint / "model-00001-of-00001.safetensors").symlink_to(outside)
    index_to(checkpoint, tensors, "model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError, match=r"'model-00001-of-00001\.safetensors' lies outside"):
        load_model(checkpoint)


def test_a_single_weight_file_that_is_a_symlink_out_is_refused(checkpoint: Path) -> None:
    outside = checkpoint.parent / "elsewhere.safetensors"
    (checkpoint / "model.safetensors").rename(outside)
    (checkpoint / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"'model\.safetensors' lies outside"):
        load_model(checkpoint)


def test_a_symlink_inside_the_checkpoint_is_fine(checkpoint: Path, tensors: list[str]) -> None:
    (checkpoint / "weights").mkdir()
    (checkpoint / "model.safetensors").rename(checkpoint / "weights" / "w.safetensors")
    (checkpoint / "model-00001-of-00001.safetensors").symlink_to("weights/w.safetensors")
    index_to(checkpoint, tensors, "model-00001-of-00001.safetensors")
    assert load_model(checkpoint).config.num_layers == 2


@pytest.mark.parametrize("shard", [None, 7, "", "weights"])
def test_a_shard_that_is_not_a_file_name_or_not_a_file_is_refused(
    checkpoint: Path, tensors: list[str], shard: object
) -> None:
    (checkpoint / "weights").mkdir()
    index_to(checkpoint, tensors, shard)
    with pytest.raises(CheckpointError, match=r"not a file name|not a regular file"):
        load_model(checkpoint)
