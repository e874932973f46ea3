"""The wire contract: the manifest digest everyone uses, and input checks on agent messages."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from protocol.wire import Heartbeat, Manifest, ManifestEntry, MemoryPlan, RegisterRequest


def entry(path: str, size: int = 1, digit: str = "a") -> dict[str, object]:
    return {"path": path, "size": size, "sha256": digit * 64}


def test_digest_is_sha256_of_sorted_canonical_json() -> None:
    manifest = Manifest(files=[entry("b.bin", 2, "b"), entry("a/config.json", 1, "a")])
    canonical = json.dumps(
        [
            {"path": "a/config.json", "sha256": "a" * 64, "size": 1},
            {"path": "b.bin", "sha256": "b" * 64, "size": 2},
        ],
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    assert manifest.canonical_json() == canonical
    assert manifest.digest() == hashlib.sha256(canonical).hexdigest()
    reordered = Manifest(files=list(reversed(manifest.files)))
    assert reordered.digest() == manifest.digest()
    assert manifest.total_bytes() == 3


@pytest.mark.parametrize("field,value", [("path", "b2.bin"), ("size", 3), ("sha256", "c" * 64)])
def test_digest_changes_with_any_field(field: str, value: object) -> None:
    base = Manifest(files=[entry("a"), entry("b.bin", 2, "b")])
    changed = base.model_copy(deep=True)
    setattr(changed.files[1], field, value)
    assert changed.digest() != base.digest()


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../up", "a/../../b", "a//b", "./a", "a/.", "C:/x", "a\\b", "a\x00b", ""],
)
def test_manifest_paths_must_be_relative_and_clean(path: str) -> None:
    with pytest.raises(ValidationError):
        ManifestEntry(path=path, size=1, sha256="a" * 64)


def test_manifest_rejects_duplicates_bad_hashes_and_emptiness() -> None:
    with pytest.raises(ValidationError, match="twice"):
        Manifest(files=[entry("a"), entry("a")])
    with pytest.raises(ValidationError):
        Manifest(files=[entry("a", digit="A")])
    with pytest.raises(ValidationError):
        Manifest(files=[])


def test_memory_plan_required_bytes() -> None:
    plan = MemoryPlan(weights_bytes=1000, kv_bytes_per_token=10, activation_bytes=50)
    assert plan.required_bytes(100) == 2050


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    beat = Heartbeat.model_validate({"applied_generation": 3, "from_the_future": True})
    assert beat.applied_generation == 3


def test_register_request_checks_names_and_port_range() -> None:
    assert RegisterRequest(name="gpu-01").port_range == (18000, 18099)
    for bad in [{"name": "GPU_1"}, {"name": "-x"}, {"name": "a", "port_range": [2, 1]}]:
        with pytest.raises(ValidationError):
            RegisterRequest.model_validate(bad)
