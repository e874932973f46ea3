"""The `dctl` command line: help, version, exit codes, and a light start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DCTL = [sys.executable, "-m", "cli"]
GROUPS = ["up", "server", "agent", "engine", "tui", "host", "model", "deploy", "rollout",
          "rollback", "restart", "status", "events", "db", "token", "metrics",
          "doctor"]  # fmt: skip


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DCTL, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def test_help_lists_every_command_group() -> None:
    result = run("--help")
    assert result.returncode == 0
    commands = {
        line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line.strip()
    }
    assert set(GROUPS) <= commands


def test_version_matches_the_distribution() -> None:
    from importlib.metadata import version

    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"dctl {version('dctl')}"


def test_usage_errors_exit_2() -> None:
    assert run("deploy", "no-such-subcommand").returncode == 2
    assert run("--no-such-flag").returncode == 2


def test_deploy_group_has_its_subcommands() -> None:
    result = run("deploy", "--help")
    for sub in ("create", "list", "show", "scale", "delete"):
        assert sub in result.stdout


def test_help_imports_no_heavy_package() -> None:
    probe = (
        "import sys, json\n"
        "sys.argv = ['dctl', '--help']\n"
        "from cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    loaded = {name.split(".")[0] for name in json.loads(result.stderr.strip().splitlines()[-1])}
    heavy = {"torch", "textual", "fabric", "paramiko", "sqlalchemy", "sqlmodel", "transformers",
             "fastapi", "uvicorn", "engine", "agent", "tui"}  # fmt: skip
    assert loaded & heavy == set()
    # Not even the client: pydantic and httpx alone would double the time `--help` takes, which
    # is why the choices commands offer come from the stdlib-only `protocol.vocabulary`.
    assert loaded & {"pydantic", "pydantic_core", "httpx", "client", "yaml", "rich"} == set()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"DCTL_PORT": "70000"}, "port"),
        ({"DCTL_LOG_FORMAT": "xml"}, "log_format"),
    ],
)
def test_invalid_setting_fails_with_one_line_naming_it(env: dict[str, str], needle: str) -> None:
    from controlplane.settings import SettingsError, load_controlplane_settings

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(SettingsError) as info:
            load_controlplane_settings()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    message = str(info.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize("command", [["server"], ["db", "upgrade"], ["db", "current"]])
def test_a_missing_config_file_is_one_line_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "controlplane.toml"
    result = run(*command, "--config", str(missing), env={"HOME": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: config file {missing} does not exist"]


def test_ctrl_c_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli import app as cli_app

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_app, "app", interrupted)
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    assert info.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"
