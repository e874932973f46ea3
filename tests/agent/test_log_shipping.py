"""Engine and agent log lines into heartbeats: made safe before they are buffered, bounded under a
flood, kept across a failed heartbeat, and resumed across an agent restart."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from agent.errors import ControlPlaneRejected
from agent.log_buffer import CUT_MARK, LogBuffer, request_id_in, shipped_text
from agent.log_shipping import GAP_LINE, SKIM_FACTOR, LogShipper
from agent.main import log_shipper
from agent.settings import SettingsError, load_agent_settings
from agent.supervisor import Supervisor
from protocol.logs import MAX_BATCH_LINES, MAX_LINE_CHARS, LogBatch
from protocol.wire import Heartbeat
from runtime.logs import formatter
from tests.agent.fakes import FakeLauncher, Health
from tests.agent.rig import Rig, checkpoint, desired

SECRETS = ("abc.def-ghi", "dctl_k1_s3cretS3cret", "sk-live-123", "hunter2")


def engine_log(tmp_path: Path, instance_id: int = 1) -> Path:
    return tmp_path / "logs" / f"instance-{instance_id}.log"


def write(path: Path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.writelines(f"{line}\n" for line in lines)


def shipper_for(tmp_path: Path, buffer: LogBuffer | None = None, **kwargs: object) -> LogShipper:
    return LogShipper(lambda i: engine_log(tmp_path, i), buffer, clock=lambda: 1.0e9, **kwargs)  # type: ignore[arg-type]


def ship_all(shipper: LogShipper) -> list[LogBatch]:
    """Every batch the buffer holds, each acknowledged, as heartbeats would take them."""
    batches = []
    while (batch := shipper.next_batch()) is not None:
        batches.append(batch)
        shipper.acknowledge()
    return batches


def lines_of(batches: list[LogBatch]) -> list[str]:
    return [line.line for batch in batches for line in batch.lines]


# --- what a line becomes -------------------------------------------------------------------------


def test_secrets_are_redacted_before_the_line_is_buffered(tmp_path: Path) -> None:
    log = engine_log(tmp_path)
    write(
        log,
        "GET /v1/models Authorization: Bearer abc.def-ghi",
        "using key dctl_k1_s3cretS3cret for the control plane",
        "openai client api_key=sk-live-123 retries=3",
        '{"level": "info", "msg": "db", "password": "hunter2", "max_tokens": 512}',
    )
    shipper = shipper_for(tmp_path)
    shipper.collect([1])
    batch = shipper.next_batch()
    assert batch is not None and len(batch.lines) == 4
    wire = batch.model_dump_json()
    assert not [secret for secret in SECRETS if secret in wire]
    assert batch.lines[0].line == "GET /v1/models Authorization: ***"
    assert "retries=3" in batch.lines[2].line
    assert '"max_tokens": 512' in batch.lines[3].line


def test_escape_sequences_go_and_an_overlong_line_is_cut_and_says_so() -> None:
    assert shipped_text("\x1b[31mred\x1b[0m\tdone") == "red\tdone"
    long = shipped_text("x" * (MAX_LINE_CHARS + 10))
    assert long == "x" * MAX_LINE_CHARS + CUT_MARK
    assert shipped_text("short but cut upstream", cut=True).endswith(CUT_MARK)


def test_request_ids_are_read_off_json_and_key_value_lines() -> None:
    assert request_id_in('{"ts": "t", "msg": "request", "request_id": "req-1.a:b"}') == "req-1.a:b"
    assert request_id_in("ts=t msg=request request_id=abc123 status=200") == "abc123"
    assert request_id_in('msg=request request_id="abc123"') == "abc123"
    assert request_id_in('{"request_id": "has space"}') is None
    assert request_id_in('{"request_id": 7}') is None
    assert request_id_in("request_id=" + "a" * 129) is None
    assert request_id_in("x_request_id=abc") is None
    assert request_id_in('{"msg": "no id"}') is None


def test_a_shipped_engine_line_carries_its_request_id_and_instance(tmp_path: Path) -> None:
    write(engine_log(tmp_path, 7), '{"msg": "request", "request_id": "r-42", "status": 200}', "x")
    shipper = shipper_for(tmp_path)
    shipper.collect([7])
    batch = shipper.next_batch()
    assert batch is not None
    assert [(ln.source, ln.instance_id, ln.seq, ln.request_id) for ln in batch.lines] == [
        ("engine", 7, 0, "r-42"),
        ("engine", 7, 1, None),
    ]


# --- bounds ---------------------------------------------------------------------------------------

FLOOD = """
import sys
line = "flood {:06d} " + "y" * 50 + "\\n"
sys.stdout.writelines(line.format(i) for i in range(200_000))
"""


def test_a_flood_is_read_a_bounded_round_at_a_time_into_a_bounded_buffer(tmp_path: Path) -> None:
    log = engine_log(tmp_path)
    log.parent.mkdir(parents=True)
    with log.open("ab") as out:
        subprocess.run([sys.executable, "-c", FLOOD], stdout=out, check=True)  # 13 MB at once
    buffer = LogBuffer(max_lines=5000, max_bytes=256 * 1024)
    shipper = shipper_for(tmp_path, buffer, read_bytes_per_round=512 * 1024)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        rounds = 0
        while True:
            shipper.collect([1])
            rounds += 1
            # A round's read is bounded (larger once the buffer is full: only counted then).
            assert shipper.round_bytes <= 512 * 1024 * (SKIM_FACTOR if buffer.full else 1)
            assert len(buffer) <= 5000 and buffer.bytes <= 256 * 1024
            if shipper.round_bytes == 0:
                break
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert rounds >= 13_000_000 // (512 * 1024 * SKIM_FACTOR)
    assert held < 4 << 20  # the buffer's bytes and lines, not the 13 MB read
    kept = len(buffer)
    assert kept + buffer.dropped_total == 200_000
    # The newest were dropped: what is kept is the start, whole and in order.
    batches = ship_all(shipper)
    assert lines_of(batches) == [f"flood {i:06d} " + "y" * 50 for i in range(kept)]
    assert batches[0].dropped == 200_000 - kept
    assert all(batch.dropped == 0 for batch in batches[1:])
    assert all(len(batch.lines) <= MAX_BATCH_LINES for batch in batches)


def test_a_batch_fits_the_heartbeat_bounds_and_the_rest_follows(tmp_path: Path) -> None:
    write(engine_log(tmp_path), *(f'{i} "quoted" ' + "z" * 500 for i in range(3000)))
    shipper = shipper_for(tmp_path)
    for _ in range(4):  # 1.5 MB, half a MiB a round
        shipper.collect([1])
    batches = ship_all(shipper)
    assert len(batches[0].lines) < MAX_BATCH_LINES  # the bytes bound came first
    for batch in batches:
        assert len(batch.model_dump_json()) < 400 * 1024
    assert [line.split(" ")[0] for line in lines_of(batches)] == [str(i) for i in range(3000)]


# --- heartbeats ---------------------------------------------------------------------------------


class LogRig(Rig):
    """The main loop's rig with log shipping wired in, an engine log per instance."""

    def make_agent(self):  # type: ignore[no-untyped-def]
        agent = super().make_agent()
        agent.logs = LogShipper(
            agent.supervisor.log_path, cursor_file=self.tmp / "data" / "agent" / "log-cursors.json"
        )
        return agent

    def engine_writes(self, *lines: str, instance_id: int = 5) -> None:
        write(self.agent.supervisor.log_path(instance_id), *lines)

    def shipped(self) -> list[str]:
        return [ln.line for beat in self.cp.beats if beat.logs for ln in beat.logs.lines]


def test_a_failed_heartbeat_keeps_its_batch_and_the_next_ones_send_it_in_order(
    tmp_path: Path,
) -> None:
    rig = LogRig(tmp_path)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    rig.engine_writes(*(f"line {i}" for i in range(10)))
    rig.agent.step()
    rig.agent.heartbeat_once()
    assert rig.shipped() == [f"line {i}" for i in range(10)]
    rig.cp.down = True
    rig.engine_writes(*(f"line {i}" for i in range(10, 2510)))
    for _ in range(3):
        rig.agent.step()
        assert rig.agent.heartbeat_once() is None
    rig.cp.down = False
    rig.agent.heartbeat_once()
    assert rig.cp.beats[-1].logs is not None and len(rig.cp.beats[-1].logs.lines) == 2000
    rig.agent.heartbeat_once()
    assert rig.shipped() == [f"line {i}" for i in range(2510)]  # nothing twice, nothing lost
    seqs = [ln.seq for beat in rig.cp.beats if beat.logs for ln in beat.logs.lines]
    assert seqs == list(range(2510))
    rig.agent.heartbeat_once()
    assert rig.cp.beats[-1].logs is None
    registry = rig.agent.metrics.registry
    value = registry.get_sample_value
    assert value("dctl_agent_log_lines_shipped_total", {"source": "engine"}) == 2510
    assert value("dctl_agent_log_lines_dropped_total") == 0
    rig.agent.step()
    assert value("dctl_agent_log_lines_buffered") == 0


def test_lines_of_a_removed_instance_are_still_shipped(tmp_path: Path) -> None:
    rig = LogRig(tmp_path)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    rig.engine_writes("serving")
    rig.agent.step()
    rig.cp.instances = []
    rig.agent.heartbeat_once()  # stops it
    rig.engine_writes("draining", "bye")  # its last words, before it exits
    rig.agent.step()
    assert rig.agent.supervisor.instance_ids() == []
    rig.agent.heartbeat_once()
    rig.agent.heartbeat_once()
    assert rig.shipped() == ["serving", "draining", "bye"]


class RefusingControlPlane:
    url = "http://control-plane.test"

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def register(self, *args: object) -> object:
        return self.rig.cp.register(*args)  # type: ignore[arg-type]

    def heartbeat(self, beat: Heartbeat, token: str) -> object:
        if beat.logs and beat.logs.lines:
            raise ControlPlaneRejected(422, "logs.lines.0.line: too long")
        return self.rig.cp.heartbeat(beat, token)


def test_a_batch_the_control_plane_refuses_is_dropped_and_counted_not_retried_forever(
    tmp_path: Path,
) -> None:
    rig = LogRig(tmp_path)
    rig.agent.link = RefusingControlPlane(rig)  # type: ignore[assignment]
    rig.agent.heartbeat_once()
    rig.engine_writes("refused", instance_id=3)
    rig.agent.logs.collect([3])  # type: ignore[union-attr]
    assert rig.agent.heartbeat_once() is None
    assert rig.agent.heartbeat_once() is not None  # the next one goes through
    assert rig.cp.beats[-1].logs is not None and rig.cp.beats[-1].logs.dropped == 1


def test_an_agent_restart_resumes_after_what_was_acknowledged(tmp_path: Path) -> None:
    cursors = tmp_path / "cursors.json"
    write(engine_log(tmp_path), "one", "two")
    first = shipper_for(tmp_path, cursor_file=cursors)
    first.collect([1])
    assert lines_of(ship_all(first)) == ["one", "two"]
    write(engine_log(tmp_path), "three")
    first.collect([1])
    assert first.next_batch() is not None  # sent, never answered: the agent stops here
    write(engine_log(tmp_path), "four")
    again = shipper_for(tmp_path, cursor_file=cursors)
    again.collect([1])
    assert lines_of(ship_all(again)) == ["three", "four"]
    assert json.loads(cursors.read_text())["1"][1] == len("one\ntwo\nthree\nfour\n")


def test_a_log_rotated_away_before_it_was_read_says_so(tmp_path: Path) -> None:
    from agent.engine_process import truncate_if_large

    log = engine_log(tmp_path)
    write(log, "read")
    shipper = shipper_for(tmp_path, read_bytes_per_round=1)
    shipper.collect([1])  # one 64 KiB share: all of it
    write(log, "unread " * 20)
    truncate_if_large(log, 1, 1)
    write(log, "x")
    truncate_if_large(log, 1, 1)  # keeping one copy: the one with "unread" is gone
    write(log, "after")
    shipper.collect([1])
    assert lines_of(ship_all(shipper)) == ["read", GAP_LINE, "after"]


# --- the agent's own records ---------------------------------------------------------------------


@pytest.fixture
def agent_logger() -> logging.Logger:
    logger = logging.getLogger("dctl.agent.test-shipping")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def test_agent_records_ship_as_the_agents_own_redacted_with_their_request_id(
    tmp_path: Path, agent_logger: logging.Logger
) -> None:
    shipper = shipper_for(tmp_path)
    shipper.handler.setFormatter(formatter("kv"))
    agent_logger.addHandler(shipper.handler)
    try:
        agent_logger.info("calling with Bearer abc.def-ghi", extra={"request_id": "r-9"})
        agent_logger.warning("token %s", "dctl_k1_s3cretS3cret")
    finally:
        agent_logger.removeHandler(shipper.handler)
    shipper.collect([])
    batch = shipper.next_batch()
    assert batch is not None
    assert [(ln.source, ln.instance_id, ln.seq, ln.request_id) for ln in batch.lines] == [
        ("agent", None, 0, "r-9"),
        ("agent", None, 1, None),
    ]
    assert "level=warning" in batch.lines[1].line
    assert not [secret for secret in SECRETS if secret in batch.model_dump_json()]


def test_a_record_that_logs_while_it_is_formatted_does_not_recurse(
    tmp_path: Path, agent_logger: logging.Logger
) -> None:
    shipper = shipper_for(tmp_path)
    agent_logger.addHandler(shipper.handler)

    class Loud:
        def __str__(self) -> str:
            agent_logger.info("logged from inside a format")
            return "loud"

    try:
        agent_logger.info("value %s", Loud())
    finally:
        agent_logger.removeHandler(shipper.handler)
    shipper.collect([])
    batch = shipper.next_batch()
    assert batch is not None and [ln.line for ln in batch.lines] == ["value loud"]


def test_records_from_other_threads_are_kept_or_counted_never_waited_for(
    tmp_path: Path, agent_logger: logging.Logger
) -> None:
    shipper = shipper_for(tmp_path, LogBuffer(max_lines=500))
    shipper.handler.capacity = 100
    agent_logger.addHandler(shipper.handler)
    stop = threading.Event()

    def chatter() -> None:
        for i in range(5000):
            agent_logger.info("chatter %d", i)
        stop.set()

    thread = threading.Thread(target=chatter)
    try:
        thread.start()
        while not stop.is_set():
            shipper.collect([])
        thread.join()
    finally:
        agent_logger.removeHandler(shipper.handler)
    shipper.collect([])
    assert len(shipper.buffer) + shipper.buffer.dropped_total == 5000
    kept = [int(line.split()[-1]) for line in lines_of(ship_all(shipper))]
    assert kept == sorted(kept) and len(kept) <= 500


def test_the_running_agent_ships_its_own_records_and_lets_go_of_the_root_logger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dctl.agent")
    rig = LogRig(tmp_path)
    stop = threading.Event()
    stop.set()
    rig.agent.run(stop)
    assert rig.agent.logs is not None
    assert rig.agent.logs.handler not in logging.getLogger().handlers
    rig.agent.logs.collect([])
    batch = rig.agent.logs.next_batch()
    assert batch is not None and "engines keep running" in batch.lines[-1].line


# --- settings -----------------------------------------------------------------------------------


def test_log_settings_come_from_env_and_reach_the_shipper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in list(os.environ):
        if var.startswith(("DCTL_", "XDG_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("DCTL_AGENT_ENGINE_LOG_MAX_BYTES", str(20 << 20))
    monkeypatch.setenv("DCTL_AGENT_LOG_BUFFER_LINES", "5000")
    settings = load_agent_settings(data_dir=tmp_path, engine_log_keep=5)
    assert (settings.engine_log_max_bytes, settings.engine_log_keep) == (20 << 20, 5)
    assert (settings.log_buffer_lines, settings.log_buffer_bytes, settings.ship_logs) == (
        5000,
        8 << 20,
        True,
    )
    supervisor = Supervisor(tmp_path / "run", FakeLauncher(), Health())
    shipper = log_shipper(settings, supervisor)
    assert shipper is not None and shipper.buffer.max_lines == 5000
    assert log_shipper(load_agent_settings(ship_logs=False), supervisor) is None
    with pytest.raises(SettingsError, match="log_buffer_lines"):
        load_agent_settings(log_buffer_lines=10)
