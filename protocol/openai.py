"""The OpenAI-compatible wire format: request bodies, responses, stream chunks and errors.

Requests are strict: an unknown field, or a standard OpenAI field set to something this engine
cannot honour (logprobs, n > 1, penalties...), is a 400 naming the field and saying why rather
than being silently ignored (an engine config may ask for unknown fields to be ignored instead:
`service.unknown_fields`). The diffusion knobs (`block_size`, `threshold`, `steps`, `min_steps`,
`max_steps`, `thinking`) and the vLLM/SGLang extensions benchmark clients send (`ignore_eos`,
`min_tokens`, `top_k`, `min_p`, `stop_token_ids`, `skip_special_tokens`,
`spaces_between_special_tokens`, `stream_options.continuous_usage_stats`; `repetition_penalty`
at 1 only) are accepted as extra body fields.

Every list and string a client sends is bounded here, while parsing, so that no request makes the
server tokenize, render or search without limit; the server adds the limits its configuration
sets (body size, prompts per request, text that fits the context) before any work.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
    model_validator,
)

# Size limits of the wire format (each a 400 naming the field). Stop strings are searched for in
# the generated text at every step, so both their number and their length cost per token.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_NAME_CHARS = 256  # `model`, `user`
MAX_STOP_TOKEN_IDS = 64  # checked against every generated token

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]

# Standard fields we accept only at their neutral value: (field, neutral values).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "repetition_penalty": (None, 1, 1.0),
}
# Why a field is accepted at its neutral value only, where the reason is not plain.
_WHY_NEUTRAL: dict[str, str] = {
    "repetition_penalty": "it penalises tokens already generated, and block-diffusion decoding "
    "chooses a block's tokens in parallel and out of order, so there is no 'already generated' "
    "to penalise against; leave it out or send 1",
}


class OpenAIErrorReply(Exception):
    """An error answered in the OpenAI shape: `{"error": {message, type, param, code}}`.

    The engine's and the gateway's; the control plane's REST errors are
    `controlplane.api.errors.ApiError`, a different body."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def metric_reason(self) -> str | None:
        """The `dllm_request_errors_total` reason this refusal counts under (None: not counted)."""
        if self.code in (
            "context_length_exceeded",
            "model_not_found",
            "engine_error",
            "chaos_injected",
        ):
            return self.code
        return {
            400: "invalid_request",
            401: "unauthorized",
            413: "invalid_request",
            429: "queue_full",
            503: "not_ready",
            504: "timeout",
        }.get(self.status)

    def body(self) -> dict[str, Any]:
        """The JSON body clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk before [DONE] carries usage (`include_usage`),
    and whether every chunk does, counted so far (`continuous_usage_stats`, vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class BaseRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: Name
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # Diffusion knobs (extra_body in the openai client).
    block_size: StrictInt | None = None
    threshold: float | None = None
    steps: StrictInt | None = None
    min_steps: StrictInt | None = None
    max_steps: StrictInt | None = None
    # vLLM/SGLang sampling extensions (extra_body), honoured by the engine's decoding.
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = None
    min_p: float | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool | None = None
    # Accepted at neutral values only (see _NEUTRAL).
    repetition_penalty: float | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: StrictInt | None = None

    @model_validator(mode="after")
    def _neutral_only(self) -> BaseRequest:
        for name, allowed in _NEUTRAL.items():
            if name in type(self).model_fields:
                value = getattr(self, name)
                if value not in allowed:
                    why = _WHY_NEUTRAL.get(name)
                    raise ValueError(
                        f"{name}={value!r} is not supported by this engine"
                        + (f": {why}" if why else "")
                    )
        if self.spaces_between_special_tokens and not self.skip_special_tokens:
            raise ValueError(
                "spaces_between_special_tokens=True is not supported by this engine: its "
                "tokenizer writes special tokens as the checkpoint's decoder joins them, with "
                "no space added; send false, or leave skip_special_tokens at true"
            )
        return self

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return value


class CompletionRequest(BaseRequest):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None


# Content-part types that carry an image (OpenAI's chat and Responses spellings).
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


class TextPart(BaseModel):
    """One text part of a message's content list."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="ignore")  # e.g. `name`, which the template does not use
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        # Said before the union is tried: pydantic's own error for an image part lists every
        # member it failed to match, and never says that images are what is not served.
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind in IMAGE_PART_TYPES:
                    raise ValueError(
                        f"content part {i} is an image ({kind!r}): the engines serve text only "
                        "(a checkpoint's vision tower is not loaded); send text parts"
                    )
        return value

    @model_validator(mode="after")
    def _bounded_parts(self) -> ChatMessage:
        if isinstance(self.content, list) and len(self.content) > MAX_CONTENT_PARTS:
            raise ValueError(
                f"content has {len(self.content)} parts; at most {MAX_CONTENT_PARTS} per message"
            )
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    """`response_format`: only plain text is supported."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ChatCompletionRequest(BaseRequest):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = None
    thinking: StrictBool | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None


class Usage(BaseModel):
    """Token counts of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style (`cmpl-...`, `chatcmpl-...`)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """`created`: Unix seconds."""
    return int(time.time())


def completion_body(
    rid: str, model: str, texts: list[tuple[str, str | None]], usage: Usage
) -> dict[str, Any]:
    """A non-streamed `text_completion` response; `texts` holds (text, finish_reason)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            for i, (text, reason) in enumerate(texts)
        ],
        "usage": usage.model_dump(),
    }


def completion_chunk(
    rid: str, model: str, text: str, finish_reason: str | None, usage: Usage | None = None
) -> dict[str, Any]:
    """One streamed `text_completion` chunk."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = usage.model_dump()
    return chunk


def chat_body(rid: str, model: str, text: str, finish_reason: str | None, usage: Usage) -> dict:
    """A non-streamed `chat.completion` response."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage.model_dump(),
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One streamed `chat.completion.chunk`; with `usage` it is the usage-only final chunk."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "choices": []
        if usage is not None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage is not None:
        chunk["usage"] = usage.model_dump()
    return chunk


# The engine ends every stream with this SSE comment line (before `data: [DONE]`) carrying the
# request's `Usage`, whether or not the client asked for `stream_options.include_usage`: the
# gateway counts every request's tokens from it and takes it out of what the client gets. SSE
# clients (the OpenAI SDK, httpx-sse, browsers) skip comment lines, so a client talking to the
# engine directly sees the same events.
USAGE_COMMENT_PREFIX = b": usage "


def usage_comment(usage: Usage) -> str:
    """The stream's closing usage comment: `: usage {...}` and the blank line ending it."""
    return f"{USAGE_COMMENT_PREFIX.decode()}{usage.model_dump_json()}\n\n"
