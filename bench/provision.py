"""How long `dctl host provision` takes: one host, four in parallel, four one after another, and
the no-op second run.

Real parts on loopback: a control plane (`dctl server`, SQLite), one OpenSSH sshd per "host"
(each its own host key and port; `tests/sshd.py`), the dctl wheel of this checkout and every
dependency of `dctl[gpu]` in a local wheelhouse (hosts install with --no-index), real agents
with fake GPUs. torch is left out (`--extras gpu`): its 190 MB wheel would measure this disk,
not provisioning, and the agents then report a failing torch check, which is not a provisioning
failure. Needs root (sshd, and the `dctl` service user it creates; removed at the end if made
here).

Goals (issue 17): the second run under 2 s per host; 4 hosts in parallel faster than 0.6x of
provisioning them one after another. Medians over `--rounds`. `--smoke`: one host planned with
`--dry-run` (connect, facts, the plan), for the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.credentials import CredentialsFile  # noqa: E402
from client.http import ControlPlaneClient  # noqa: E402
from provision.wheel import running_wheel  # noqa: E402
from tests.sshd import SshServer, client_key, sshd_available, user_exists  # noqa: E402

DCTL = [sys.executable, "-m", "cli"]
SETTINGS = ["--set", "gpu_backend=fake", "--set", "metrics_port=0", "--extras", "gpu",
            "--python", "/usr/bin/python3.11"]  # fmt: skip


class Bench:
    """A control plane, some sshd hosts and the CLI's environment, in one temporary folder."""

    def __init__(self, work: Path, hosts: int) -> None:
        self.work = work
        self.base = Path(tempfile.mkdtemp(prefix="dctl-bench-provision-"))
        self.base.chmod(0o755)  # the service user must reach the prefixes
        (work / "client").mkdir()
        self.key = client_key(work / "client")
        self.servers = [SshServer(work / f"sshd-{n}", [self.key.with_suffix(".pub")])
                        for n in range(hosts)]  # fmt: skip
        self.known = work / "known_hosts"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
        self.env.update(HOME=str(work / "home"), XDG_CONFIG_HOME=str(work / "home/config"),
                        XDG_DATA_HOME=str(work / "home/data"), DCTL_DATA_DIR=str(work / "cp"),
                        DCTL_HEARTBEAT_INTERVAL_S="1")  # fmt: skip
        self.server: subprocess.Popen[bytes] | None = None
        self.round = 0

    def start(self) -> None:
        for server in self.servers:
            server.start()
        self.known.write_text("".join(s.known_hosts_line() for s in self.servers))
        with socket_port() as port:
            self.url = f"http://127.0.0.1:{port}"
        log = (self.work / "server.log").open("ab")
        self.server = subprocess.Popen(
            [*DCTL, "server", "--migrate", "--port", self.url.rsplit(":", 1)[1]],
            stdout=log, stderr=subprocess.STDOUT, env=self.env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(Exception):
                ControlPlaneClient(self.url).request("GET", "/readyz")
                break
            if time.monotonic() > deadline:
                raise SystemExit("the control plane did not start: see server.log")
            time.sleep(0.2)
        _, contexts = CredentialsFile(self.work / "home/config/dctl/credentials").load()
        self.env.update(DCTL_URL=self.url, DCTL_TOKEN=contexts["default"].token or "")
        wheel = running_wheel(cache_dir=self.work / "wheel-cache")
        self.wheelhouse = self.work / "wheelhouse"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--only-binary=:all:", "--dest", str(self.wheelhouse), f"{wheel.path}[gpu]"],
            check=True, capture_output=True,
        )  # fmt: skip
        # The CLI's own wheel build is cached from here on: no run below pays for it.
        self.provision(self.hosts_file([]), check=False)

    def hosts_file(self, hosts: list[tuple[int, str]]) -> Path:
        lines = ["hosts:"] if hosts else ["hosts: [{host: root@127.0.0.1:1}]"]
        for n, name in hosts:
            lines += [f"  - host: root@127.0.0.1:{self.servers[n].port}",
                      f"    name: {name}", f"    prefix: {self.base / name}"]  # fmt: skip
        path = self.work / "hosts.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def provision(
        self, hosts_file: Path, *extra: str, check: bool = True, parallel: int = 8
    ) -> float:
        started = time.perf_counter()
        done = subprocess.run(
            [*DCTL, "host", "provision", "-f", str(hosts_file), "--key", str(self.key),
             "--known-hosts", str(self.known), "--wheelhouse", str(self.wheelhouse),
             "--parallel", str(parallel), *SETTINGS, *extra],
            capture_output=True, text=True, env=self.env,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        if check and done.returncode != 0:
            raise SystemExit(f"provisioning failed:\n{done.stdout}\n{done.stderr}")
        return seconds

    def fresh(self, count: int) -> list[tuple[int, str]]:
        """COUNT hosts under names never used, so each is provisioned from nothing."""
        self.round += 1
        return [(n, f"r{self.round}-h{n}") for n in range(count)]

    def stop(self) -> None:
        for prefix in self.base.iterdir():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((prefix / "agent.pid").read_text()), signal.SIGKILL)
        if self.server is not None:
            self.server.terminate()
            self.server.wait(30)
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    """A free port on 127.0.0.1 (released when the block ends, for a server to bind)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield int(probe.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="plan one host (--dry-run)")
    args = parser.parse_args()
    reason = sshd_available()
    if reason or os.geteuid() != 0:
        print(f"provision bench not run: {reason or 'needs root (sshd, a service user)'}")
        return 0
    hosts = 1 if args.smoke else 4
    rounds = 1 if args.smoke else args.rounds
    had_user = user_exists("dctl")
    with tempfile.TemporaryDirectory(prefix="bench-provision-") as tmp:
        bench = Bench(Path(tmp), hosts)
        try:
            bench.start()
            figures: dict[str, list[float]] = {"one": [], "noop": []}
            if args.smoke:
                # The test suite's run: connect, facts and the plan, with no 20 s install.
                figures = {"plan": [bench.provision(bench.hosts_file(bench.fresh(1)), "--dry-run")]}
            else:
                figures.update(parallel=[], serial=[], noop4=[])
            for _ in range(0 if args.smoke else rounds):
                single = bench.fresh(1)
                figures["one"].append(bench.provision(bench.hosts_file(single)))
                figures["noop"].append(bench.provision(bench.hosts_file(single)))
                together = bench.fresh(hosts)
                figures["parallel"].append(bench.provision(bench.hosts_file(together)))
                figures["noop4"].append(bench.provision(bench.hosts_file(together)))
                apart = bench.fresh(hosts)
                figures["serial"].append(sum(bench.provision(bench.hosts_file([h])) for h in apart))
        finally:
            bench.stop()
            if not had_user and user_exists("dctl"):
                subprocess.run(["userdel", "dctl"], check=False, capture_output=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    if args.smoke:
        print(f"provision --smoke: planning one host (--dry-run) {med['plan']:.1f} s")
        return 0
    print(f"provision, medians of {rounds} round(s), loopback sshd, wheelhouse without torch")
    print(f"  1 host from nothing:            {med['one']:6.1f} s")
    print(f"  1 host, no-op second run:       {med['noop']:6.1f} s  (goal < 2 s per host)")
    ratio = med["parallel"] / med["serial"]
    print(f"  {hosts} hosts in parallel:          {med['parallel']:6.1f} s")
    print(f"  {hosts} hosts one after another:    {med['serial']:6.1f} s")
    print(f"  parallel / one after another:   {ratio:6.2f}x  (goal < 0.6x)")
    print(f"  {hosts} hosts, no-op second run:     {med['noop4']:6.1f} s "
          f"({med['noop4'] / hosts:.2f} s per host)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
