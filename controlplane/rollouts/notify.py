"""Rollout notifications: a JSON POST to the rollout's `notify` URL on every state change and
every failed analysis, sent from a thread of their own with retries and backoff, so a slow or
dead receiver never holds the controller up. A delivery that fails for good is recorded in the
event log (`rollout.notify_failed`), without the URL's query string (it may carry a secret)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger("controlplane.rollouts.notify")

DEFAULT_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between attempts: 6 attempts in ~15 s
TIMEOUT_S = 5.0
MAX_PENDING = 1000


@dataclass(frozen=True)
class Notice:
    """One notification: where it goes and the JSON body."""

    url: str
    body: dict[str, Any]
    attempts: list[str] = field(default_factory=list, compare=False)


def redacted(url: str) -> str:
    """The URL without credentials, query or fragment: what logs and events may show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class Notifier:
    """Delivers notices in order on a daemon thread; `send` never blocks."""

    def __init__(
        self,
        on_failure: Callable[[Notice, str], None],
        backoff_s: Sequence[float] = DEFAULT_BACKOFF_S,
        post: Callable[[str, dict[str, Any]], int] | None = None,
    ) -> None:
        self._on_failure = on_failure
        self._backoff = tuple(backoff_s)
        self._post = post or _post
        self._queue: queue.Queue[Notice | None] = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def send(self, url: str, body: dict[str, Any]) -> None:
        """Queue a notice (dropped with a log line when a thousand are already waiting)."""
        self._start()
        try:
            self._queue.put_nowait(Notice(url, body))
        except queue.Full:
            log.warning("rollout notification to %s dropped: queue full", redacted(url))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the notices queued so far (waiting at most `timeout_s`)."""
        thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout_s)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="rollout-notify", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while (notice := self._queue.get()) is not None:
            self._deliver(notice)

    def _deliver(self, notice: Notice) -> None:
        error = ""
        for attempt, wait in enumerate((*self._backoff, None)):
            try:
                status = self._post(notice.url, notice.body)
                if 200 <= status < 300:
                    return
                error = f"HTTP {status}"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            notice.attempts.append(error)
            log.info("rollout notification attempt %d failed: %s", attempt + 1, error)
            if wait is not None:
                time.sleep(wait)
        try:
            self._on_failure(notice, error)
        except Exception:  # the event log is down too: the log line is all there is
            log.exception("could not record a failed rollout notification")


def _post(url: str, body: dict[str, Any]) -> int:
    response = httpx.post(url, json=body, timeout=TIMEOUT_S, follow_redirects=False)
    return response.status_code
