"""Fault injection from the engine config's `chaos` section: failures and added latency.

A game day or a rollout test needs a canary that is really worse than stable, through the
whole path (engine, gateway, traffic reports, analysis), not a mock. The rng is injectable so
tests can fix the sequence; in service it is seeded from the OS.
"""

from __future__ import annotations

import asyncio
import random

from protocol.engine_config import ChaosConfig
from protocol.openai import OpenAIErrorReply


class Chaos:
    """Decides, per generation request, whether to delay it and whether to fail it."""

    def __init__(self, config: ChaosConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()

    async def strike(self) -> None:
        """Sleep the configured extra latency, then raise a 500 with the configured odds."""
        if self.config.extra_latency_ms:
            await asyncio.sleep(self.config.extra_latency_ms / 1000)
        if self.config.error_rate and self._rng.random() < self.config.error_rate:
            raise OpenAIErrorReply(
                500,
                f"injected failure (chaos.error_rate={self.config.error_rate} in the engine "
                "config)",
                code="chaos_injected",
            )
