"""`VersionRef`: MODEL:VERSION written one way for people, and read back from what they typed."""

from __future__ import annotations

import re

import pytest

from protocol.version_ref import VersionRef


def test_a_version_reads_as_model_colon_version() -> None:
    ref = VersionRef("sdar-moe", "v1.2-rc1")
    assert str(ref) == "sdar-moe:v1.2-rc1"
    assert f"deploying {ref}" == "deploying sdar-moe:v1.2-rc1"
    assert VersionRef.parse(str(ref)) == ref  # what is written reads back the same


def test_a_bare_version_belongs_to_the_model_given() -> None:
    assert VersionRef.parse("v2", model="demo") == VersionRef("demo", "v2")
    # A full reference names its own model, whatever the default.
    assert VersionRef.parse("other:v2", model="demo") == VersionRef("other", "v2")


@pytest.mark.parametrize(
    ("text", "model", "message"),
    [
        ("demo", None, "'demo' is not NAME:VERSION (e.g. demo:v1)"),
        ("Demo:v1", None, "'Demo:v1' is not NAME:VERSION"),
        ("demo:", None, "'demo:' is not NAME:VERSION"),
        (":v1", None, "':v1' is not NAME:VERSION"),
        ("demo:v1:x", None, "'demo:v1:x' is not NAME:VERSION"),
        ("v 2", "demo", "'v 2' is not VERSION or NAME:VERSION (e.g. v1, demo:v1)"),
    ],
)
def test_anything_else_is_refused_saying_what_to_write(
    text: str, model: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        VersionRef.parse(text, model=model)
