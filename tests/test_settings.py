"""Settings precedence (defaults < file < env < flags), XDG defaults, and structured logs."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.settings import SettingsError, load_controlplane_settings
from runtime.logs import FORMATS, configure_logging, formatter


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


def test_a_named_file_then_env_then_flags(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = isolated_home / ".config" / "dctl" / "config.toml"
    default.parent.mkdir(parents=True)
    default.write_text("[controlplane]\nport = 8000\nlease_s = 7\n")
    named = isolated_home / "controlplane.toml"
    named.write_text('[controlplane]\nport = 9000\nhost = "0.0.0.0"\n')
    monkeypatch.setenv("DCTL_CONFIG", str(default))  # the named file wins over DCTL_CONFIG too
    settings = load_controlplane_settings(named)
    assert (settings.port, settings.host, settings.lease_s) == (9000, "0.0.0.0", 5.0)
    monkeypatch.setenv("DCTL_PORT", "9100")
    settings = load_controlplane_settings(named)
    assert (settings.port, settings.host) == (9100, "0.0.0.0")
    assert load_controlplane_settings(named, port=9200, host=None).port == 9200
    assert load_controlplane_settings().port == 9100  # the file was only for that call


def test_a_named_file_must_exist(isolated_home: Path) -> None:
    missing = isolated_home / "nope.toml"
    with pytest.raises(SettingsError, match=f"config file {missing} does not exist"):
        load_controlplane_settings(missing)


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


@pytest.fixture
def log_stream() -> Iterator[Callable[[str], io.StringIO]]:
    """`log_stream(fmt)`: every logger to a fresh stream; the root logger is restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def route(fmt: str) -> io.StringIO:
        stream = io.StringIO()
        configure_logging("info", fmt, stream)
        return stream

    yield route
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", FORMATS)
def test_logs_are_structured_and_never_carry_secrets(
    fmt: str, log_stream: Callable[[str], io.StringIO]
) -> None:
    stream = log_stream(fmt)
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


# Every kind of secret dctl hands out, and how it might show up in a log line.
SECRETS = {
    "api token": "dctl_k3y1d0000000_S3cr3t-Part_0f-th3_t0ken",
    "instance api key": "dctl_ik_Inst4nce-K3y_urlsafe_base64",
    "bootstrap token": "dctl_b00tstrap0000_An0ther-S3cr3t",
}


def _log_everywhere(secret: str) -> None:
    log = logging.getLogger("dctl.redaction")
    log.info("registered with %s", secret)
    log.info("probe", extra={"url": f"http://gpu-1:18000/v1?key={secret}"})
    log.info("header", extra={"headers": {"Authorization": f"Bearer {secret}"}})
    log.info("config", extra={"config": {"service": {"api_key": secret, "port": 18000}}})
    log.info("extra by name", extra={"instance_api_key": secret, "bootstrap_token": secret})
    try:
        raise RuntimeError(f"engine refused key {secret}")
    except RuntimeError:
        log.exception("engine start failed")
    log.info("where", stack_info=True, extra={"note": f"token={secret}"})


@pytest.mark.parametrize("kind", SECRETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_formatter_writes_a_secret_anywhere_in_a_line(
    fmt: str, kind: str, log_stream: Callable[[str], io.StringIO]
) -> None:
    secret = SECRETS[kind]
    stream = log_stream(fmt)
    _log_everywhere(secret)
    out = stream.getvalue()
    lines = out.splitlines()
    assert len(lines) == 7  # one line per record, tracebacks included
    # Not the secret, and not its random part on its own either.
    assert secret not in out and secret.split("_", 2)[2] not in out
    assert "***" in lines[0] and "engine refused key ***" in out
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        assert records[3]["config"]["service"] == {"api_key": "***", "port": 18000}
        assert records[4]["instance_api_key"] == records[4]["bootstrap_token"] == "***"
        assert "RuntimeError" in records[5]["exc"] and "stack" in records[6]


def test_only_secret_fields_are_redacted_by_name(log_stream: Callable[[str], io.StringIO]) -> None:
    stream = log_stream("json")
    logging.getLogger("dctl.redaction").info(
        "revoked", extra={"token_id": "k3y1d", "token_name": "ci", "password": "hunter2"}
    )
    record = json.loads(stream.getvalue())
    assert (record["token_id"], record["token_name"], record["password"]) == ("k3y1d", "ci", "***")


def test_uvicorn_logs_come_out_once_in_our_format(
    log_stream: Callable[[str], io.StringIO],
) -> None:
    access = logging.getLogger("uvicorn.access")
    access.addHandler(logging.StreamHandler(io.StringIO()))  # what uvicorn's own config does
    access.propagate = False
    stream = log_stream("json")
    assert access.handlers == [] and access.propagate
    # uvicorn adds an ANSI-coloured copy of each message; it has no place in a log file.
    access.info("GET /healthz 200", extra={"color_message": "\x1b[1mGET\x1b[0m"})
    record = json.loads(stream.getvalue())
    assert record["msg"] == "GET /healthz 200" and "color_message" not in record


def test_an_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'xml': choose one of json, kv"):
        formatter("xml")


def test_key_value_lines_write_values_as_json(log_stream: Callable[[str], io.StringIO]) -> None:
    stream = log_stream("kv")
    logging.getLogger("dctl.kv").info(
        "state", extra={"draining": True, "gpus": [0, 1], "host": "gpu 1", "labels": {"a": "b"}}
    )
    line = stream.getvalue().strip()
    assert 'draining=true gpus="[0, 1]" host="gpu 1"' in line
    assert 'labels="{\\"a\\": \\"b\\"}"' in line and "\n" not in line
