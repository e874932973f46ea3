"""The manifest of a checkpoint directory: what the agent will fetch and verify, byte for byte."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from protocol.manifest import ManifestError, compute_manifest


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_every_file_with_its_size_and_sha256_sorted_by_path(tmp_path: Path) -> None:
    big = os.urandom(3 * (1 << 20) + 17)  # several read chunks
    write(tmp_path / "model-00002.safetensors", big)
    write(tmp_path / "config.json", b"{}")
    write(tmp_path / "sub" / "tokenizer.json", b"tok")
    manifest = compute_manifest(tmp_path)
    assert [(e.path, e.size, e.sha256) for e in manifest.files] == [
        ("config.json", 2, hashlib.sha256(b"{}").hexdigest()),
        ("model-00002.safetensors", len(big), hashlib.sha256(big).hexdigest()),
        ("sub/tokenizer.json", 3, hashlib.sha256(b"tok").hexdigest()),
    ]


def test_the_digest_depends_on_content_not_on_where_or_when(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write(a / "x.bin", b"1")
    write(a / "y.bin", b"2")
    write(b / "y.bin", b"2")
    write(b / "x.bin", b"1")
    assert compute_manifest(a).digest() == compute_manifest(b).digest()
    write(b / "x.bin", b"3")
    assert compute_manifest(a).digest() != compute_manifest(b).digest()


def test_a_symlink_inside_the_directory_is_hashed_as_its_target(tmp_path: Path) -> None:
    write(tmp_path / "blobs" / "abc", b"weights")
    (tmp_path / "model.safetensors").symlink_to("blobs/abc")
    entries = {e.path: e.sha256 for e in compute_manifest(tmp_path).files}
    assert entries["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()


def test_a_symlink_escaping_the_directory_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "outside.bin", b"secret")
    ckpt = tmp_path / "ckpt"
    write(ckpt / "config.json", b"{}")
    (ckpt / "model.safetensors").symlink_to("../outside.bin")
    with pytest.raises(ManifestError, match=r"model.safetensors: is a symlink to .*outside"):
        compute_manifest(ckpt)


def test_a_directory_symlink_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "real" / "a.bin", b"a")
    (tmp_path / "alias").symlink_to("real", target_is_directory=True)
    with pytest.raises(ManifestError, match="alias: is a symlink to a directory"):
        compute_manifest(tmp_path)


def test_a_special_file_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "config.json", b"{}")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ManifestError, match="pipe: is not a regular file"):
        compute_manifest(tmp_path)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "no such directory"),
        (lambda p: p.write_text("x"), "is not a directory"),
        (lambda p: p.mkdir(), "contains no files"),
    ],
)
def test_a_bad_directory_gets_a_clear_error(tmp_path: Path, setup: object, message: str) -> None:
    target = tmp_path / "ckpt"
    setup(target)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=message):
        compute_manifest(target)


def test_a_name_the_wire_cannot_carry_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "bad\x01name", b"x")
    with pytest.raises(ManifestError, match="rename the file"):
        compute_manifest(tmp_path)
