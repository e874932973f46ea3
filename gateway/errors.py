"""The gateway's refusals: each is answered in OpenAI's error shape (`OpenAIErrorReply.body()`)."""

from __future__ import annotations

from typing import ClassVar

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
