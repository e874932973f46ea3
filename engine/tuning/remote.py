"""Measuring settings through a deployment: OpenAI chat requests to a gateway or an engine.

Only the text and the usage come back over HTTP, so agreement compares whitespace-separated
words instead of token ids, tokens per forward is not known (`None`), and held-out accuracy is
not measured. Latency is the client's: request sent to response read, network included.
Requests pin the stable pool (`x-dctl-pool: stable`) so a canary in progress is not measured;
through a gateway that takes a client token granted it (`dctl token create NAME --role client
--allow-pool-pin`), and an engine reached directly ignores the header.
The API key travels only in the Authorization header; no message here ever contains it.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import httpx

from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import Batch, RequestSample

DEFAULT_TIMEOUT_S = 300.0


class RemoteError(RuntimeError):
    """A request the deployment did not answer with a completion; the message says why."""


@dataclass
class HttpRunner:
    """Runs settings as chat completions against an OpenAI base URL (greedy, temperature 0)."""

    base_url: str
    deployment: str
    api_key: str = field(repr=False)
    messages: Sequence[str]
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: httpx.BaseTransport | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}", "x-dctl-pool": "stable"},
            timeout=self.timeout_s,
            transport=self.transport,
        )

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def describe(self) -> dict[str, Any]:
        """Where the numbers come from."""
        return {
            "base_url": self.base_url,
            "deployment": self.deployment,
            "pool": "stable",
            "client_host": platform.node(),
            "agreement_unit": "words of the response text",
        }

    def warm_up(self, setting: DecodeSetting) -> None:
        """One short request: checks the URL, the key and the deployment before the sweep."""
        self._complete(self.messages[0], setting, max_tokens=setting.block_size)

    def run(self, setting: DecodeSetting, *, max_tokens: int, concurrency: int) -> Batch:
        """Every prompt under SETTING, `concurrency` requests in flight."""
        start = perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            samples = list(
                pool.map(lambda m: self._complete(m, setting, max_tokens=max_tokens), self.messages)
            )
        return Batch(samples, perf_counter() - start)

    def heldout_accuracy(self, setting: DecodeSetting) -> float | None:
        """Not measured over HTTP: it needs the tokenizer and token-id prompts."""
        return None

    def _complete(self, message: str, setting: DecodeSetting, *, max_tokens: int) -> RequestSample:
        body = {
            "model": self.deployment,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "thinking": False,
            **setting.request_fields(),
        }
        start = perf_counter()
        try:
            response = self._client.post("/chat/completions", json=body)
        except httpx.TimeoutException:
            raise RemoteError(
                f"{self.base_url}: no answer within {self.timeout_s:g} s ({setting.label})"
            ) from None
        except httpx.TransportError as exc:
            raise RemoteError(f"cannot reach {self.base_url}: {exc}") from None
        elapsed = perf_counter() - start
        if response.status_code != 200:
            raise RemoteError(self._refusal(response, setting))
        try:
            data = response.json()
            text = data["choices"][0]["message"]["content"] or ""
            tokens = int(data["usage"]["completion_tokens"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise RemoteError(
                f"{self.base_url}: the answer is not an OpenAI chat completion"
            ) from None
        return RequestSample(e2e_s=elapsed, completion_tokens=tokens, units=text.split())

    def _refusal(self, response: httpx.Response, setting: DecodeSetting) -> str:
        try:
            error = response.json()["error"]
            detail, code = str(error["message"]), error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            detail, code = response.text[:200], None
        status = response.status_code
        if code == "pool_pin_not_allowed":
            # The detail says which token to create; say why tune pins at all.
            return (
                f"{self.base_url} refused to pin the stable pool (HTTP {status}): {detail}, as "
                "--api-key-file or DCTL_API_KEY (tune measures stable, not a canary in progress)"
            )
        if status in (401, 403):
            return (
                f"{self.base_url} refused the API key (HTTP {status}): {detail}; "
                "check --api-key-file or DCTL_API_KEY"
            )
        if status == 404:
            return f"{self.base_url}: deployment {self.deployment!r} not found (HTTP 404): {detail}"
        return f"{self.base_url} answered HTTP {status} for {setting.label}: {detail}"
