"""Snapshot downloads off the agent's main loop: one worker thread, progress and failures kept
for the heartbeat, a retry delay after a failure, cancellation when the agent stops."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.errors import SnapshotError, SnapshotMismatch
from agent.snapshots import SnapshotStore
from protocol.wire import ModelVersionRef, SnapshotProgress

log = logging.getLogger("dctl.agent.snapshots")
# A rejected snapshot will not fix itself; an interrupted one might soon.
RETRY_MISMATCH_S = 300.0
RETRY_ERROR_S = 15.0
FetchResult = Literal["ok", "mismatch", "error"]


@dataclass(frozen=True)
class FetchOutcome:
    """How one fetch ended."""

    digest: str
    result: FetchResult
    bytes: int = 0
    message: str = ""


@dataclass
class _Failure:
    message: str
    retry_at: float


class SnapshotFetcher:
    """Runs `SnapshotStore.fetch` in the background, one snapshot at a time."""

    def __init__(self, store: SnapshotStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-fetch")
        self._running: dict[str, Future[Path]] = {}
        self._failures: dict[str, _Failure] = {}
        self._progress: dict[str, SnapshotProgress] = {}
        self._lock = threading.Lock()
        self._cancel = threading.Event()

    def busy(self) -> bool:
        """True while a fetch is queued or running."""
        return bool(self._running)

    def refusal(self, digest: str) -> str | None:
        """Why this snapshot was refused, while its retry is not yet due."""
        failure = self._failures.get(digest)
        if failure is None or self.clock() >= failure.retry_at:
            return None
        return failure.message

    def start(self, model: ModelVersionRef, files_url: str | None, headers: dict[str, str]) -> None:
        """Queue a fetch of MODEL's snapshot unless one is already under way."""
        digest = model.digest
        if digest in self._running:
            return
        self._failures.pop(digest, None)
        log.info("fetching snapshot %s:%s (%s)", model.name, model.version, digest[:12])
        self._running[digest] = self._pool.submit(
            self.store.fetch,
            model.manifest,
            model.source_uri,
            files_url,
            headers,
            self._on_progress,
            self._cancel,
        )

    def _on_progress(self, progress: SnapshotProgress) -> None:
        with self._lock:
            self._progress[progress.digest] = progress

    def collect(self) -> list[FetchOutcome]:
        """Fetches that ended since the last call; failures are remembered for `refusal`."""
        outcomes = []
        for digest in [d for d, f in self._running.items() if f.done()]:
            exc = self._running.pop(digest).exception()
            if exc is None:
                size = sum(
                    p.stat().st_size for p in self.store.path_for(digest).rglob("*") if p.is_file()
                )
                log.info("snapshot %s verified and stored", digest[:12])
                outcomes.append(FetchOutcome(digest, "ok", bytes=size))
                continue
            mismatch = isinstance(exc, SnapshotMismatch)
            message = str(exc) if isinstance(exc, SnapshotError) else f"snapshot fetch: {exc}"
            delay = RETRY_MISMATCH_S if mismatch else RETRY_ERROR_S
            self._failures[digest] = _Failure(f"refused: {message}", self.clock() + delay)
            log.error("snapshot %s refused: %s", digest[:12], message)
            outcomes.append(FetchOutcome(digest, "mismatch" if mismatch else "error", 0, message))
        return outcomes

    def progress(self) -> list[SnapshotProgress]:
        """Latest progress of every snapshot still worth reporting."""
        with self._lock:
            return list(self._progress.values())

    def reported(self, ready: set[str], wanted: set[str]) -> None:
        """Drop progress the control plane has seen finish, or of versions no longer wanted."""
        with self._lock:
            for digest in [d for d in self._progress if d in ready or d not in wanted]:
                del self._progress[digest]

    def shutdown(self) -> None:
        """Stop a download at its next chunk (its partial data is kept) and wait for it."""
        self._cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
