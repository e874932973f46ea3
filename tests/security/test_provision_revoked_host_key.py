"""Threat: a host key the operator revoked in known_hosts (`@revoked`: the key leaked, the host
was compromised) is accepted by `dctl host provision`, and with `--accept-new-host-key` even
recorded as trusted, while OpenSSH itself refuses it. paramiko's loader skips marker lines.

Provisioning now reads marker lines as ssh does: a revoked key is refused for the hosts its line
names, whether it is new, recorded or a changed key, and nothing is recorded. A host the file
trusts only through `@cert-authority` is refused with a message saying what to do (paramiko
cannot check host certificates). OpenSSH's own `ssh` and `ssh-keygen -F` are the reference.

A real sshd on loopback (tests/sshd.py), real known_hosts files and keys.
"""

# Fixtures imported from tests/provision are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest

from provision.known_hosts import names_host
from provision.ssh import HostKeyError, Remote, SshOptions
from provision.target import SshTarget
from tests.provision.conftest import ssh_client_key, sshd_pair
from tests.sshd import SshServer, client_key, public_key


def target(server: SshServer) -> SshTarget:
    return SshTarget("root", "127.0.0.1", server.port)


def options(key: Path, known_hosts: Path) -> SshOptions:
    return SshOptions(
        key_file=key, known_hosts=known_hosts, accept_new_host_key=True, connect_timeout_s=5
    )


def openssh_connects(
    server: SshServer, key: Path, known_hosts: Path
) -> subprocess.CompletedProcess[str]:
    """What OpenSSH's client does with the same file and `StrictHostKeyChecking accept-new`."""
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-p", str(server.port), "-i", str(key),
         "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
         "-o", "StrictHostKeyChecking=accept-new", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=5", "root@127.0.0.1", "true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def revoked_files(server: SshServer) -> dict[str, str]:
    """Known-hosts files that revoke the server's key, in the forms people write them."""
    key, name = server.host_public_key, f"[127.0.0.1]:{server.port}"
    return {
        "revoked for every host": f"@revoked * {key}\n",
        "recorded, then revoked": f"{name} {key}\n@revoked [127.0.0.1]:* {key}\n",
        "revoked among other hosts": f"@revoked gpu-9,{name} {key}\n",
    }


@pytest.mark.parametrize("form", ["revoked for every host", "recorded, then revoked",
                                  "revoked among other hosts", "hashed"])  # fmt: skip
def test_a_revoked_host_key_is_refused_as_openssh_refuses_it_and_never_recorded(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path, form: str
) -> None:
    server = sshd_pair[0]
    known_hosts = tmp_path / "known_hosts"
    if form == "hashed":  # the name as HashKnownHosts writes it: its salted HMAC
        hashed = paramiko.HostKeys.hash_host(f"[127.0.0.1]:{server.port}")
        known_hosts.write_text(f"@revoked {hashed} {server.host_public_key}\n")
    else:
        known_hosts.write_text(revoked_files(server)[form])
    before = known_hosts.read_text()
    reference = openssh_connects(server, ssh_client_key, known_hosts)
    assert reference.returncode == 255 and "REVOKED" in reference.stderr, reference.stderr
    with pytest.raises(HostKeyError) as refused:
        Remote(target(server), options(ssh_client_key, known_hosts)).connect()
    message = str(refused.value)
    assert "REVOKED HOST KEY" in message and "@revoked" in message
    assert known_hosts.read_text() == before


def test_a_revoked_key_offered_in_place_of_a_recorded_one_is_called_revoked(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path
) -> None:
    server = sshd_pair[1]
    other = public_key(client_key(tmp_path, "old_host_key")).read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(
        f"[127.0.0.1]:{server.port} {' '.join(other)}\n@revoked * {server.host_public_key}\n"
    )
    with pytest.raises(HostKeyError) as refused:
        Remote(target(server), options(ssh_client_key, known_hosts)).connect()
    assert "REVOKED HOST KEY" in str(refused.value) and "CHANGED" not in str(refused.value)


def test_a_key_revoked_only_for_other_hosts_is_still_accepted(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path
) -> None:
    server = sshd_pair[0]
    known_hosts = tmp_path / "known_hosts"
    key = server.host_public_key
    known_hosts.write_text(
        f"@revoked gpu-9.example {key}\n@revoked *,![127.0.0.1]:{server.port} {key}\n"
    )
    with Remote(target(server), options(ssh_client_key, known_hosts)) as remote:
        assert remote.run("true").ok
    assert known_hosts.read_text().endswith(server.known_hosts_line())


def test_a_host_trusted_through_a_certificate_authority_is_refused_with_what_to_do(
    sshd_pair: tuple[SshServer, SshServer], ssh_client_key: Path, tmp_path: Path
) -> None:
    server = sshd_pair[0]
    authority = public_key(client_key(tmp_path, "host_ca")).read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"@cert-authority [127.0.0.1]:* {' '.join(authority)}\n")
    with pytest.raises(HostKeyError) as refused:
        Remote(target(server), options(ssh_client_key, known_hosts)).connect()
    message = str(refused.value)
    assert "@cert-authority" in message and "line 1" in message
    assert "cannot check host certificates" in message and "ssh-keygen -lf" in message
    assert known_hosts.read_text() == f"@cert-authority [127.0.0.1]:* {' '.join(authority)}\n"


@pytest.mark.parametrize(
    "patterns",
    ["[127.0.0.1]:2222", "*", "[127.0.0.?]:2222", "gpu-9,[127.0.0.1]:*", "*,![127.0.0.1]:2222",
     "[127.0.0.1]:22", "127.0.0.1", "[127.0.0.1]:2222*", "[127.0.0.1]:*,!*:22"],
)  # fmt: skip
def test_host_patterns_name_hosts_as_openssh_reads_them(tmp_path: Path, patterns: str) -> None:
    key = public_key(client_key(tmp_path, "k")).read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"{patterns} {' '.join(key)}\n")
    found = subprocess.run(["ssh-keygen", "-F", "[127.0.0.1]:2222", "-f", str(known_hosts)],
                           capture_output=True, text=True)  # fmt: skip
    assert names_host(patterns.split(","), "[127.0.0.1]:2222") == (found.returncode == 0)
