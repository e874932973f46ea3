"""`dctl up --demo`'s processes and output: children that cannot outlive it, a bounded stop, and
lines that never abort it once stdout is gone. Real processes and signals throughout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agent.engine_process import PidRecord
from cli.demo.children import Children, stop_leftover_engines
from cli.demo.run import Console

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _eventually(what: str, probe: Callable[[], object], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_line_nobody_reads_sends_the_rest_of_the_stream_to_devnull() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `tee` died
    stream = open(write_end, "w")  # noqa: SIM115
    console = Console(out=stream, err=stream)
    console.say("stopping the demo...")  # EPIPE: must not raise
    assert os.readlink(f"/proc/self/fd/{write_end}") == os.devnull
    console.error("and the next line goes nowhere")
    stream.close()
    console.say("a closed stream is no reason to stop either")


def test_the_children_get_sigterm_when_the_demo_is_sigkilled(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom pathlib import Path\nfrom cli.demo.children import Children\n"
         "children = Children(Path(sys.argv[1]))\n"
         f"children.spawn('sleeper', {SLEEP!r}, {{}})\n"
         "print(children.processes['sleeper'].pid, flush=True)\ntime.sleep(600)\n",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    sleeper = int(demo.stdout.readline())  # type: ignore[union-attr]
    try:
        assert not _gone(sleeper)
        demo.kill()
        demo.wait()
        _eventually("the sleeper to die with its parent", lambda: _gone(sleeper))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)  # only if the test failed: it is gone otherwise


def test_a_child_that_ignores_sigterm_is_killed_with_its_group_after_the_grace(
    tmp_path: Path,
) -> None:
    children = Children(tmp_path)
    children.spawn(
        "stubborn",
        [sys.executable, "-c",
         "import signal, subprocess, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         f"helper = subprocess.Popen({SLEEP!r})\n"
         "print(helper.pid, flush=True)\ntime.sleep(600)\n"],
        dict(os.environ),
    )  # fmt: skip
    log = children.log_path("stubborn")
    _eventually("the helper's pid", lambda: log.read_text().strip())
    helper = int(log.read_text())
    children.stop("stubborn", grace_s=1)
    children.close_logs()
    assert children.processes["stubborn"].returncode == -signal.SIGKILL
    _eventually("the helper in its group to die too", lambda: _gone(helper))


def test_engines_the_agent_left_running_are_stopped_and_no_other_process(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = run_dir / "instance-1.yaml"
    # The agent adopts (and the demo stops) only a process whose command line names its config.
    engine = subprocess.Popen([*SLEEP, str(config)])
    other = subprocess.Popen(SLEEP)
    try:
        for instance_id, pid in ((1, engine.pid), (2, other.pid)):
            PidRecord(instance_id, pid, 0, str(run_dir / f"instance-{instance_id}.yaml"),
                      "").save(run_dir / f"instance-{instance_id}.json")  # fmt: skip
        assert stop_leftover_engines(run_dir, grace_s=10) == [engine.pid]
        assert engine.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        engine.kill()
        other.kill()
        other.wait()
