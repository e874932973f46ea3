"""A rollout's analysis thresholds and timing, with the built-in defaults."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field

from protocol.api_model import ApiModel
from protocol.wire import INT32_MAX

MAX_INTERVAL_S = 24 * 3600.0


class RolloutPolicy(ApiModel):
    """Analysis thresholds and timing. Every field is optional: a rollout's own values win over
    its deployment's policy, which wins over `DEFAULT_POLICY`."""

    interval_s: float | None = Field(
        default=None, ge=1, le=MAX_INTERVAL_S, description="how long each step is held"
    )
    max_error_rate_increase: float | None = Field(
        default=None, ge=0, le=1, description="canary error rate minus stable's, absolute"
    )
    max_latency_ratio: float | None = Field(default=None, gt=0, description="canary p95 / stable")
    max_ttft_ratio: float | None = Field(default=None, gt=0, description="canary p95 TTFT / stable")
    max_steps_per_block_ratio: float | None = Field(
        default=None, gt=0, description="canary mean denoising steps per block / stable"
    )
    min_tokens_per_forward_ratio: float | None = Field(
        default=None, ge=0, description="canary mean tokens per forward / stable"
    )
    min_requests: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="per pool per interval, else inconclusive"
    )
    failure_limit: int | None = Field(
        default=None, ge=1, le=100, description="consecutive failing intervals that abort"
    )
    notify: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://",
        description="URL that gets a JSON POST on every state change and failed analysis",
    )

    def masked(self) -> RolloutPolicy:
        """This policy as anyone below admin sees it: `notify` as `notify_origin` shows it."""
        if self.notify is None:
            return self
        return self.model_copy(update={"notify": notify_origin(self.notify)})

    def over(self, base: RolloutPolicy) -> RolloutPolicy:
        """This policy's values where set, else BASE's."""
        mine = self.model_dump(exclude_none=True)
        return base.model_copy(update=mine)


def notify_origin(url: str) -> str:
    """What may be shown of a notify URL below admin, in events and in logs:
    `https://hooks.example.com/…`. Its user, password, port, path and query may each be the
    secret (a Slack or Teams hook is all path)."""
    scheme = url.partition(":")[0]
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:  # an unbalanced `[`: nothing of it is shown
        host = ""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}/…"


DEFAULT_POLICY = RolloutPolicy(
    interval_s=300.0,
    max_error_rate_increase=0.01,
    max_latency_ratio=1.25,
    max_ttft_ratio=1.25,
    max_steps_per_block_ratio=1.15,
    min_tokens_per_forward_ratio=0.85,
    min_requests=30,
    failure_limit=2,
)
