"""The facts script, run for real with this machine's sh, against what Python itself sees."""

from __future__ import annotations

import os
import platform
import pwd
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from provision.facts import (
    HostFacts,
    facts_script,
    hard_failures,
    parse_facts,
    run_facts,
)
from provision.ssh import CommandResult, ProvisionError

SYSTEM_PYTHON = "/usr/bin/python3.11"
# Free space moves while the tests run (other processes write): close is good enough.
DISK_SLACK = 256 * 2**20
GOOD = HostFacts(
    os_name="Debian GNU/Linux 12 (bookworm)", kernel="Linux", arch="x86_64",
    python="/usr/bin/python3.11", python_version=(3, 11, 2), has_venv=True,
    free_bytes=50 * 2**30, driver_version="550.54.15", gpu_count=8, systemd=True,
    uid=1000, user="ops", home="/home/ops", sudo=True,
)  # fmt: skip


def run_script(script: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def version_of(python: str) -> tuple[int, int, int]:
    code = "import sys; print('%d.%d.%d' % sys.version_info[:3])"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    major, minor, micro = out.stdout.strip().split(".")
    return int(major), int(minor), int(micro)


def fake_program(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def python311() -> str:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is not installed here")
    return SYSTEM_PYTHON


@pytest.fixture
def bare_bin(tmp_path: Path) -> Path:
    """A PATH directory with every program of /usr/bin and /bin except the Pythons."""
    bin_dir = tmp_path / "bare-bin"
    bin_dir.mkdir()
    for system_dir in (Path("/usr/bin"), Path("/bin")):
        for program in system_dir.iterdir():
            link = bin_dir / program.name
            if not program.name.startswith("python") and not link.exists():
                link.symlink_to(program)
    return bin_dir


def test_facts_match_what_python_sees(tmp_path: Path, python311: str) -> None:
    prefix = tmp_path / "not" / "yet" / "there"
    facts = parse_facts(run_script(facts_script(str(prefix), python311)))

    uname = os.uname()
    assert (facts.kernel, facts.arch) == (uname.sysname, uname.machine)
    assert facts.os_name == platform.freedesktop_os_release()["PRETTY_NAME"]
    assert facts.python == python311
    assert facts.python_version == version_of(python311)
    venv_ok = subprocess.run([python311, "-c", "import venv, ensurepip"], capture_output=True)
    assert facts.has_venv is (venv_ok.returncode == 0)
    assert facts.free_bytes is not None
    assert abs(facts.free_bytes - shutil.disk_usage(tmp_path).free) < DISK_SLACK
    assert facts.systemd is os.path.isdir("/run/systemd/system")
    assert facts.uid == os.getuid()
    assert facts.user == pwd.getpwuid(os.getuid()).pw_name
    assert facts.home == os.environ["HOME"]
    sudo_ok = shutil.which("sudo") is not None and (
        subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
    )
    assert facts.sudo is sudo_ok
    if shutil.which("nvidia-smi") is None:
        assert (facts.driver_version, facts.gpu_count) == (None, 0)
    assert hard_failures(facts, want_root=False, min_free_bytes=0) == []


def test_tilde_prefix_is_the_home_of_the_ssh_user(tmp_path: Path) -> None:
    # HOME on another file system than the working directory: an unexpanded `~` would
    # measure the working directory's disk instead.
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    home = Path(os.path.realpath("/dev/shm")) / f"dctl-home-{os.getpid()}"
    home.mkdir()
    try:
        env = {**os.environ, "HOME": str(home)}
        facts = parse_facts(run_script(facts_script("~/.local/share/x", None), env, tmp_path))
        assert facts.home == str(home)
        assert facts.free_bytes is not None
        assert abs(facts.free_bytes - shutil.disk_usage(home).free) < DISK_SLACK
        if os.stat(home).st_dev != os.stat(tmp_path).st_dev:
            assert abs(facts.free_bytes - shutil.disk_usage(tmp_path).free) > DISK_SLACK
    finally:
        home.rmdir()


def test_found_python_is_the_first_new_enough(bare_bin: Path, python311: str) -> None:
    fake_program(bare_bin / "python3.13", "exit 127")  # a pyenv shim of a missing version
    fake_program(bare_bin / "python3.12", "echo 3.10.1")  # misnamed, too old
    (bare_bin / "python3.11").symlink_to(python311)
    fake_program(bare_bin / "python3", "echo 3.12.0")  # newer, but python3.11 comes first
    env = {**os.environ, "PATH": str(bare_bin)}
    facts = parse_facts(run_script(facts_script("/", None), env))
    assert facts.python == str(bare_bin / "python3.11")
    assert facts.python_version == version_of(python311)


def test_best_old_python_is_reported(bare_bin: Path) -> None:
    fake_program(bare_bin / "python3.12", "echo 3.7.1")
    fake_program(bare_bin / "python3", "echo 3.8.10")
    env = {**os.environ, "PATH": str(bare_bin)}
    facts = parse_facts(run_script(facts_script("/", None), env))
    assert (facts.python, facts.python_version) == (str(bare_bin / "python3"), (3, 8, 10))
    failures = hard_failures(facts, want_root=False, min_free_bytes=0)
    assert len(failures) == 1 and "too old" in failures[0] and "--python" in failures[0]


def test_no_python_at_all(bare_bin: Path) -> None:
    env = {**os.environ, "PATH": str(bare_bin)}
    facts = parse_facts(run_script(facts_script("/", None), env))
    assert (facts.python, facts.python_version, facts.has_venv) == ("", None, False)
    [failure] = hard_failures(facts, want_root=False, min_free_bytes=0)
    assert "no working Python" in failure and "--python" in failure


def test_named_old_python_fails_naming_the_flag(tmp_path: Path) -> None:
    old = fake_program(tmp_path / "python3.8", "echo 3.8.10")
    facts = parse_facts(run_script(facts_script(str(tmp_path), str(old))))
    assert (facts.python, facts.python_version) == (str(old), (3, 8, 10))
    [failure] = hard_failures(facts, want_root=False, min_free_bytes=0)
    assert "3.8.10" in failure and "--python" in failure


def test_named_python_is_the_only_one_looked_at(tmp_path: Path) -> None:
    facts = parse_facts(run_script(facts_script(str(tmp_path), str(tmp_path / "nope"))))
    assert (facts.python, facts.python_version) == (str(tmp_path / "nope"), None)


def test_nvidia_smi_gives_driver_and_gpu_count(tmp_path: Path) -> None:
    fake_program(tmp_path / "bin" / "nvidia-smi", "echo 550.54.15; echo 550.54.15")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    facts = parse_facts(run_script(facts_script(str(tmp_path), None), env))
    assert (facts.driver_version, facts.gpu_count) == ("550.54.15", 2)


def test_broken_nvidia_smi_gives_no_driver(tmp_path: Path) -> None:
    complaint = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    fake_program(tmp_path / "bin" / "nvidia-smi", f"echo '{complaint}'; exit 9")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    facts = parse_facts(run_script(facts_script(str(tmp_path), None), env))
    assert (facts.driver_version, facts.gpu_count) == (None, 0)


def test_a_value_cannot_forge_another_line(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": f"{tmp_path}\nGPU_COUNT=9\nSUDO=1"}
    facts = parse_facts(run_script(facts_script(str(tmp_path), None), env))
    assert facts.home == f"{tmp_path} GPU_COUNT=9 SUDO=1"
    assert facts.gpu_count == 0


def test_script_runs_under_dash_and_bash(tmp_path: Path) -> None:
    for shell in ("dash", "bash"):
        if shutil.which(shell) is None:
            continue
        done = subprocess.run(
            [shell, "-c", facts_script(str(tmp_path), None)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert parse_facts(done.stdout).kernel == "Linux"


def test_parse_names_a_missing_key() -> None:
    lines = [f"{key}=1" for key in ("OS_NAME", "KERNEL", "ARCH", "PYTHON", "PYTHON_VERSION")]
    with pytest.raises(ValueError, match="HAS_VENV"):
        parse_facts("\n".join(lines))


def test_parse_ignores_other_lines_and_names_a_bad_number(tmp_path: Path) -> None:
    out = "Welcome to the host!\nNOT_A_KEY=1\n" + run_script(facts_script(str(tmp_path), None))
    assert parse_facts(out).kernel == "Linux"
    with pytest.raises(ValueError, match="GPU_COUNT"):
        parse_facts(out + "GPU_COUNT=lots\n")


def test_good_host_has_no_failures() -> None:
    assert hard_failures(GOOD, want_root=True, min_free_bytes=2**30) == []
    root = replace(GOOD, uid=0, user="root", sudo=False)
    assert hard_failures(root, want_root=True, min_free_bytes=2**30) == []


@pytest.mark.parametrize(
    ("facts", "words"),
    [
        (replace(GOOD, kernel="Darwin", os_name="Darwin"), ["not Linux", "Darwin"]),
        (replace(GOOD, python="", python_version=None), ["no working Python", "--python"]),
        (replace(GOOD, python_version=(3, 10, 12)), ["3.10.12", "too old", "--python"]),
        (replace(GOOD, has_venv=False), ["apt-get install python3-venv"]),
        (replace(GOOD, free_bytes=2**29), ["512.0 MiB", "2.0 GiB", "--prefix"]),
        (replace(GOOD, sudo=False), ["--sudo", "ops", "passwordless sudo"]),
    ],
)
def test_each_hard_failure_says_what_to_do(facts: HostFacts, words: list[str]) -> None:
    [failure] = hard_failures(facts, want_root=True, min_free_bytes=2 * 2**30)
    for word in words:
        assert word in failure


def test_without_sudo_asked_a_plain_user_is_fine() -> None:
    assert hard_failures(replace(GOOD, sudo=False), want_root=False, min_free_bytes=0) == []


class LocalRemote:
    """A stand-in for Remote that runs commands on this machine."""

    def __init__(self, stdout: str | None = None) -> None:
        self.stdout = stdout

    def run(self, command: str, *, check: bool = True, timeout_s: float | None = None) -> object:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        stdout = done.stdout if self.stdout is None else self.stdout
        return CommandResult("facts", done.returncode, stdout, done.stderr)


def test_run_facts_runs_the_script(tmp_path: Path) -> None:
    facts = run_facts(LocalRemote(), str(tmp_path), None)  # type: ignore[arg-type]
    assert facts.uid == os.getuid()


def test_run_facts_garbled_output_is_a_provision_error(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match="KERNEL"):
        run_facts(LocalRemote("sh: syntax error\n"), str(tmp_path), None)  # type: ignore[arg-type]
