"""What provisioning learns about a host before it installs anything, and what stops it there.

One POSIX sh script (`facts_script`) runs on the host and prints `KEY=VALUE` lines; `parse_facts`
turns them into `HostFacts`; `hard_failures` says, in sentences a user can act on, why the host
cannot become a fleet member. The script survives missing commands (no nvidia-smi, no sudo, no
systemd) and runs under dash, Debian's /bin/sh.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from provision.ssh import Remote

MIN_PYTHON = (3, 11)
# Tried in this order when no --python is given; the first new enough one wins.
PYTHON_CANDIDATES = ("python3.13", "python3.12", "python3.11", "python3")
_KEYS = (
    "OS_NAME", "KERNEL", "ARCH", "PYTHON", "PYTHON_VERSION", "HAS_VENV", "FREE_KB",
    "DRIVER_VERSION", "GPU_COUNT", "SYSTEMD", "UID", "USER", "HOME", "SUDO",
)  # fmt: skip
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True)
class HostFacts:
    """What provisioning learned about the remote host."""

    os_name: str  # PRETTY_NAME of /etc/os-release, or uname -s
    kernel: str  # uname -s (must be "Linux")
    arch: str  # uname -m
    python: str  # the interpreter used ("" when none was found and none was named)
    python_version: tuple[int, int, int] | None  # None: not found or does not run
    has_venv: bool  # `python -c "import venv, ensurepip"` works (Debian needs python3-venv)
    free_bytes: int | None  # free disk at the prefix (or its nearest existing parent)
    driver_version: str | None  # nvidia-smi's driver version, None without nvidia-smi
    gpu_count: int
    systemd: bool  # /run/systemd/system exists (systemd is PID 1)
    uid: int  # id -u of the SSH user
    user: str  # id -un
    home: str  # $HOME
    sudo: bool  # `sudo -n true` succeeds (passwordless sudo)


# Kept free of bash-isms (dash runs it) and of shell variables named like the keys: bash's UID
# is read-only. Every value goes through `emit`, which flattens newlines so one bad value
# cannot forge another key's line.
_SCRIPT = r"""
emit() { printf '%s=%s\n' "$1" "$(printf '%s' "$2" | tr '\r\n' '  ')"; }
pyver() {
    "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null | head -n 1
}
score() {
    case "$1" in [0-9]*.[0-9]*) ;; *) echo 0; return ;; esac
    major=${1%%.*}; rest=${1#*.}; minor=${rest%%.*}
    case "$major$minor" in *[!0-9]*) echo 0 ;; *) echo $((major * 1000 + minor)) ;; esac
}
case "$prefix" in "~") prefix=$HOME ;; "~/"*) prefix="$HOME/${prefix#??}" ;; esac

os_name=$(
    [ -r /etc/os-release ] && . /etc/os-release >/dev/null 2>&1
    printf '%s' "${PRETTY_NAME:-}"
)
kernel=$(uname -s 2>/dev/null)
emit OS_NAME "${os_name:-$kernel}"
emit KERNEL "$kernel"
emit ARCH "$(uname -m 2>/dev/null)"

py=; py_version=
if [ -n "$want_python" ]; then
    py=$(command -v "$want_python" 2>/dev/null) || py=$want_python
    py_version=$(pyver "$py")
else
    best=0
    for cand in $candidates; do
        path=$(command -v "$cand" 2>/dev/null) || continue
        [ -n "$path" ] || continue
        version=$(pyver "$path")
        s=$(score "$version")
        if [ "$s" -gt "$best" ]; then best=$s; py=$path; py_version=$version; fi
        if [ "$s" -ge "$min_score" ]; then py=$path; py_version=$version; break; fi
    done
fi
emit PYTHON "$py"
emit PYTHON_VERSION "$py_version"
if [ -n "$py_version" ] && "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    emit HAS_VENV 1
else
    emit HAS_VENV 0
fi

dir=$prefix
while [ -n "$dir" ] && [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
emit FREE_KB "$(df -Pk "${dir:-/}" 2>/dev/null | awk 'NR == 2 { print $4 }')"

driver=; gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    limit=; command -v timeout >/dev/null 2>&1 && limit="timeout 20"
    # On a broken driver nvidia-smi prints its complaint to stdout: keep version lines only.
    out=$($limit nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null \
        | tr -d ' \t\r' | grep -E '^[0-9]+(\.[0-9]+)*$')
    driver=$(printf '%s\n' "$out" | head -n 1)
    gpus=$(printf '%s\n' "$out" | grep -c .)
fi
emit DRIVER_VERSION "$driver"
emit GPU_COUNT "${gpus:-0}"

if [ -d /run/systemd/system ]; then emit SYSTEMD 1; else emit SYSTEMD 0; fi
emit UID "$(id -u)"
emit USER "$(id -un 2>/dev/null || whoami)"
emit HOME "$HOME"
if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1 </dev/null; then
    emit SUDO 1
else
    emit SUDO 0
fi
exit 0
"""


def facts_script(prefix: str, python: str | None) -> str:
    """The sh script that prints the facts as `KEY=VALUE` lines.

    PREFIX is where dctl will live (a leading `~/` means the SSH user's home); PYTHON, when
    given, is the only interpreter looked at.
    """
    min_score = MIN_PYTHON[0] * 1000 + MIN_PYTHON[1]
    header = (
        f"prefix={shlex.quote(prefix)}\n"
        f"want_python={shlex.quote(python or '')}\n"
        f"candidates={shlex.quote(' '.join(PYTHON_CANDIDATES))}\n"
        f"min_score={min_score}\n"
    )
    return header + _SCRIPT.lstrip("\n")


def parse_facts(output: str) -> HostFacts:
    """The facts in the script's OUTPUT; a missing or malformed key is a ValueError naming it.

    Lines that are not ours (a chatty login script) are ignored; the last value of a key wins.
    """
    values: dict[str, str] = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in _KEYS:
            values[key] = value.strip()
    missing = [key for key in _KEYS if key not in values]
    if missing:
        raise ValueError(f"host facts lack {', '.join(missing)}")
    version = _VERSION.match(values["PYTHON_VERSION"])
    free_kb = values["FREE_KB"]
    return HostFacts(
        os_name=values["OS_NAME"],
        kernel=values["KERNEL"],
        arch=values["ARCH"],
        python=values["PYTHON"],
        python_version=((int(version[1]), int(version[2]), int(version[3])) if version else None),
        has_venv=values["HAS_VENV"] == "1",
        free_bytes=_integer("FREE_KB", free_kb) * 1024 if free_kb else None,
        driver_version=values["DRIVER_VERSION"] or None,
        gpu_count=_integer("GPU_COUNT", values["GPU_COUNT"]),
        systemd=values["SYSTEMD"] == "1",
        uid=_integer("UID", values["UID"]),
        user=values["USER"],
        home=values["HOME"],
        sudo=values["SUDO"] == "1",
    )


def _integer(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"host fact {key} is {text!r}, not a whole number") from None


def hard_failures(facts: HostFacts, *, want_root: bool, min_free_bytes: int) -> list[str]:
    """Why the host cannot be provisioned, one sentence each with what to do; [] when it can.

    WANT_ROOT: --sudo was asked for. MIN_FREE_BYTES: what the venv and wheels need.
    """
    failures: list[str] = []
    if facts.kernel != "Linux":
        failures.append(
            f"the host runs {facts.os_name or facts.kernel or 'an unknown OS'}, not Linux: "
            "the dctl agent runs on Linux only; provision a Linux host"
        )
    wanted = ".".join(map(str, MIN_PYTHON))
    if facts.python_version is None:
        tried = facts.python or ", ".join(PYTHON_CANDIDATES)
        failures.append(
            f"no working Python found on the host (tried {tried}): install Python >= {wanted} "
            "or pass --python PATH naming one"
        )
    elif facts.python_version[:2] < MIN_PYTHON:
        found = ".".join(map(str, facts.python_version))
        failures.append(
            f"Python {found} at {facts.python} is too old: dctl needs Python >= {wanted}; "
            "install a newer one and pass --python PATH naming it"
        )
    elif not facts.has_venv:
        failures.append(
            f"{facts.python} cannot create virtual environments (no venv/ensurepip module): "
            "install it (Debian/Ubuntu: `apt-get install python3-venv`) and run again"
        )
    if facts.free_bytes is not None and facts.free_bytes < min_free_bytes:
        failures.append(
            f"only {_size(facts.free_bytes)} free under the prefix, {_size(min_free_bytes)} "
            "needed: free some space or pass --prefix DIR on a larger disk"
        )
    if want_root and facts.uid != 0 and not facts.sudo:
        failures.append(
            f"--sudo needs root or passwordless sudo, but {facts.user or 'the SSH user'} has "
            "neither (`sudo -n true` fails): connect as root, allow passwordless sudo, or drop "
            f"--sudo to install under {facts.home or 'the home directory'}"
        )
    return failures


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    return f"{value:.1f} TiB"


def run_facts(remote: Remote, prefix: str, python: str | None) -> HostFacts:
    """Run the facts script on REMOTE and parse what it printed (ProvisionError if garbled)."""
    from provision.errors import ProvisionError

    result = remote.run(facts_script(prefix, python), check=True, timeout_s=60)
    try:
        return parse_facts(result.stdout)
    except ValueError as exc:
        raise ProvisionError(
            f"the host facts script gave no usable answer ({exc}); is /bin/sh a POSIX shell? "
            f"Its output ended: {result.stdout[-300:]!r}, stderr: {result.stderr[-300:]!r}"
        ) from None
