"""Demo traffic: a steady trickle of chat completions through the demo's gateway.

A rollout analyses canary against stable on the requests each pool served in an interval and
never promotes on no data, so an idle demo would extend its first step forever. This keeps
both pools busy enough for `dctl rollout demo --to demo:v2` to be analysed and promoted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx  # imported where used: `dctl --help` need not load it

# General questions in the register of the trained demo model (King James Bible), taken in turn.
PROMPTS = (
    "Tell me about the sea.",
    "What is wisdom?",
    "Describe a city at night.",
    "How should I treat my neighbour?",
    "Speak of the morning and the evening.",
    "What does a good ruler do?",
)
MAX_TOKENS = 8
DEFAULT_RPS = 4.0
FAILURES_PER_LOG_LINE = 100


class DemoTraffic:
    """Sends one chat completion every 1/RPS seconds from a daemon thread until `stop()`.

    Requests go one at a time: on a CPU the engines share a few cores, and a request that takes
    longer than its slot delays the next instead of piling more on. Failures (a canary
    instance restarting, the gateway going away) are counted, never raised: the demo goes on.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        rps: float,
        say: Callable[[str], None] = print,
        model: str = "demo",
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not rps > 0:
            raise ValueError(f"rps must be positive, not {rps:g}")
        self.url = f"{base_url.rstrip('/')}/chat/completions"
        self.api_key = api_key
        self.period_s = 1.0 / rps
        self.say = say
        self.model = model
        self.timeout_s = timeout_s
        self.transport = transport
        self.sent = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)

    def start(self) -> None:
        """Start sending."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop sending; waits up to TIMEOUT_S for a request in flight (the thread is a daemon,
        so one still hanging then cannot keep the process alive)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import httpx

        client = httpx.Client(
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=self.timeout_s,
            transport=self.transport,
        )
        with client:
            due = time.monotonic()
            while not self._stop.wait(max(0.0, due - time.monotonic())):
                prompt = PROMPTS[self.sent % len(PROMPTS)]
                failure = self._send(client, prompt)
                self.sent += 1
                if failure is not None and not self._stop.is_set():
                    self._count_failure(failure)
                # A slow request moves the schedule on rather than causing a burst to catch up.
                due = max(due + self.period_s, time.monotonic())

    def _send(self, client: httpx.Client, prompt: str) -> str | None:
        """One request; None when it succeeded, else why it failed."""
        import httpx

        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
        }
        try:
            reply = client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None if reply.status_code == 200 else f"HTTP {reply.status_code}"

    def _count_failure(self, reason: str) -> None:
        self.failed += 1
        # The first failure, then one line per hundred: visible, but never a flood.
        if self.failed % FAILURES_PER_LOG_LINE == 1:
            self.say(
                f"demo traffic: {self.failed} of {self.sent} requests failed so far "
                f"(last: {reason})"
            )
