"""`dctl` against a real control-plane process: what an operator types and what comes back."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.manifest import compute_manifest
from tests.cli.conftest import DCTL, Dctl, Server, run_dctl
from tests.cli.hosts import register_host

# A tiny dense Qwen3 config: enough for the engine's torch-free memory planner.
TINY_CONFIG = {
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
}


def checkpoint(path: Path, weights: bytes = b"\x00" * 4096) -> Path:
    """A checkpoint-shaped directory: config.json, one weights file, one nested file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (path / "model.safetensors").write_bytes(weights)
    (path / "extra").mkdir(exist_ok=True)
    (path / "extra" / "notes.txt").write_text("hello")
    return path


def ok(result: Any) -> Any:
    assert result.code == 0, (result.code, result.stdout, result.stderr)
    return result


def as_json(result: Any) -> Any:
    return json.loads(ok(result).stdout)


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("error: ") and "Traceback" not in text
    return lines[0]


# --- server start-up and the credentials file ---------------------------------------------------


def test_first_start_saves_the_admin_token_and_prints_it_only_on_a_terminal(
    server: Server,
) -> None:
    # stdout is a file here, not a terminal: the token is saved, never printed (a terminal
    # shows it once: tests/security/test_admin_token_disclosure.py).
    assert server.admin_token.startswith("dctl_")
    assert not any(server.admin_token in line for line in server.lines)
    creds = Path(server.env["XDG_CONFIG_HOME"]) / "dctl" / "credentials"
    assert any(f"saved only in {creds} (mode 0600)" in line for line in server.lines)
    assert creds.stat().st_mode & 0o777 == 0o600
    assert f'token = "{server.admin_token}"' in creds.read_text()
    assert f'url = "{server.url}"' in creds.read_text()


def test_a_restart_prints_no_token_and_an_existing_file_is_only_added_to(
    tmp_path: Path,
) -> None:
    from tests.cli.conftest import start_server

    creds = tmp_path / "config" / "dctl" / "credentials"
    creds.parent.mkdir(parents=True)
    mine = '# hand-written\ncurrent = "prod"\n[contexts.prod]\nurl = "https://prod:8700"\n'
    creds.write_text(mine)
    creds.chmod(0o600)
    first = start_server(tmp_path)
    first.stop()
    text = creds.read_text()
    assert text.startswith(mine)  # nothing of the old file changed, not even `current`
    assert "[contexts.default]" in text and first.admin_token in text
    assert any("dctl context use default" in line for line in first.lines)

    again = start_server(tmp_path, migrate=False)
    again.stop()
    assert again.admin_token == ""
    assert not any("dctl_" in line for line in again.lines)
    assert creds.read_text() == text


def test_the_server_refuses_a_database_that_is_behind(tmp_path: Path) -> None:
    from tests.cli.conftest import isolated_env

    db = f"sqlite:///{tmp_path / 'behind.db'}"
    result = run_dctl("server", "--db", db, "--port", "1", env=isolated_env(tmp_path))
    assert result.returncode == 1
    # Alembic may log a line before the refusal; the refusal is one line, the last one.
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "run `dctl db upgrade`" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "config" / "dctl" / "credentials").exists()


def test_a_busy_port_fails_before_any_token_is_minted(tmp_path: Path) -> None:
    import socket

    from tests.cli.conftest import isolated_env

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        db = f"sqlite:///{tmp_path / 'x.db'}"
        result = run_dctl(
            "server", "--migrate", "--db", db, "--port", port, env=isolated_env(tmp_path)
        )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert "dctl_" not in result.stdout
    assert not (tmp_path / "config" / "dctl" / "credentials").exists()


def test_db_upgrade_downgrade_current(tmp_path: Path, dctl: Dctl) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert "empty" in ok(dctl("db", "current", "--db", db)).stdout
    from controlplane.migrate import head

    assert ok(dctl("db", "upgrade", "--db", db)).stdout.strip() == f"database at {head()}"
    assert "up to date" in ok(dctl("db", "current", "--db", db)).stdout
    assert "base" in ok(dctl("db", "downgrade", "base", "--db", db)).stdout
    bad = dctl("db", "downgrade", "no-such-rev", "--db", db)
    assert bad.code == 2 and "no-such-rev" in one_error_line(bad.stderr)
    wrong = dctl("db", "upgrade", "--db", "mysql://x/y")
    assert wrong.code == 2 and "sqlite:///" in one_error_line(wrong.stderr)


# --- models ---------------------------------------------------------------------------------------


def test_register_computes_the_manifest_and_memory_plan(
    tmp_path: Path, dctl: Dctl, server: Server
) -> None:
    from engine.config import ModelConfig
    from engine.memory import plan_memory

    ckpt = checkpoint(tmp_path / "ckpt")
    out = ok(dctl("model", "register", "tiny:v1", str(ckpt))).stdout
    assert "registered tiny:v1" in out and "memory plan (bf16)" in out
    shown = as_json(dctl("model", "show", "tiny:v1", "--json"))
    manifest = compute_manifest(ckpt)
    assert shown["digest"] == manifest.digest()
    assert [f["path"] for f in shown["manifest"]["files"]] == [
        "config.json",
        "extra/notes.txt",
        "model.safetensors",
    ]
    assert shown["source_uri"] == str(ckpt.resolve())
    expected = plan_memory(ModelConfig.from_hf(TINY_CONFIG), "bf16", 1, 256)
    assert shown["memory_plan"]["weights_bytes"] == expected.weights_bytes
    assert (
        shown["memory_plan"]["kv_bytes_per_token"] == expected.kv_bytes_per_token == 2 * 2 * 8 * 2
    )
    # The family whose rules sized it, for rollouts to compare decoding within a family only.
    assert shown["memory_plan"]["family"] == "sdar"
    assert "sdar" in ok(dctl("model", "show", "tiny:v1")).stdout
    listed = as_json(dctl("model", "list", "--json"))
    assert {(m["name"], v["version"]) for m in listed for v in m["versions"]} >= {("tiny", "v1")}
    table = ok(dctl("model", "list")).stdout
    assert "tiny" in table and manifest.digest()[:12] in table


def test_a_version_is_immutable(tmp_path: Path, dctl: Dctl) -> None:
    ckpt = checkpoint(tmp_path / "ckpt")
    ok(dctl("model", "register", "imm:v1", str(ckpt)))
    ok(dctl("model", "register", "imm:v1", str(ckpt)))  # same bytes: nothing to do
    (ckpt / "model.safetensors").write_bytes(b"\x01" * 4096)
    again = dctl("model", "register", "imm:v1", str(ckpt))
    assert again.code == 1
    assert "409" in one_error_line(again.stderr)


def test_a_diffusion_line_with_a_parent(tmp_path: Path, dctl: Dctl) -> None:
    ok(dctl("model", "register", "fam:base", str(checkpoint(tmp_path / "a"))))
    child = checkpoint(tmp_path / "b", weights=b"\x02" * 100)
    ok(dctl("model", "register", "fam:dllm", str(child), "--line", "diffusion",
            "--parent", "fam:base"))  # fmt: skip
    shown = as_json(dctl("model", "show", "fam:dllm", "--json"))
    assert (shown["line"], shown["parent"]) == ("diffusion", "fam:base")
    ok(dctl("model", "deprecate", "fam:base"))
    assert as_json(dctl("model", "show", "fam:base", "--json"))["deprecated"] is True


def test_a_checkpoint_the_engine_cannot_size_is_registered_without_a_plan(
    tmp_path: Path, dctl: Dctl
) -> None:
    ckpt = tmp_path / "odd"
    ckpt.mkdir()
    (ckpt / "weights.bin").write_bytes(b"abc")
    out = ok(dctl("model", "register", "odd:v1", str(ckpt))).stdout
    assert "memory plan: not stored" in out and "config.json" in out
    assert as_json(dctl("model", "show", "odd:v1", "--json"))["memory_plan"] is None


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["model", "register", "no-version", "."], 2, "NAME:VERSION"),
        # Read by VersionRef.parse, so each half is held to its rule before anything is hashed.
        (["model", "register", "Demo:v1", "."], 2, "NAME: lowercase letters"),
        (["model", "register", "x:v1", ".", "--parent", "x"], 2, "--parent 'x': write it as"),
        (["model", "deprecate", "x:v1:y"], 2, "NAME:VERSION"),
        (["model", "register", "x:v1", "/no/such/dir"], 1, "no such directory"),
        (["model", "register", "x:v1", ".", "--line", "weird"], 2, ""),
        (["model", "show", "missing:v9"], 1, "not found"),
    ],
)
def test_model_errors(dctl: Dctl, args: list[str], code: int, needle: str) -> None:
    result = dctl(*args)
    assert result.code == code, result
    if needle:
        assert needle in one_error_line(result.stderr)


# --- hosts and deployments ---------------------------------------------------------------------


def test_hosts_and_a_deployment_end_to_end(tmp_path: Path, dctl: Dctl, server: Server) -> None:
    register_host(server, dctl, "gpu-a", gpus=2)
    register_host(server, dctl, "gpu-b", gpus=8)
    hosts = {h["name"]: h for h in as_json(dctl("host", "list", "--json"))}
    assert len(hosts["gpu-b"]["gpus"]) == 8 and hosts["gpu-a"]["state"] == "ready"
    assert "gpu-b" in ok(dctl("host", "list")).stdout
    shown = ok(dctl("host", "show", "gpu-a")).stdout
    assert shown.count("H100") == 2 and "80.0 GiB" in shown

    ok(dctl("model", "register", "web:v1", str(checkpoint(tmp_path / "ckpt"))))
    config = tmp_path / "engine.yaml"
    config.write_text("model:\n  block_size: 4\n  threshold: 0.9\n")
    created = as_json(dctl("deploy", "create", "web", "--model", "web:v1", "--hosts",
                           "gpu-a,gpu-b", "--engine-config", str(config), "--json"))  # fmt: skip
    assert sorted(i["host"] for i in created["instances"]) == ["gpu-a", "gpu-b"]
    assert created["engine_config"] == {"model": {"block_size": 4, "threshold": 0.9}}

    scaled = as_json(dctl("deploy", "scale", "web", "2", "--json"))
    assert len(scaled["instances"]) == 4
    assert len({(i["host"], i["port"]) for i in scaled["instances"]}) == 4
    one_each = as_json(dctl("deploy", "configure", "web", "--gpus-per-instance", "1", "--json"))
    assert sorted(i["gpu_indices"] for i in one_each["instances"]) == [[0], [0], [1], [1]]
    too_many = dctl("deploy", "configure", "web", "--gpus-per-instance", "2")
    assert too_many.code == 1 and "host gpu-a" in one_error_line(too_many.stderr)
    assert "4 GPU(s) asked (2 instance(s) × 2), 2 free of 2" in too_many.stderr
    assert "web" in ok(dctl("deploy", "list")).stdout
    assert "gpu-b" in ok(dctl("deploy", "show", "web")).stdout

    ok(dctl("host", "drain", "gpu-a"))
    assert as_json(dctl("host", "show", "gpu-a", "--json"))["draining"] is True
    ok(dctl("host", "undrain", "gpu-a"))
    status = as_json(dctl("status", "--json"))
    assert status["gpus"] >= 10 and status["deployments"] >= 1

    ok(dctl("deploy", "delete", "web", "--yes"))
    gone = dctl("deploy", "show", "web")
    assert gone.code == 1 and "not found" in one_error_line(gone.stderr)
    ok(dctl("host", "remove", "gpu-a", "--yes"))
    assert "gpu-a" not in {h["name"] for h in as_json(dctl("host", "list", "--json"))}


def test_deploy_usage_errors_exit_2(dctl: Dctl, tmp_path: Path) -> None:
    assert dctl("deploy", "create", "x", "--model", "m:v1").code == 2  # no placement
    assert dctl("deploy", "create", "x", "--model", "m", "--hosts", "a").code == 2
    bad_model = dctl("deploy", "create", "x", "--model", "m:", "--hosts", "a")
    assert bad_model.code == 2 and "--model 'm:'" in one_error_line(bad_model.stderr)
    bad_name = dctl("deploy", "create", "Bad_Name", "--model", "m:v1", "--hosts", "a")
    assert bad_name.code == 2 and "lowercase" in one_error_line(bad_name.stderr)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    bad = dctl("deploy", "create", "x", "--model", "m:v1", "--hosts", "a",
               "--engine-config", str(listy))  # fmt: skip
    assert bad.code == 2 and str(listy) in one_error_line(bad.stderr)


# --- tokens, roles, contexts, events -------------------------------------------------------------


def test_token_secret_is_shown_once_and_roles_are_enforced(dctl: Dctl, server: Server) -> None:
    created = dctl("token", "create", "reader", "--role", "viewer", "--expires", "1h")
    secret = ok(created).stdout.strip()
    assert secret.startswith("dctl_") and "shown only this once" in created.stderr
    listing = ok(dctl("token", "list")).stdout + json.dumps(
        as_json(dctl("token", "list", "--json"))
    )
    assert secret not in listing and "reader" in listing

    viewer = {"DCTL_URL": server.url, "DCTL_TOKEN": secret}
    ok(dctl("host", "list", env=viewer))
    denied = dctl("token", "list", env=viewer)
    assert denied.code == 1 and "admin" in one_error_line(denied.stderr)
    assert "403" in denied.stderr

    ok(dctl("token", "revoke", "reader"))
    revoked = dctl("host", "list", env=viewer)
    assert revoked.code == 1 and "401" in one_error_line(revoked.stderr)
    assert "reader" in ok(dctl("token", "list", "--all")).stdout


def test_token_list_shows_what_each_token_may_do_beyond_its_role(dctl: Dctl) -> None:
    ok(dctl("token", "create", "smoke", "--role", "client", "--allow-pool-pin",
            "--max-concurrency", "8"))  # fmt: skip
    ok(dctl("token", "create", "rack", "--role", "bootstrap", "--labels", "tier=prod"))
    rows = {line.split()[1]: line for line in ok(dctl("token", "list")).stdout.splitlines()[1:]}
    assert "pool-pin, max 8" in rows["smoke"] and "tier=prod" in rows["rack"]


@pytest.mark.parametrize(
    "args",
    [
        ["token", "create", "x", "--role", "king"],
        ["token", "create", "x", "--role", "viewer", "--expires", "soon"],
        ["token", "create", "x"],
        ["host", "nosuch"],
    ],
)
def test_token_usage_errors_exit_2(dctl: Dctl, args: list[str]) -> None:
    assert dctl(*args).code == 2


def test_client_tokens_are_scoped_to_deployments_that_exist(dctl: Dctl) -> None:
    refused = dctl("token", "create", "app", "--role", "client", "--deployments", "nosuch")
    assert refused.code == 1 and "nosuch" in one_error_line(refused.stderr)
    wrong_role = dctl("token", "create", "app", "--role", "viewer", "--deployments", "a")
    assert wrong_role.code == 2 and "client" in one_error_line(wrong_role.stderr)
    secret = ok(dctl("token", "create", "app-all", "--role", "client")).stdout.strip()
    assert secret.startswith("dctl_")
    listed = {t["name"]: t for t in as_json(dctl("token", "list", "--json"))}
    assert listed["app-all"]["role"] == "client" and listed["app-all"]["deployments"] is None


def test_contexts_list_and_use(dctl: Dctl, server: Server) -> None:
    listed = as_json(dctl("context", "list", "--json"))
    default = {"name": "default", "url": server.url, "current": True, "token": True}
    assert {**default, "ca_file": None} in listed
    table = ok(dctl("context", "list")).stdout
    assert "default" in table and server.admin_token not in table
    missing = dctl("context", "use", "nope")
    assert missing.code == 1 and "known: default" in one_error_line(missing.stderr)
    assert "current context: default" in ok(dctl("context", "use", "default")).stdout


def test_events_list_filter_and_follow(dctl: Dctl, server: Server) -> None:
    ok(dctl("token", "create", "evt-probe", "--role", "viewer"))
    events = as_json(dctl("events", "--json"))
    assert any(e["kind"] == "token.created" and "evt-probe" in e["message"] for e in events)
    ids = [e["id"] for e in events]
    assert ids == sorted(ids)
    only = as_json(dctl("events", "--kind", "token.created", "--json"))
    assert only and {e["kind"] for e in only} == {"token.created"}
    paged = as_json(dctl("events", "--after", "0", "--limit", "2", "--json"))
    assert [e["id"] for e in paged][:3] == sorted(e["id"] for e in paged)[:3]
    assert len(paged) >= len(events)

    follow = subprocess.Popen(
        [*DCTL, "events", "--follow", "--json", "--interval", "0.2"],
        env={**server.env, "DCTL_URL": server.url, "DCTL_TOKEN": server.admin_token},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        ok(dctl("token", "create", "evt-live", "--role", "viewer"))
        assert follow.stdout is not None
        deadline = time.monotonic() + 30
        seen = []
        while time.monotonic() < deadline:
            line = follow.stdout.readline()
            seen.append(line)
            if "evt-live" in line:
                assert json.loads(line)["kind"] == "token.created"
                break
        else:
            raise AssertionError(f"no live event in {seen}")
    finally:
        follow.terminate()
        follow.wait(10)


# --- exit codes as a shell sees them -----------------------------------------------------------


def test_exit_codes_in_a_real_process(tmp_path: Path, server: Server) -> None:
    from tests.cli.conftest import isolated_env

    env = isolated_env(tmp_path)
    unreachable = run_dctl("host", "list", env={**env, "DCTL_URL": "http://127.0.0.1:1"})
    assert unreachable.returncode == 1
    assert "cannot reach the control plane" in one_error_line(unreachable.stderr)
    schemeless = run_dctl("host", "list", env={**env, "DCTL_URL": "127.0.0.1:8700"})
    assert schemeless.returncode == 1
    assert "must be http://HOST[:PORT]" in one_error_line(schemeless.stderr)
    nothing = run_dctl("status", env=env)
    assert nothing.returncode == 1 and "dctl server" in one_error_line(nothing.stderr)
    good = {**env, "DCTL_URL": server.url, "DCTL_TOKEN": server.admin_token}
    assert run_dctl("status", env=good).returncode == 0
    assert run_dctl("deploy", "scale", "x", "-1", env=good).returncode == 2


@pytest.mark.postgres
def test_db_commands_on_postgresql(dctl: Dctl) -> None:
    import os
    import socket
    import uuid

    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no PostgreSQL listens on 127.0.0.1:5432")
        pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    import psycopg

    from controlplane.migrate import head

    name = f"dctl_cli_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as pg:
        pg.execute(f'CREATE DATABASE "{name}"')
        try:
            url = f"postgresql://postgres@127.0.0.1:5432/{name}"
            assert "empty" in ok(dctl("db", "current", "--db", url)).stdout
            assert ok(dctl("db", "upgrade", "--db", url)).stdout.strip() == f"database at {head()}"
            assert "up to date" in ok(dctl("db", "current", "--db", url)).stdout
            assert "base" in ok(dctl("db", "downgrade", "base", "--db", url)).stdout
        finally:
            pg.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    wrong = dctl("db", "current", "--db", "postgresql://nobody:secret@127.0.0.1:1/x")
    assert wrong.code == 1
    line = one_error_line(wrong.stderr)
    assert "secret" not in line and "127.0.0.1" in line
