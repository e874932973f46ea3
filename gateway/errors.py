"""The gateway's refusals: each is answered in OpenAI's error shape (`OpenAIErrorReply.body()`);
those of a client token (`ClientTokenRefused`) also say whom they count against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.logs import RefusalReason
from protocol.openai import OpenAIErrorReply


class GatewayError(OpenAIErrorReply):
    """An error the gateway answers itself (the engine's own errors pass through untouched)."""

    TYPES: ClassVar[dict[int, str]] = {
        **OpenAIErrorReply.TYPES,
        403: "permission_error",
        405: "invalid_request_error",
        408: "timeout_error",
        502: "server_error",
    }


def not_found(path: str) -> GatewayError:
    """A path the gateway does not serve."""
    return GatewayError(
        404,
        f"no such endpoint {path!r}: the gateway serves POST /v1/chat/completions, "
        "POST /v1/completions and GET /v1/models",
        code="unknown_url",
    )


@dataclass(frozen=True)
class Refusal:
    """Whom a token refusal counts against and why: one count of a `TokenRefusal`."""

    token: str  # the token's name; '' when no token in the routing table matched
    key_id: str  # '' when the value was no dctl token
    reason: RefusalReason


class ClientTokenRefused(GatewayError):
    """A refusal of the client's token itself (missing, unknown, expired, revoked, over its
    rate or concurrency, or beyond its grant): counted per token and reason in the traffic
    reports, so `dctl audit` sees who is being refused."""

    def __init__(
        self,
        status: int,
        message: str,
        refusal: Refusal,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, param=param, code=code, headers=headers)
        self.refusal = refusal
