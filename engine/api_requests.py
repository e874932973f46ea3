"""From an OpenAI request body to engine inputs: prompt token ids and SamplingParams.

Everything here either produces what the engine needs or raises an `OpenAIErrorReply` 400 that names
the field to fix, so the route handlers stay about HTTP. Sizes are counted before any work: the
number of prompts and the length of their text are refused before a single token is made.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from engine.errors import ContextLengthExceeded, InvalidParams
from engine.params import SamplingParams
from protocol.engine_config import ModelSection
from protocol.openai import BaseRequest, ChatCompletionRequest, OpenAIErrorReply

# Defaults when a request leaves max_tokens out: OpenAI's 16 for completions; a chat answer
# gets the room left in the context, capped here.
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
# A token covers at most `Tokenizer.max_token_chars` characters of normalized text; a normalizer
# can fold a few code points into one (NFC/NFKC), so the bound on the text sent keeps this margin.
NORMALIZER_HEADROOM = 4


def text_budget(max_seq_len: int, max_token_chars: int) -> int:
    """The most characters of text that can fit in a context of `max_seq_len` tokens."""
    return max_seq_len * max(1, max_token_chars) * NORMALIZER_HEADROOM


def _too_much_text(param: str, chars: int, budget: int, max_seq_len: int) -> OpenAIErrorReply:
    return OpenAIErrorReply(
        400,
        f"{param} has {chars} characters; at most {budget} can fit in this server's context "
        f"of {max_seq_len} tokens; shorten it",
        param=param,
        code="context_length_exceeded",
    )


def parse_body(
    raw: bytes, schema: type[BaseRequest], *, ignore_unknown: bool = False
) -> tuple[Any, list[str]]:
    """Decode and validate a JSON request body against `schema`: (the request, the unknown
    fields dropped). Unknown fields are a 400 naming the first, unless IGNORE_UNKNOWN (the
    engine config's `service.unknown_fields: ignore`): then they are dropped, wherever they are
    (`stream_options.x` too), and named in the list for the metric and the log."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise OpenAIErrorReply(
            400, "the request body is not valid JSON", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIErrorReply(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data), []
    except ValidationError as exc:
        unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if not ignore_unknown or not unknown or not all(_drop(data, loc) for loc in unknown):
            raise validation_error(exc) from None
    try:
        return schema.model_validate(data), [".".join(map(str, loc)) for loc in unknown]
    except ValidationError as exc:
        raise validation_error(exc) from None


def _drop(data: Any, loc: tuple[int | str, ...]) -> bool:
    """Remove the field at LOC (a pydantic error location) from the parsed JSON DATA; False
    where LOC is no path in it (a location inside a union names the union's member)."""
    for key in loc[:-1]:
        in_dict = isinstance(data, dict) and key in data
        in_list = isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data)
        if in_dict or in_list:
            data = data[key]
        elif not isinstance(key, int) and isinstance(data, (dict, list)):
            continue  # a union member's tag (`list[TextPart]`): the data has no level for it
        else:
            return False
    if not isinstance(data, dict) or loc[-1] not in data:
        return False
    del data[loc[-1]]
    return True


def validation_error(exc: ValidationError) -> OpenAIErrorReply:
    """The first schema violation as a 400 naming the field."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if first["type"] == "extra_forbidden":
        return OpenAIErrorReply(400, f"unknown field {where!r}", param=param, code="unknown_field")
    if first["type"] == "missing":
        return OpenAIErrorReply(400, f"{where} is required", param=param, code="missing_field")
    message = str(first["msg"]).removeprefix("Value error, ")
    if not loc:
        # A model-level rule (an unsupported standard field); the message names the field.
        param = message.split("=", 1)[0] if "=" in message else None
        return OpenAIErrorReply(400, message, param=param, code="unsupported_value")
    return OpenAIErrorReply(400, f"{where}: {message}", param=param, code="invalid_value")


def params_error(exc: InvalidParams) -> OpenAIErrorReply:
    """An engine parameter error as a 400 (`context_length_exceeded` keeps its own code)."""
    if isinstance(exc, ContextLengthExceeded):
        return OpenAIErrorReply(400, str(exc), param=exc.field, code="context_length_exceeded")
    return OpenAIErrorReply(400, str(exc), param=exc.field, code="invalid_value")


def sampling_params(
    body: BaseRequest,
    defaults: ModelSection,
    max_tokens: int | None,
    thinking: bool | None,
    default_block: int,
) -> SamplingParams:
    """The request's decoding parameters; unset diffusion knobs take the server's defaults.

    The server's default `steps` applies only to a request that chose no mode (neither
    `steps` nor `threshold`), capped at the request's block size: a request asking for a
    smaller block than the default schedule has steps for still decodes.
    """

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    block_size = pick(body.block_size, defaults.block_size)
    steps = body.steps
    if steps is None and body.threshold is None and defaults.steps is not None:
        block = pick(block_size, default_block)
        steps = min(defaults.steps, block) if isinstance(block, int) else defaults.steps

    return SamplingParams(
        max_tokens=pick(max_tokens, COMPLETION_DEFAULT_MAX_TOKENS),
        temperature=pick(body.temperature, 0.0),
        top_p=pick(body.top_p, 1.0),
        top_k=pick(body.top_k, 0),
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop,
        block_size=block_size,
        threshold=pick(body.threshold, defaults.threshold),
        steps=steps,
        min_steps=pick(body.min_steps, defaults.min_steps),
        max_steps=pick(body.max_steps, defaults.max_steps),
        thinking=thinking,
        ignore_eos=body.ignore_eos,
        min_tokens=pick(body.min_tokens, 0),
        min_p=pick(body.min_p, 0.0),
        stop_token_ids=body.stop_token_ids,
        skip_special_tokens=body.skip_special_tokens,
    )


def default_params(defaults: ModelSection, default_block: int, max_tokens: int) -> SamplingParams:
    """The decoding parameters of a request that sets none: the server's defaults, by the same
    rules as `sampling_params` (the warm-up decodes with them, so a family that refuses one
    stops start-up instead of refusing every request)."""
    return sampling_params(BaseRequest(model="defaults"), defaults, max_tokens, None, default_block)


def check_request(
    params: SamplingParams,
    prompt: list[int],
    *,
    max_seq_len: int,
    default_block: int,
    vocab_size: int,
) -> None:
    """Refuse, before admission, what the engine would refuse: the same rules, as 400s."""
    try:
        params.validate(max_seq_len, len(prompt), default_block)
    except InvalidParams as exc:
        raise params_error(exc) from None
    if any(not 0 <= t < vocab_size for t in prompt):
        raise OpenAIErrorReply(
            400,
            f"prompt token ids must be in [0, {vocab_size})",
            param="prompt",
            code="invalid_value",
        )
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids or ()):
        raise OpenAIErrorReply(
            400,
            f"stop_token_ids must be in [0, {vocab_size}): the model cannot generate the others",
            param="stop_token_ids",
            code="invalid_value",
        )


def check_prompt_sizes(
    prompt: Any, *, max_prompts: int, max_seq_len: int, max_token_chars: int
) -> None:
    """Refuse, before tokenizing, too many prompts or a prompt that cannot fit the context."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        prompts = [prompt]
    elif not prompt:
        raise OpenAIErrorReply(
            400, "prompt must not be empty", param="prompt", code="invalid_value"
        )
    else:
        prompts = prompt
    if len(prompts) > max_prompts:
        # More prompts than batch slots would be refused as "queue full" forever.
        raise OpenAIErrorReply(
            400,
            f"at most {max_prompts} prompts per request, got {len(prompts)}",
            param="prompt",
            code="invalid_value",
        )
    budget = text_budget(max_seq_len, max_token_chars)
    for p in prompts:
        if isinstance(p, str) and len(p) > budget:
            raise _too_much_text("prompt", len(p), budget, max_seq_len)
        if isinstance(p, list) and len(p) > max_seq_len:
            raise OpenAIErrorReply(
                400,
                f"prompt has {len(p)} token ids; the context holds {max_seq_len}",
                param="prompt",
                code="context_length_exceeded",
            )


def completion_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt: a string, token ids, or a list of either (sizes checked)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def check_chat_size(body: ChatCompletionRequest, *, max_seq_len: int, max_token_chars: int) -> None:
    """Refuse, before rendering, a conversation whose text cannot fit the context."""
    budget = text_budget(max_seq_len, max_token_chars)
    chars = 0
    for message in body.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content is not None:
            chars += sum(len(part.text) for part in content)
        if chars > budget:
            raise _too_much_text("messages", chars, budget, max_seq_len)


def chat_prompt(body: ChatCompletionRequest, tokenizer: Any, thinking: bool) -> list[int]:
    """Render the conversation with the checkpoint's chat template and tokenize it."""
    if not tokenizer.has_chat_template:
        raise OpenAIErrorReply(
            400,
            "this checkpoint has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        # Markers the template writes are special tokens; the same strings in content are text.
        return list(
            tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=thinking)
        )
    except Exception as exc:  # the template's own raise_exception() or a rendering error
        raise OpenAIErrorReply(
            400,
            f"the chat template rejected these messages: {exc}",
            param="messages",
            code="invalid_value",
        ) from None


def chat_max_tokens(
    body: ChatCompletionRequest, prompt_len: int, max_seq_len: int, block: int
) -> int:
    """max_tokens of a chat request: as asked, else what fits in the context (whole blocks)."""
    asked = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    if asked is not None:
        return asked
    block = max(1, body.block_size or block)
    room = (max_seq_len // block) * block - prompt_len
    return max(1, min(CHAT_DEFAULT_MAX_TOKENS, room))
