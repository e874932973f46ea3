"""`[gateway]` settings: precedence, the cross-field rules, and errors that name the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import GatewaySettings, SettingsError, load_gateway_settings


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DCTL_CONFIG", str(tmp_path / "absent.toml"))
    for var in [v for v in os.environ if v.startswith("DCTL_GATEWAY_")]:
        monkeypatch.delenv(var)


@pytest.fixture
def routes(tmp_path: Path) -> Path:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "deployments:\n"
        "  - deployment: chat\n"
        "    model_names: [chat]\n"
        "    stable: {version_id: 1, version: 'm:1', instances: [{id: 1, host: h,"
        " address: 10.0.0.2, port: 8000, api_key: k}]}\n"
    )
    return path


def test_defaults_file_env_and_flags_in_that_order(
    tmp_path: Path, routes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[gateway]\nroutes_file = "{routes}"\nport = 9001\nmax_inflight = 10\n')
    settings = load_gateway_settings(config)
    assert (settings.port, settings.max_inflight, settings.host) == (9001, 10, "127.0.0.1")
    assert settings.pool_header and settings.max_body_bytes == 8 * 2**20
    assert (settings.rate_limit_rps, settings.rate_limit_burst) == (50.0, 100)
    monkeypatch.setenv("DCTL_GATEWAY_PORT", "9002")
    assert load_gateway_settings(config).port == 9002
    flags = load_gateway_settings(config, port=9003, pool_header=False, host=None)
    assert (flags.port, flags.pool_header, flags.host) == (9003, False, "127.0.0.1")


def test_exactly_one_source_of_routes(routes: Path) -> None:
    with pytest.raises(SettingsError, match=r"exactly one of control_plane .* and routes_file"):
        load_gateway_settings()
    with pytest.raises(SettingsError, match=r"exactly one"):
        load_gateway_settings(None, routes_file=routes, control_plane="http://cp:8700", token="t")
    with pytest.raises(
        SettingsError, match=r"token_file \(--token-file, env DCTL_GATEWAY_TOKEN_FILE\)"
    ):
        load_gateway_settings(None, control_plane="http://cp:8700")
    settings = load_gateway_settings(None, control_plane="http://cp:8700/", token="dctl_x_y")
    assert settings.control_plane == "http://cp:8700"
    assert settings.read_token() == "dctl_x_y"


def test_bad_values_name_the_setting_its_flag_and_env_var(routes: Path, tmp_path: Path) -> None:
    with pytest.raises(
        SettingsError, match=r"invalid setting port \(--port, env DCTL_GATEWAY_PORT\)"
    ):
        load_gateway_settings(None, routes_file=routes, port=70000)
    with pytest.raises(SettingsError, match=r"control_plane .* not an http"):
        load_gateway_settings(None, control_plane="cp:8700", token="t")
    config = tmp_path / "config.toml"
    config.write_text("[gateway]\nrate_limit = 5\n")
    with pytest.raises(
        SettingsError, match=r"unknown setting 'rate_limit' in the \[gateway\] table"
    ):
        load_gateway_settings(config)
    with pytest.raises(SettingsError, match=r"tls_key \(--tls-key.*tls_cert is set: give both"):
        load_gateway_settings(None, routes_file=routes, tls_cert=tmp_path / "c.pem")
    with pytest.raises(SettingsError, match=r"engine_ca_file .* does not exist"):
        load_gateway_settings(None, routes_file=routes, engine_ca_file=tmp_path / "nope.pem")
    with pytest.raises(SettingsError, match=r"pool_header \(--no-pool-header"):
        load_gateway_settings(None, routes_file=routes, pool_header="perhaps")


def test_the_token_file_is_read_and_checked(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("dctl_abc_def\n")
    token_file.chmod(0o600)
    settings = load_gateway_settings(None, control_plane="http://cp", token_file=token_file)
    assert settings.read_token() == "dctl_abc_def"
    token_file.write_text("  \n")
    with pytest.raises(SettingsError, match=r"token_file .* is empty"):
        settings.read_token()
    token_file.unlink()
    with pytest.raises(SettingsError, match=r"token_file .* cannot read"):
        settings.read_token()


def test_the_routes_file_is_json_or_yaml_and_its_errors_are_named(
    routes: Path, tmp_path: Path
) -> None:
    table = GatewaySettings(routes_file=routes).read_routes_file()
    assert table.etag == "file:routes.yaml"
    assert table.deployments[0].stable.instances[0].address == "10.0.0.2"
    as_json = tmp_path / "routes.json"
    as_json.write_text(json.dumps({**table.model_dump(mode="json"), "etag": "mine"}))
    assert GatewaySettings(routes_file=as_json).read_routes_file().etag == "mine"
    as_json.write_text('{"deployments": [{"deployment": "x"}]}')
    with pytest.raises(SettingsError, match=r"routes_file .*deployments\.0\.model_names"):
        GatewaySettings(routes_file=as_json).read_routes_file()
    as_json.write_text("{not json")
    with pytest.raises(SettingsError, match=r"routes_file .* cannot read"):
        GatewaySettings(routes_file=as_json).read_routes_file()


def test_the_request_log_flags_reach_the_settings_and_are_checked(routes: Path) -> None:
    # `dctl gateway --request-log-max-files 0`: refused before anything starts, naming the flag.
    result = subprocess.run(
        [sys.executable, "-m", "cli", "gateway", "--routes-file", str(routes),
         "--request-log-max-files", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "request_log_max_files (--request-log-max-files" in result.stderr
