"""Following an engine log across the supervisor's own rotations (rename at start,
copy-truncate while running), with real files and a real writing process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.engine_process import rotate_log, truncate_if_large
from agent.log_tail import Cursor, FileTail


def texts(tail: FileTail, budget: int = 1 << 20) -> list[str]:
    return [line.data.decode() for line in tail.read(budget)]


class Engine:
    """Appends to a log as an engine does (O_APPEND, the supervisor may truncate under it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("ab", buffering=0)

    def write(self, *lines: str) -> None:
        self.handle.write("".join(f"{line}\n" for line in lines).encode())

    def close(self) -> None:
        self.handle.close()


def test_whole_lines_in_order_and_a_partial_one_waits_for_its_newline(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    assert texts(tail) == []  # no file yet
    engine = Engine(log)
    engine.write("one", "two")
    engine.handle.write(b"thr")
    assert texts(tail) == ["one", "two"]
    engine.handle.write(b"ee\r\n")
    assert texts(tail) == ["three"]
    assert tail.at_end()


def test_a_restart_rotation_reads_the_old_file_to_its_end_first(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    old = Engine(log)
    old.write("a1")
    assert texts(tail) == ["a1"]
    old.write("a2", "a3")
    old.handle.write(b"a4 no newline")
    old.close()
    rotate_log(log, keep=3)  # what the supervisor does before starting the engine again
    new = Engine(log)
    new.write("b1")
    assert texts(tail) == ["a2", "a3", "a4 no newline", "b1"]
    rotate_log(log, keep=3)
    assert texts(tail) == []
    assert tail.gaps == 0


def test_a_copy_truncate_reads_the_unread_rest_from_the_copy_then_the_file_again(
    tmp_path: Path,
) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    engine = Engine(log)
    engine.write(*(f"line {i}" for i in range(10)))
    assert texts(tail, budget=30) == ["line 0", "line 1", "line 2", "line 3"]
    assert truncate_if_large(log, max_bytes=10, keep=3)
    engine.write("after 0", "after 1")
    assert texts(tail) == [f"line {i}" for i in range(4, 10)] + ["after 0", "after 1"]
    assert tail.gaps == 0


def test_a_file_truncated_and_rewritten_past_the_offset_is_noticed(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    engine = Engine(log)
    engine.write("short")
    assert texts(tail) == ["short"]
    truncate_if_large(log, max_bytes=1, keep=3)
    # Longer than what was read before the truncation: the size alone would not tell.
    engine.write("a much longer line than before")
    assert texts(tail) == ["a much longer line than before"]
    assert tail.gaps == 0


def test_a_tail_two_rotations_behind_reads_the_older_copy_then_the_newer(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    engine = Engine(log)
    engine.write("first", "second")
    assert texts(tail, budget=6) == ["first"]
    truncate_if_large(log, max_bytes=1, keep=3)
    engine.write("x", "y")
    truncate_if_large(log, max_bytes=1, keep=3)  # "second" is in `.2` now
    engine.write("z")
    assert texts(tail) == ["second", "x", "y", "z"]
    assert tail.gaps == 0


def test_lines_rotated_away_unread_count_as_a_gap(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 1024)
    engine = Engine(log)
    engine.write("first", "second")
    assert texts(tail, budget=6) == ["first"]
    truncate_if_large(log, max_bytes=1, keep=1)
    engine.write("x", "y")
    truncate_if_large(log, max_bytes=1, keep=1)  # the copy holding "second" is gone
    engine.write("z")
    assert texts(tail) == ["z"]
    assert tail.gaps == 1


def test_a_long_line_is_cut_and_the_rest_of_it_skipped(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    tail = FileTail(log, 100)
    engine = Engine(log)
    engine.handle.write(b"x" * 150)  # no newline yet: cut all the same, the rest skipped
    [cut] = tail.read(1 << 20)
    assert (cut.data, cut.cut) == (b"x" * 100, True)
    engine.handle.write(b"y" * 5000 + b"\nnext\n" + b"z" * 300 + b"\n")
    lines = tail.read(1 << 20)
    assert [(line.data[:4], line.cut) for line in lines] == [(b"next", False), (b"z" * 4, True)]


def test_each_read_is_bounded_whatever_is_waiting(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    Engine(log).write(*(f"{i:07d}" for i in range(100_000)))  # 800 kB
    tail = FileTail(log, 1024)
    seen = []
    while True:
        before = tail.bytes_read
        lines = tail.read(4096)
        assert tail.bytes_read - before <= 4096
        if not lines:
            break
        seen += lines
    assert len(seen) == 100_000 and seen[-1].data == b"0099999"


def test_a_saved_cursor_resumes_in_the_file_or_in_the_rotated_one(tmp_path: Path) -> None:
    log = tmp_path / "instance-1.log"
    engine = Engine(log)
    engine.write("shipped", "not yet")
    [first, _second] = FileTail(log, 1024).read(1 << 20)
    assert texts(FileTail(log, 1024, Cursor(first.inode, first.end))) == ["not yet"]
    engine.close()
    rotate_log(log, keep=3)  # the engine restarted while the agent was down
    Engine(log).write("new engine")
    resumed = FileTail(log, 1024, Cursor(first.inode, first.end))
    assert texts(resumed) == ["not yet", "new engine"]
    unknown = FileTail(log, 1024, Cursor(first.inode + 999_999, 3))
    assert texts(unknown) == ["new engine"]


WRITER = """
import sys
n = 0
for command in sys.stdin:
    for _ in range(int(command)):
        sys.stdout.write(f"line {n:06d} " + "x" * 40 + "\\n")
        n += 1
    sys.stdout.flush()
    sys.stderr.write("ok\\n")
    sys.stderr.flush()
"""


def test_a_real_engine_process_across_copy_truncates_and_a_restart(tmp_path: Path) -> None:
    """Every line a real process writes arrives once, in order, while the supervisor's
    rotations (copy-truncate past 4 kB, rename at a restart) go on between the reads."""
    log = tmp_path / "logs" / "instance-1.log"
    log.parent.mkdir()
    tail = FileTail(log, 1024)
    received: list[str] = []
    expected: list[str] = []
    for _restart in range(2):
        rotate_log(log, keep=3)
        with log.open("ab") as out:
            writer = subprocess.Popen(
                [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        assert writer.stdin is not None and writer.stderr is not None
        written = 0
        for burst in (3, 120, 7, 250, 1, 60):
            writer.stdin.write(f"{burst}\n")
            writer.stdin.flush()
            assert writer.stderr.readline() == "ok\n"
            expected += [f"line {n:06d} " + "x" * 40 for n in range(written, written + burst)]
            written += burst
            received += texts(tail, budget=2048)  # falls behind: the rest waits on disk
            truncate_if_large(log, max_bytes=4096, keep=3)
        writer.stdin.close()
        assert writer.wait(timeout=10) == 0
    while lines := texts(tail, budget=2048):
        received += lines
    assert received == expected
    assert tail.gaps == 0
