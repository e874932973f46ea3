"""SshTarget parsing, and Remote against a real OpenSSH sshd on loopback: host keys, commands,
secrets, uploads, connection errors."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from provision.ssh import (
    CommandFailed,
    ConnectError,
    HostKeyError,
    Remote,
    SshOptions,
    mask,
)
from provision.target import SshTarget
from tests.sshd import SshServer, client_key

# --- SshTarget ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "user", "host", "port", "shown"),
    [
        ("root@10.0.0.5", "root", "10.0.0.5", 22, "root@10.0.0.5"),
        (
            "ops@gpu-7.example.com:2222",
            "ops",
            "gpu-7.example.com",
            2222,
            "ops@gpu-7.example.com:2222",
        ),
        ("ops@GPU-7", "ops", "gpu-7", 22, "ops@gpu-7"),
        ("ops@[::1]:2222", "ops", "::1", 2222, "ops@[::1]:2222"),
        ("ops@[fe80::1]", "ops", "fe80::1", 22, "ops@[fe80::1]"),
        ("ops@fe80::1", "ops", "fe80::1", 22, "ops@[fe80::1]"),
        ("gpu-7", "deploy", "gpu-7", 22, "deploy@gpu-7"),
        ("  svc_1@h:65535 ", "svc_1", "h", 65535, "svc_1@h:65535"),
    ],
)
def test_target_parse(text: str, user: str, host: str, port: int, shown: str) -> None:
    target = SshTarget.parse(text, default_user="deploy")
    assert (target.user, target.host, target.port) == (user, host, port)
    assert str(target) == shown
    assert SshTarget.parse(str(target)) == target


def test_target_default_user_is_the_local_user() -> None:
    import getpass

    assert SshTarget.parse("h").user == getpass.getuser()


@pytest.mark.parametrize(
    "text",
    ["", "@h", "root@", "root@h:", "root@h:0", "root@h:65536", "root@h:22x", "root@h:²",
     "root@[::1]:x", "root@::1:2222x", "ro ot@h", "root@h h", "root@-oProxyCommand=x",
     "root@h/x", "root@[]:22", "-x@h"],
)  # fmt: skip
def test_target_parse_refuses_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected USER@HOST\[:PORT\]"):
        SshTarget.parse(text)


def test_known_hosts_name_is_the_openssh_form() -> None:
    assert SshTarget("root", "h").known_hosts_name == "h"
    assert SshTarget("root", "127.0.0.1", 2222).known_hosts_name == "[127.0.0.1]:2222"
    assert SshTarget("root", "::1", 2222).known_hosts_name == "[::1]:2222"


def test_mask_hides_every_secret_longest_first() -> None:
    assert mask("a tok-123 b tok-1234 c", ["tok-123", "tok-1234", ""]) == "a **** b **** c"


# --- host keys ------------------------------------------------------------------------------


def _target(server: SshServer) -> SshTarget:
    return SshTarget("root", "127.0.0.1", server.port)


def _options(key: Path, known_hosts: Path, **more: object) -> SshOptions:
    return SshOptions(key_file=key, known_hosts=known_hosts, connect_timeout_s=5, **more)  # type: ignore[arg-type]


def _keygen_fingerprint(public_key: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(public_key)], capture_output=True, text=True)
    return out.stdout.split()[1]  # "256 SHA256:... comment (ED25519)"


def test_unknown_host_key_is_refused_with_its_fingerprint(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, known_hosts: Path
) -> None:
    server = sshd_pair[0]
    with pytest.raises(HostKeyError) as refused:
        Remote(_target(server), _options(ssh_client_key, known_hosts)).connect()
    message = str(refused.value)
    assert _keygen_fingerprint(server.host_key_path.with_suffix(".pub")) in message
    assert "ssh-ed25519" in message and "--accept-new-host-key" in message
    assert not known_hosts.exists()


def test_new_host_key_accepted_is_recorded_then_trusted(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path
) -> None:
    server = sshd_pair[1]
    known_hosts = tmp_path / "fresh" / "known_hosts"
    options = _options(ssh_client_key, known_hosts, accept_new_host_key=True)
    with Remote(_target(server), options) as remote:
        assert remote.run("echo hi").stdout == "hi\n"
    assert known_hosts.read_text() == server.known_hosts_line()
    assert stat.S_IMODE(known_hosts.stat().st_mode) == 0o600
    assert stat.S_IMODE(known_hosts.parent.stat().st_mode) == 0o700
    found = subprocess.run(
        ["ssh-keygen", "-F", f"[127.0.0.1]:{server.port}", "-f", str(known_hosts)],
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0 and server.host_public_key in found.stdout
    # The next run needs no flag, and records nothing twice.
    with Remote(_target(server), _options(ssh_client_key, known_hosts)) as remote:
        assert remote.run("true").ok
    with Remote(_target(server), options):
        pass
    assert known_hosts.read_text() == server.known_hosts_line()
    # Hashed names (`ssh-keygen -H`, HashKnownHosts yes) are matched too.
    subprocess.run(["ssh-keygen", "-H", "-f", str(known_hosts)], check=True, capture_output=True)
    assert known_hosts.read_text().startswith("|1|")
    with Remote(_target(server), _options(ssh_client_key, known_hosts)):
        pass


def test_changed_host_key_is_always_refused(
    ssh_client_key: Path, known_hosts: Path, tmp_path: Path
) -> None:
    with SshServer(tmp_path / "sshd", [ssh_client_key.with_suffix(".pub")]) as server:
        # A corrupt line (bad base64) elsewhere in the file does not break anything.
        known_hosts.write_text("other.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJunk\n")
        options = _options(ssh_client_key, known_hosts, accept_new_host_key=True)
        with Remote(_target(server), options):
            pass
        recorded = known_hosts.read_text()
        old_fingerprint = _keygen_fingerprint(server.host_key_path.with_suffix(".pub"))
        server.rotate_host_key()  # same port, another ed25519 key: a reinstalled host, or not
        for accept in (False, True):
            options = _options(ssh_client_key, known_hosts, accept_new_host_key=accept)
            with pytest.raises(HostKeyError) as refused:
                Remote(_target(server), options).connect()
            message = str(refused.value)
            assert "CHANGED" in message and old_fingerprint in message
            assert f"ssh-keygen -R '[127.0.0.1]:{server.port}' -f {known_hosts}" in message
        assert known_hosts.read_text() == recorded


# --- commands and files ---------------------------------------------------------------------


@pytest.fixture
def remote(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path
) -> Iterator[Remote]:
    """A Remote connected as root to the first host, its key already trusted."""
    server = sshd_pair[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(server.known_hosts_line())
    with Remote(_target(server), _options(ssh_client_key, known_hosts)) as connected:
        yield connected


def test_run_returns_exit_code_and_output(remote: Remote) -> None:
    result = remote.run("echo out; echo err >&2; exit 3", check=False)
    assert (result.exit_code, result.stdout, result.stderr, result.ok) == (
        3,
        "out\n",
        "err\n",
        False,
    )
    # POSIX sh whatever the login shell; stdin is empty, so nothing waits for input.
    assert remote.run('cat; [ -n "$HOME" ] && echo $((1 + 2))').stdout == "3\n"


def test_check_raises_command_failed_with_stderr(remote: Remote) -> None:
    with pytest.raises(CommandFailed) as failed:
        remote.run("echo 'no space left on device' >&2; exit 28")
    assert failed.value.result.exit_code == 28
    assert "exit code 28" in str(failed.value) and "no space left on device" in str(failed.value)


def test_command_timeout_gives_exit_124(remote: Remote) -> None:
    result = remote.run("sleep 5", check=False, timeout_s=0.5)
    assert result.exit_code == 124 and "timed out" in result.stderr


def test_secrets_are_masked_in_results_and_logs(
    remote: Remote, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    remote.add_secret("s3cr3t-t0ken")
    result = remote.run("echo s3cr3t-t0ken; echo s3cr3t-t0ken >&2; exit 1", check=False)
    assert result.command == "echo ****; echo **** >&2; exit 1"
    assert (result.stdout, result.stderr) == ("****\n", "****\n")
    with pytest.raises(CommandFailed) as failed:
        remote.run("echo s3cr3t-t0ken >&2; false")
    assert "s3cr3t-t0ken" not in str(failed.value)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "$ echo ****; echo **** >&2; exit 1" in logged and "exit 1" in logged
    assert "s3cr3t-t0ken" not in logged


def test_put_bytes_writes_atomically_with_the_mode(remote: Remote, tmp_path: Path) -> None:
    target = tmp_path / "uploaded" / "bootstrap-token"
    target.parent.mkdir()
    remote.put_bytes(b"token-value\n", str(target), mode=0o600)
    assert target.read_bytes() == b"token-value\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    remote.put_bytes(b"x" * 300_000, str(target), mode=0o640)  # replaces, several SFTP writes
    assert target.read_bytes() == b"x" * 300_000
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(target.parent) == ["bootstrap-token"]  # no .tmp-* left behind
    assert remote.read_text(str(target)) == "x" * 300_000


def test_put_file_and_read_text(remote: Remote, tmp_path: Path) -> None:
    local = tmp_path / "agent.toml"
    local.write_text("[agent]\nname = 'h1'\n")
    remote.put_file(local, str(tmp_path / "copy.toml"), mode=0o644)
    assert remote.read_text(str(tmp_path / "copy.toml")) == "[agent]\nname = 'h1'\n"
    assert remote.read_text(str(tmp_path / "missing.toml")) is None


def test_put_into_a_missing_folder_says_so_and_leaves_nothing(
    remote: Remote, tmp_path: Path
) -> None:
    from provision.ssh import ProvisionError

    with pytest.raises(ProvisionError, match="check that its folder exists"):
        remote.put_bytes(b"x", str(tmp_path / "nowhere" / "f"))
    assert not (tmp_path / "nowhere").exists()


# --- connection errors ----------------------------------------------------------------------


def test_closed_port_is_a_connect_error(ssh_client_key: Path, known_hosts: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = SshTarget("root", "127.0.0.1", port)
    with pytest.raises(ConnectError, match=f"connection refused by 127.0.0.1 port {port}.*sshd"):
        Remote(target, _options(ssh_client_key, known_hosts)).connect()


def test_wrong_key_is_a_connect_error(
    sshd_pair: tuple[SshServer, SshServer], tmp_path: Path
) -> None:
    server = sshd_pair[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(server.known_hosts_line())
    stranger = client_key(tmp_path, "stranger")
    with pytest.raises(ConnectError, match=r"authentication failed.*authorized_keys"):
        Remote(_target(server), _options(stranger, known_hosts)).connect()
    missing = tmp_path / "no-such-key"
    with pytest.raises(ConnectError, match=r"no key file .*no-such-key; check --key"):
        Remote(_target(server), _options(missing, known_hosts)).connect()
