"""Option values shared by several commands, and the choices the CLI takes from `protocol`."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import typer

from cli.options import (
    duration_option,
    engine_config_option,
    label_option,
    percent_option,
    percents_option,
)
from protocol import vocabulary, wire
from protocol.labels import parse_labels
from protocol.rest import TokenCreate
from protocol.vocabulary import CreatableRole, Role
from tests.cli.conftest import Dctl


def test_labels_are_key_value_pairs() -> None:
    assert parse_labels(["gpu=h100", "zone=", "note=a=b", " rack = r7 ", "gpu=a100"]) == {
        "gpu": "a100",  # the later flag wins
        "zone": "",
        "note": "a=b",
        "rack": "r7",
    }
    assert parse_labels([]) == {}


@pytest.mark.parametrize("bad", ["gpu", "=h100", " =h100"])
def test_a_label_without_key_or_equals_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="write it as KEY=VALUE"):
        parse_labels(["ok=1", bad])


def test_a_bad_label_option_is_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert label_option(["gpu=h100"]) == {"gpu": "h100"}
    with pytest.raises(typer.Exit) as info:
        label_option(["ok=1", "gpu"])
    assert info.value.exit_code == 2
    assert capsys.readouterr().err.strip() == "error: --label 'gpu': write it as KEY=VALUE"


def usage_error(capsys: pytest.CaptureFixture[str], parse: object, *args: object) -> str:
    """The one error line a usage error printed (and that it exited 2)."""
    assert callable(parse)
    with pytest.raises(typer.Exit) as info:
        parse(*args)
    assert info.value.exit_code == 2
    return capsys.readouterr().err.strip()


def test_durations_percents_and_weights_are_parsed_one_way_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert duration_option("5m", "--interval") == 300
    assert usage_error(capsys, duration_option, "5x", "--interval") == (
        "error: --interval '5x': write a positive duration like 30m, 24h or 7d"
    )
    assert percent_option(" 10% ", "--canary") == 10
    assert percent_option("150", "--canary") == 150  # the range is the request model's rule
    assert "--canary 'ten'" in usage_error(capsys, percent_option, "ten", "--canary")
    assert percents_option("10, 50%,100", "--steps") == [10, 50, 100]
    assert "--steps '10,x'" in usage_error(capsys, percents_option, "10,x", "--steps")


def test_an_engine_config_file_must_hold_a_mapping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "engine.yaml"
    good.write_text("resources:\n  threads: 2\n")
    assert engine_config_option(good) == {"resources": {"threads": 2}}
    (tmp_path / "empty.yaml").write_text("")
    assert engine_config_option(tmp_path / "empty.yaml") == {}
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n")
    assert usage_error(capsys, engine_config_option, listy) == (
        f"error: --engine-config {listy}: must hold a mapping of settings, not a list or value"
    )
    assert "cannot be read" in usage_error(capsys, engine_config_option, tmp_path / "none.yaml")


def test_creatable_roles_are_every_role_but_agent() -> None:
    # Agent tokens come only from agent registration, bound to their host.
    assert set(get_args(CreatableRole)) == {r.value for r in Role} - {Role.AGENT.value}
    assert get_args(TokenCreate.model_fields["role"].annotation) == get_args(CreatableRole)


def test_version_lines_are_the_wire_protocols() -> None:
    assert get_args(vocabulary.VersionLine) == get_args(wire.VersionLine)


def test_the_cli_offers_exactly_the_protocols_choices() -> None:
    dctl = Dctl({})  # help and usage errors need no control plane
    role_help = dctl("token", "create", "--help").stdout
    assert "<" + "|".join(get_args(CreatableRole)) + ">" in role_help
    line_help = dctl("model", "register", "--help").stdout
    assert "<" + "|".join(get_args(vocabulary.VersionLine)) + ">" in line_help
    refused = dctl("token", "create", "x", "--role", "agent")
    assert refused.code == 2 and "'agent' is not one of" in refused.stderr
