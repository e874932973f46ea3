"""The engine's exception hierarchy, written out in one place.

Every error a user can cause (a bad checkpoint, bad request parameters) is one of these, with a
message that names what to fix; nothing else should escape the engine's public API.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class QueueFull(EngineError):
    """Admission refused: every slot is busy and the waiting queue is full."""


class EngineStopped(EngineError):
    """The engine is draining or stopped and takes no new requests."""


class RequestAbandoned(EngineError):
    """The client disconnected while its request ran; the request was aborted.

    Not `runtime.asgi_body.ClientGone`, which is a client gone before its body was read."""


class CheckpointError(EngineError):
    """A checkpoint directory cannot be used: missing, unreadable or inconsistent files."""


class InvalidParams(EngineError, ValueError):
    """A request parameter is out of range; `field` names it and the message gives the range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(InvalidParams):
    """Prompt plus requested tokens (rounded up to whole blocks) exceed the context length."""

    def __init__(self, limit: int, requested: int, message: str | None = None) -> None:
        super().__init__(
            "max_tokens",
            message
            or (
                f"max_tokens: the request needs {requested} tokens of context but the limit is "
                f"{limit}; shorten the prompt or lower max_tokens"
            ),
        )
        self.limit = limit
        self.requested = requested
