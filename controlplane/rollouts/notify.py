"""Rollout notifications: a JSON POST to the rollout's `notify` URL on every state change and
every failed analysis, retried with backoff.

They are sent from an event loop of their own (one daemon thread), one sender per rollout: a
rollout's notices go out in order, and a receiver that is slow or dead holds up only its own
rollout's, never the controller or another rollout. Each attempt is `webhook.post_json`: checked
addresses, no redirects, nothing of the body read, one deadline. A delivery that fails for good
is recorded in the event log (`rollout.notify_failed`) with the URL's scheme and host only (its
user, password, path and query may each be the secret) and the failure's class only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from controlplane.rollouts.webhook import DEADLINE_S, Attempt, Resolver, post_json, system_resolver
from protocol.rollout_policy import notify_origin

log = logging.getLogger("controlplane.rollouts.notify")

DEFAULT_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between attempts: 6 attempts
MAX_PENDING = 1000  # notices waiting, over every rollout


@dataclass(frozen=True)
class Notice:
    """One notification: where it goes, the JSON body, and how each failed attempt went."""

    url: str
    body: dict[str, Any]
    attempts: list[str] = field(default_factory=list, compare=False)

    @property
    def rollout(self) -> object:
        """The rollout it is about: notices of one rollout share a sender."""
        return self.body.get("rollout")


class Notifier:
    """Delivers notices, one sender per rollout, on a loop of its own; `send` never blocks.

    `allow_private` is `[controlplane] notify_allow_private`; `resolve`, `verify` (the CAs to
    trust; default the system's) and the timings are there for tests.
    """

    def __init__(
        self,
        on_failure: Callable[[Notice, str], None],
        *,
        allow_private: bool = False,
        backoff_s: Sequence[float] = DEFAULT_BACKOFF_S,
        deadline_s: float = DEADLINE_S,
        resolve: Resolver = system_resolver,
        verify: ssl.SSLContext | None = None,
    ) -> None:
        self._on_failure = on_failure
        self._allow_private = allow_private
        self._backoff = tuple(backoff_s)
        self._deadline_s = deadline_s
        self._resolve = resolve
        self._verify = verify
        self._lock = threading.Lock()  # guards _loop and _thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Used on the loop only, so without locks.
        self._queues: dict[object, deque[Notice]] = {}
        self._senders: dict[object, asyncio.Task[None]] = {}
        self._pending = 0

    def send(self, url: str, body: dict[str, Any]) -> None:
        """Queue a notice (dropped with a log line when a thousand are already waiting)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_serve, args=(self._loop,), name="rollout-notify", daemon=True
                )
                self._thread.start()
            self._loop.call_soon_threadsafe(self._enqueue, Notice(url, body))

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver the notices queued so far, waiting at most `timeout_s`, then stop (a later
        `send` starts again)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        finished = asyncio.run_coroutine_threadsafe(self._finish(timeout_s), loop)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            finished.result(timeout_s + 1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)

    # --- on the loop -------------------------------------------------------------------------

    def _enqueue(self, notice: Notice) -> None:
        if self._pending >= MAX_PENDING:
            log.warning(
                "rollout notification to %s dropped: %d already waiting",
                notify_origin(notice.url),
                self._pending,
            )
            return
        self._pending += 1
        self._queues.setdefault(notice.rollout, deque()).append(notice)
        if notice.rollout not in self._senders:
            sender = asyncio.get_running_loop().create_task(self._sender(notice.rollout))
            self._senders[notice.rollout] = sender

    async def _sender(self, rollout: object) -> None:
        # Nothing awaits between the last `while` check and the `finally`, so a notice queued
        # for this rollout either is taken here or finds no sender and starts one.
        queue = self._queues[rollout]
        try:
            while queue:
                notice = queue.popleft()
                try:
                    await self._deliver(notice)
                except Exception:
                    log.exception("rollout notification to %s lost", notify_origin(notice.url))
                finally:
                    self._pending -= 1
        finally:  # cancelled by `close`: what is left is dropped
            self._pending -= len(queue)
            del self._queues[rollout]
            del self._senders[rollout]

    async def _deliver(self, notice: Notice) -> None:
        attempt = Attempt(False)
        for number, wait in enumerate((*self._backoff, None), start=1):
            if self._verify is None:  # once: loading the CA bundle takes a good part of a second
                self._verify = await asyncio.to_thread(httpx.create_ssl_context)
            attempt = await post_json(
                notice.url,
                notice.body,
                allow_private=self._allow_private,
                resolve=self._resolve,
                verify=self._verify,
                deadline_s=self._deadline_s,
            )
            if attempt.ok:
                return
            notice.attempts.append(attempt.shown)
            log.info(
                "rollout notification to %s, attempt %d, failed: %s",
                notify_origin(notice.url),
                number,
                attempt.detail,
            )
            if attempt.final or wait is None:
                break
            await asyncio.sleep(wait)
        try:  # the event log's write blocks: not on the loop, which other senders share
            await asyncio.to_thread(self._on_failure, notice, attempt.shown)
        except Exception:  # the event log is down too: the log line is all there is
            log.exception("could not record a failed rollout notification")

    async def _finish(self, timeout_s: float) -> None:
        senders = list(self._senders.values())
        if not senders:
            return
        _done, late = await asyncio.wait(senders, timeout=timeout_s)
        for sender in late:
            sender.cancel()
        await asyncio.gather(*late, return_exceptions=True)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()
