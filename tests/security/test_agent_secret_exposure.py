"""Threat: the agent's secrets are readable by other users or other processes of the host.

Engines never inherit the agent's `DCTL_*` environment (the bootstrap token may be there) and
get their API key only through a 0600 config file, never a command line; the token, identity
and every file under the agent's data dir are 0600 and the data dir itself 0700 (created so, or
tightened with a warning). Checked on real processes: `/proc/PID/environ` and `cmdline` of a
real engine process, file modes left by a real `dctl agent`.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from agent.engine_process import HttpProber, SubprocessLauncher
from agent.instance_spec import InstanceSpec
from agent.supervisor import Supervisor
from tests.agent.loopback import (
    FakeControlPlane,
    agent_command,
    agent_env,
    agent_log,
    run_agent,
    wait_until,
)
from tests.processes import stop

BOOTSTRAP = "bootstrap-secret-4f1c"
API_KEY = "sk-engine-secret-9d2e"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_real_engine_process_inherits_no_secret_in_its_environment_or_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCTL_BOOTSTRAP_TOKEN", BOOTSTRAP)
    monkeypatch.setenv("DCTL_AGENT_BOOTSTRAP_TOKEN", BOOTSTRAP)
    # The real supervisor and launcher, with the agent's own environment (no env= given).
    engine = [sys.executable, "-c", "import time; time.sleep(120)"]
    supervisor = Supervisor(tmp_path / "run", SubprocessLauncher(), HttpProber(timeout_s=0.2),
                            engine_command=engine)  # fmt: skip
    spec = InstanceSpec(instance_id=7, deployment="demo", digest="0" * 64,
                        snapshot_path=str(tmp_path), port=18007, api_key=API_KEY)  # fmt: skip
    supervisor.ensure(spec)
    try:
        [observed] = supervisor.observed()
        assert observed.pid is not None
        proc = Path(f"/proc/{observed.pid}")
        environ = proc.joinpath("environ").read_bytes().split(b"\0")
        cmdline = proc.joinpath("cmdline").read_bytes().decode()
        assert not [v for v in environ if v.startswith(b"DCTL_")]
        assert BOOTSTRAP.encode() not in b"\0".join(environ)
        assert API_KEY not in cmdline and API_KEY.encode() not in b"\0".join(environ)
        config = supervisor.config_path(7)
        assert API_KEY in config.read_text()  # where the key does go: a file only we can read
        assert mode(config) == 0o600 and mode(supervisor.run_dir) == 0o700
    finally:
        supervisor.stop_all(timeout_s=10)


def test_a_running_agent_keeps_its_data_dir_0700_and_its_secret_files_0600(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    with FakeControlPlane() as cp:
        env = agent_env(tmp_path, DCTL_BOOTSTRAP_TOKEN=BOOTSTRAP)
        agent = run_agent(tmp_path, agent_command(cp.url, data), env)
        try:
            wait_until("a heartbeat", lambda: cp.beats or agent.poll() is not None)
            assert agent.poll() is None, agent_log(tmp_path)
            cmdline = Path(f"/proc/{agent.pid}/cmdline")
            if cmdline.exists():
                assert BOOTSTRAP not in cmdline.read_bytes().decode()
        finally:
            stop(agent)
    assert mode(data) == 0o700
    assert mode(data / "agent") == 0o700
    assert mode(data / "agent" / "run") == 0o700
    for name in ("agent-token", "identity.json", "metrics-port"):
        assert mode(data / "agent" / name) == 0o600, name


def test_a_looser_existing_data_dir_is_tightened_with_a_warning(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "agent").mkdir(parents=True)
    data.chmod(0o755)
    (data / "agent").chmod(0o777)
    with FakeControlPlane(refuse_registration=True) as cp:
        env = agent_env(tmp_path, DCTL_BOOTSTRAP_TOKEN=BOOTSTRAP)
        agent = run_agent(tmp_path, agent_command(cp.url, data), env)
        try:
            assert agent.wait(timeout=60) == 1  # the refused bootstrap token ends it
        finally:
            stop(agent)
    assert mode(data) == 0o700 and mode(data / "agent") == 0o700
    log = agent_log(tmp_path)
    assert f"{data} was mode 755" in log and f"{data / 'agent'} was mode 777" in log


def test_a_bootstrap_token_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    with FakeControlPlane(refuse_registration=True) as cp:
        flagged = agent_command(cp.url, tmp_path / "data", "--bootstrap-token", BOOTSTRAP)
        agent = run_agent(tmp_path, flagged, agent_env(tmp_path))
        assert agent.wait(timeout=60) == 1
        assert "visible to every user of this host" in agent_log(tmp_path)
        from_env = agent_env(tmp_path, DCTL_BOOTSTRAP_TOKEN=BOOTSTRAP)
        agent = run_agent(tmp_path, agent_command(cp.url, tmp_path / "data"), from_env)
        assert agent.wait(timeout=60) == 1
        assert "visible to every user" not in agent_log(tmp_path)
