"""Settings precedence (defaults < file < env < flags), XDG defaults, and structured logs."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from controlplane.settings import SettingsError, load_controlplane_settings
from protocol.logs import configure_logging


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "DCTL_CONFIG", "DCTL_PORT", "DCTL_HOST"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_defaults_follow_xdg(isolated_home: Path) -> None:
    settings = load_controlplane_settings()
    assert settings.data_dir == isolated_home / ".local" / "share" / "dctl"
    assert settings.resolved_database_url().endswith(".local/share/dctl/dctl.db")


def test_file_then_env_then_flags(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = isolated_home / ".config" / "dctl" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[controlplane]\nport = 9000\nhost = "0.0.0.0"\nlog_format = "json"\n')
    assert load_controlplane_settings().port == 9000
    monkeypatch.setenv("DCTL_PORT", "9100")
    settings = load_controlplane_settings()
    assert (settings.port, settings.host, settings.log_format) == (9100, "0.0.0.0", "json")
    assert load_controlplane_settings(port=9200).port == 9200


def test_yaml_config_file(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = isolated_home / "dctl.yaml"
    config.write_text("controlplane:\n  heartbeat_interval_s: 2.5\n")
    monkeypatch.setenv("DCTL_CONFIG", str(config))
    assert load_controlplane_settings().heartbeat_interval_s == 2.5


def test_bad_file_value_names_the_setting(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = isolated_home / "dctl.toml"
    config.write_text("[controlplane]\nheartbeat_interval_s = -1\n")
    monkeypatch.setenv("DCTL_CONFIG", str(config))
    with pytest.raises(SettingsError, match="heartbeat_interval_s"):
        load_controlplane_settings()


def test_unknown_key_in_file_is_refused(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = isolated_home / "dctl.toml"
    config.write_text("[controlplane]\nprot = 1\n")
    monkeypatch.setenv("DCTL_CONFIG", str(config))
    with pytest.raises(SettingsError, match="prot"):
        load_controlplane_settings()


def test_unreadable_file_is_a_clear_error(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = isolated_home / "dctl.toml"
    config.write_text("[controlplane\n")
    monkeypatch.setenv("DCTL_CONFIG", str(config))
    with pytest.raises(SettingsError, match="cannot be read"):
        load_controlplane_settings()


@pytest.mark.parametrize("fmt", ["json", "kv"])
def test_logs_are_structured_and_never_carry_secrets(fmt: str) -> None:
    stream = io.StringIO()
    configure_logging("info", fmt, stream)
    secret = "dctl_ab12_s3cretpart"
    logging.getLogger("dctl.test").info(
        "issued %s", secret, extra={"host": "gpu-1", "token": secret}
    )
    logging.getLogger("dctl.test").debug("hidden at info level")
    out = stream.getvalue()
    assert secret not in out and "s3cret" not in out
    assert "hidden" not in out
    if fmt == "json":
        record = json.loads(out)
        assert record["host"] == "gpu-1" and record["level"] == "info" and record["token"] == "***"
    else:
        assert "host=gpu-1" in out and "level=info" in out
