"""Verdicts as they happen, one summary block at the end, and the step failure that ends a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class StepFailed(Exception):
    """A step the later ones depend on failed; the message says what to do."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class Report:
    """Every check's verdict with its figures, printed as one block at the end."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, check, detail)

    def add(self, verdict: str, check: str, detail: str) -> None:
        """Record CHECK as PASS, FAIL or SKIP, and print it as it happens."""
        self.rows.append((verdict, check, detail))
        print(f"[{verdict}] {check}: {detail}", flush=True)

    def expect(self, ok: bool, check: str, detail: str) -> bool:
        """PASS or FAIL by OK; returns OK."""
        self.add("PASS" if ok else "FAIL", check, detail)
        return ok

    @property
    def failed(self) -> bool:
        """Whether any check failed."""
        return any(verdict == "FAIL" for verdict, _, _ in self.rows)

    def summary(self, title: str) -> str:
        """The block printed last."""
        counts = {v: sum(r[0] == v for r in self.rows) for v in ("PASS", "FAIL", "SKIP")}
        lines = [f"== {title} ==", *(f"{v:4}  {c:26} {d}" for v, c, d in self.rows)]
        lines.append(
            f"result: {'FAIL' if self.failed else 'PASS'} ({counts['PASS']} passed, "
            f"{counts['FAIL']} failed, {counts['SKIP']} skipped)"
        )
        return "\n".join(lines)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 1.0) -> T:
    """PROBE's first truthy answer; TimeoutError naming WHAT after TIMEOUT_S."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)
