"""`dctl host provision` end to end: two real sshd "hosts" on loopback, a real control plane,
the dctl wheel and its dependencies (torch included) from a local wheelhouse, real agents.

The SSH user is root, so each host gets the `dctl` service user (created on this machine, and
removed at the end if this session made it) and a prefix of its own under a world-readable
temporary folder. No systemd runs here: the agents start detached, with a pid file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from client.http import ControlPlaneClient
from provision.wheel import running_wheel
from tests.agent_e2e.conftest import DCTL, Stack, boot_stack, stop_stack
from tests.security.pki import write_ca
from tests.sshd import SshServer, user_exists

# The service user cannot enter root's home, where this machine's default python3 lives (pyenv).
AGENT_SETTINGS = ["--set", "gpu_backend=fake", "--set", "metrics_port=0",
                  "--set", "fake_gpus=1xH200", "--python", "/usr/bin/python3.11"]  # fmt: skip


@dataclass
class Fleet:
    """The control plane, the two hosts and what the CLI runs with."""

    stack: Stack
    hosts: tuple[SshServer, SshServer]
    key: Path
    known_hosts: Path
    base: Path  # the hosts' prefixes live below
    wheelhouse: Path
    env: dict[str, str]
    notes: str = ""  # what the first provisioning said on stderr

    @property
    def api(self) -> ControlPlaneClient:
        return self.stack.api

    def target(self, n: int) -> str:
        return f"root@127.0.0.1:{self.hosts[n].port}"

    def prefix(self, name: str) -> Path:
        return self.base / name

    def dctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*DCTL, *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def provision(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.dctl("host", "provision", "--key", str(self.key), *args)


def _running(pid: int) -> bool:
    """PID is a live process (a zombie waiting for init to reap it is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _agent_pid(prefix: Path) -> int | None:
    try:
        pid = int((prefix / "agent.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
    sshd_pair: tuple[SshServer, SshServer],
    ssh_client_key: Path,
) -> Iterator[Fleet]:
    home = tmp_path_factory.mktemp("provision-home")
    stack = boot_stack(home, "unused")
    # The service user must reach the prefixes: pytest's own folders are 0700.
    base = Path(tempfile.mkdtemp(prefix="dctl-provision-"))
    base.chmod(0o755)
    had_user = user_exists("dctl")
    known = home / "known_hosts"
    known.write_text("".join(h.known_hosts_line() for h in sshd_pair))
    # Every dependency of dctl[engine,gpu], as a host without package-index access needs them.
    wheel = running_wheel(cache_dir=home / "wheel-cache")
    wheelhouse = home / "wheelhouse"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--only-binary=:all:", "--dest", str(wheelhouse), f"{wheel.path}[engine,gpu]",
         # The CPU build that lies on this disk (fake GPUs): a CUDA build is gigabytes.
         "torch==2.13.0"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    env = {**stack.env, "DCTL_URL": stack.url, "DCTL_TOKEN": stack.token}
    fleet = Fleet(stack, sshd_pair, ssh_client_key, known, base, wheelhouse, env)
    try:
        yield fleet
    finally:
        for prefix in base.iterdir():
            pid = _agent_pid(prefix)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        stop_stack(stack)
        shutil.rmtree(base, ignore_errors=True)
        if not had_user and user_exists("dctl"):
            subprocess.run(["userdel", "dctl"], check=False, capture_output=True)


def _hosts_file(fleet: Fleet, path: Path) -> Path:
    entries = [
        {"host": fleet.target(n), "name": name, "prefix": str(fleet.prefix(name)),
         "known_hosts": str(fleet.known_hosts), "labels": {"zone": f"z{n}"}}
        for n, name in enumerate(("host-a", "host-b"))
    ]  # fmt: skip
    path.write_text(yaml.safe_dump({"defaults": {"key": str(fleet.key)}, "hosts": entries}))
    return path


@pytest.fixture(scope="module")
def provisioned(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Both hosts provisioned in parallel by one command; its output."""
    hosts = _hosts_file(fleet, tmp_path_factory.mktemp("inventory") / "hosts.yaml")
    done = fleet.dctl("host", "provision", "-f", str(hosts), "--parallel", "2",
                      "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    fleet.notes = done.stderr
    return done.stdout


def test_two_hosts_are_provisioned_in_parallel_and_register_with_their_preflight(
    fleet: Fleet, provisioned: str
) -> None:
    rows = {line.split()[0]: line for line in provisioned.splitlines()[1:]}
    assert "will not survive a reboot" in fleet.notes  # no systemd on this machine
    for n, name in enumerate(("host-a", "host-b")):
        row = rows[fleet.target(n)]
        assert "provisioned" in row and name in row and "pass" in row, provisioned
        host = fleet.api.get_host(name)
        assert host.labels == {"zone": f"z{n}"}
        assert host.facts is not None and host.facts.preflight_ok()
        assert {c.name for c in host.facts.preflight} >= {"torch", "nvml"}
        prefix = fleet.prefix(name)
        pid = _agent_pid(prefix)
        assert pid is not None, "the agent does not run"
        # The agent runs as the service user, not as root, from the prefix's venv.
        assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam("dctl").pw_uid
        token = prefix / "bootstrap-token"
        mode = token.stat()
        assert stat.S_IMODE(mode.st_mode) == 0o600 and mode.st_uid == pwd.getpwnam("dctl").pw_uid
        config = (prefix / "agent.toml").read_text()
        assert token.read_text().strip() not in config
        assert (prefix / "provisioned.json").exists()


def test_the_bootstrap_token_never_reaches_a_command_line_or_the_log(
    fleet: Fleet, provisioned: str
) -> None:
    secrets = {
        (fleet.prefix(n) / "bootstrap-token").read_text().strip() for n in ("host-a", "host-b")
    }
    logs = list((Path(fleet.env["XDG_DATA_HOME"]) / "dctl" / "provision").glob("*.log"))
    assert logs
    text = "".join(log.read_text() for log in logs)
    assert "$ " in text  # the remote commands are there
    for secret in secrets:
        assert secret not in text
    for sshd in fleet.hosts:
        for secret in secrets:
            assert secret not in sshd.log_text()


def test_a_second_run_changes_nothing(fleet: Fleet, provisioned: str, tmp_path: Path) -> None:
    tokens = len(fleet.api.list_tokens(include_revoked=True))
    pids = {n: _agent_pid(fleet.prefix(n)) for n in ("host-a", "host-b")}
    again = fleet.dctl("host", "provision", "-f", str(_hosts_file(fleet, tmp_path / "h.yaml")),
                       "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    results = [line.split()[1] for line in again.stdout.splitlines()[1:]]
    assert results == ["unchanged", "unchanged"], again.stdout
    assert len(fleet.api.list_tokens(include_revoked=True)) == tokens  # no token minted
    assert {n: _agent_pid(fleet.prefix(n)) for n in pids} == pids  # no agent restarted


def test_an_unknown_host_key_is_refused_then_accepted_with_the_flag(
    fleet: Fleet, provisioned: str, known_hosts: Path
) -> None:
    args = ["host", "provision", fleet.target(0), "--key", str(fleet.key), "--name", "host-a",
            "--prefix", str(fleet.prefix("host-a")), "--known-hosts", str(known_hosts),
            "--labels", "zone=z0", "--wheelhouse", str(fleet.wheelhouse),
            *AGENT_SETTINGS]  # fmt: skip
    refused = fleet.dctl(*args)
    assert refused.returncode == 1
    assert "--accept-new-host-key" in refused.stderr and "SHA256:" in refused.stderr
    assert not known_hosts.exists() or known_hosts.read_text() == ""
    accepted = fleet.dctl(*args, "--accept-new-host-key")
    assert accepted.returncode == 0, accepted.stderr
    assert "unchanged" in accepted.stdout
    assert fleet.hosts[0].host_public_key in known_hosts.read_text()
    # Recorded: the next run needs no flag.
    assert fleet.dctl(*args).returncode == 0


def test_a_changed_host_key_is_refused_even_with_the_flag(
    fleet: Fleet, provisioned: str, known_hosts: Path
) -> None:
    other = fleet.hosts[1].host_public_key
    known_hosts.write_text(f"[127.0.0.1]:{fleet.hosts[0].port} {other}\n")
    refused = fleet.dctl("host", "provision", fleet.target(0), "--key", str(fleet.key),
                         "--known-hosts", str(known_hosts), "--accept-new-host-key",
                         "--name", "host-a", "--dry-run")  # fmt: skip
    assert refused.returncode == 1
    assert "changed" in refused.stderr.lower()
    assert known_hosts.read_text() == f"[127.0.0.1]:{fleet.hosts[0].port} {other}\n"


def test_another_dctl_version_is_replaced_only_with_upgrade_drained_meanwhile(
    fleet: Fleet, provisioned: str, tmp_path: Path
) -> None:
    prefix = fleet.prefix("host-a")
    manifest = prefix / "provisioned.json"
    installed = json.loads(manifest.read_text())
    # As if an older dctl had provisioned it: another wheel digest in the manifest.
    manifest.write_text(json.dumps({**installed, "wheel_digest": "0" * 64}))
    hosts = _hosts_file(fleet, tmp_path / "hosts.yaml")
    args = ["-f", str(hosts), "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS]
    before = _agent_pid(prefix)
    refused = fleet.dctl("host", "provision", *args)
    assert refused.returncode == 1
    assert "--upgrade" in refused.stderr and "000000000000" in refused.stderr
    assert _agent_pid(prefix) == before  # nothing was touched
    upgraded = fleet.dctl("host", "provision", *args, "--upgrade")
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    results = {line.split()[0]: line.split()[1] for line in upgraded.stdout.splitlines()[1:]}
    assert results == {fleet.target(0): "upgraded", fleet.target(1): "unchanged"}
    assert _agent_pid(prefix) not in (None, before)  # the agent was replaced
    assert json.loads(manifest.read_text())["wheel_digest"] == installed["wheel_digest"]
    host = fleet.api.get_host("host-a")
    assert not host.draining
    kinds = [e.kind for e in fleet.api.list_events(limit=50).items if "host-a" in e.message]
    assert any("drain" in k for k in kinds) and any("undrain" in k for k in kinds), kinds


def test_a_python_the_service_user_cannot_reach_is_refused_at_facts(
    fleet: Fleet, provisioned: str, tmp_path: Path
) -> None:
    private = tmp_path / "private"  # 0700, like root's home holding a pyenv
    private.mkdir(mode=0o700)
    python = private / "python3.11"
    shutil.copy2("/usr/bin/python3.11", python)
    prefix = fleet.prefix("host-e")
    failed = fleet.provision(fleet.target(1), "--name", "host-e", "--prefix", str(prefix),
                             "--known-hosts", str(fleet.known_hosts), "--python", str(python),
                             "--wheelhouse", str(fleet.wheelhouse))  # fmt: skip
    assert failed.returncode == 1
    assert "failed at facts" in failed.stderr and "cannot run" in failed.stderr
    assert not prefix.exists()


def test_a_too_old_python_fails_at_facts_with_nothing_installed(
    fleet: Fleet, provisioned: str
) -> None:
    old = fleet.base / "python3.8"
    old.write_text("#!/bin/sh\necho 3.8.10\n")
    old.chmod(0o755)
    prefix = fleet.prefix("host-old")
    failed = fleet.provision(fleet.target(1), "--name", "host-old", "--prefix", str(prefix),
                             "--known-hosts", str(fleet.known_hosts), "--python", str(old),
                             "--wheelhouse", str(fleet.wheelhouse))  # fmt: skip
    assert failed.returncode == 1
    assert "failed at facts" in failed.stderr and "--python" in failed.stderr
    assert not prefix.exists()
    assert "host-old" not in {h.name for h in fleet.api.list_hosts()}


def test_a_failed_install_undoes_everything_it_did(
    fleet: Fleet, provisioned: str, tmp_path: Path
) -> None:
    broken = tmp_path / "wheelhouse"
    broken.mkdir()
    for wheel in fleet.wheelhouse.iterdir():
        if not wheel.name.startswith("pydantic_core"):
            os.link(wheel, broken / wheel.name)
    prefix = fleet.prefix("host-c")
    tokens = len(fleet.api.list_tokens(include_revoked=True))
    failed = fleet.provision(fleet.target(1), "--name", "host-c", "--prefix", str(prefix),
                             "--known-hosts", str(fleet.known_hosts), "--wheelhouse", str(broken),
                             *AGENT_SETTINGS)  # fmt: skip
    assert failed.returncode == 1
    assert "failed at install" in failed.stderr and "pydantic" in failed.stderr
    assert not prefix.exists()
    assert "host-c" not in {h.name for h in fleet.api.list_hosts()}
    assert len(fleet.api.list_tokens(include_revoked=True)) == tokens


def test_dry_run_prints_the_plan_and_changes_nothing(fleet: Fleet, provisioned: str) -> None:
    prefix = fleet.prefix("host-d")
    planned = fleet.provision(fleet.target(1), "--name", "host-d", "--prefix", str(prefix),
                              "--known-hosts", str(fleet.known_hosts), "--dry-run",
                              "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert "planned" in planned.stdout
    assert f"$ mkdir -p {prefix}" in planned.stdout
    assert "pip install" in planned.stdout and "bootstrap-token" in planned.stdout
    assert not prefix.exists()


def test_the_contexts_ca_goes_to_the_agents_too(
    fleet: Fleet, provisioned: str, tmp_path: Path
) -> None:
    write_ca(tmp_path, "ca")  # a private CA: the CLI trusts it, so must the agents
    ca = tmp_path / "ca.pem"
    prefix = fleet.prefix("host-f")
    planned = subprocess.run(
        [*DCTL, "host", "provision", fleet.target(1), "--key", str(fleet.key), "--name", "host-f",
         "--prefix", str(prefix), "--known-hosts", str(fleet.known_hosts), "--dry-run",
         "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS],
        capture_output=True, text=True, env={**fleet.env, "DCTL_CA_FILE": str(ca)}, timeout=300,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    size = len(ca.read_bytes())
    assert f"upload {size} bytes -> $STAGING/control-plane-ca.pem (mode 644)" in planned.stdout
    assert f"{prefix}/control-plane-ca.pem" in planned.stdout


def test_an_ordinary_user_gets_everything_under_its_home_and_a_failing_preflight_is_reported(
    fleet: Fleet, provisioned: str, tmp_path: Path
) -> None:
    """No root, no sudo: the agent runs as the SSH user from ~/.local/share/dctl-agent. Without
    the `engine` extra there is no torch: preflight fails, which the table reports, and the host
    is still a member (exit 0)."""
    user = "dctl-e2e-user"
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", user], check=True, capture_output=True)
    # sshd refuses a locked account even for key logins (UsePAM no): unlock without a password.
    subprocess.run(["usermod", "-p", "*", user], check=True, capture_output=True)
    home = Path(pwd.getpwnam(user).pw_dir)
    prefix = home / ".local/share/dctl-agent"
    server = SshServer(tmp_path / "sshd", [fleet.key.with_suffix(".pub")], users=(user,))
    try:
        server.start()
        known = tmp_path / "known_hosts"
        known.write_text(server.known_hosts_line())
        target = f"{user}@127.0.0.1:{server.port}"
        done = fleet.dctl("host", "provision", target, "--key", str(fleet.key), "--name", "host-u",
                          "--known-hosts", str(known), "--extras", "gpu",
                          "--wheelhouse", str(fleet.wheelhouse), *AGENT_SETTINGS)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        row = done.stdout.splitlines()[1]
        assert "provisioned" in row and "fail:" in row and "torch" in row, done.stdout
        pid = _agent_pid(prefix)
        assert pid is not None and os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam(user).pw_uid
        host = fleet.api.get_host("host-u")
        assert host.facts is not None and not host.facts.preflight_ok()
        removed = fleet.dctl("host", "deprovision", "host-u", "--yes")
        assert removed.returncode == 0, removed.stderr
        assert not _running(pid)
        assert sorted(p.name for p in prefix.iterdir()) == ["data"]
    finally:
        pid = _agent_pid(prefix)
        if pid:
            os.kill(pid, 9)
        server.stop()
        subprocess.run(["userdel", "-r", user], check=False, capture_output=True)


def test_deprovision_removes_the_agent_and_the_host(fleet: Fleet, provisioned: str) -> None:
    prefix = fleet.prefix("host-b")
    pid = _agent_pid(prefix)
    assert pid is not None
    (prefix / "data" / "snapshots").mkdir(exist_ok=True)
    (prefix / "data" / "snapshots" / "weights").write_text("kept")
    done = fleet.dctl("host", "deprovision", "host-b", "--yes")
    assert done.returncode == 0, done.stderr
    assert not _running(pid)
    assert "host-b" not in {h.name for h in fleet.api.list_hosts()}
    left = sorted(p.relative_to(prefix).as_posix() for p in prefix.iterdir())
    assert left == ["data"]
    assert [p.name for p in (prefix / "data").iterdir()] == ["snapshots"]
    assert (prefix / "data" / "snapshots" / "weights").read_text() == "kept"
    again = fleet.dctl("host", "deprovision", "host-b", "--yes")
    assert again.returncode == 1 and "not provisioned from here" in again.stderr
