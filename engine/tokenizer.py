"""The checkpoint's tokenizer: `tokenizer.json` via `tokenizers`, chat template via jinja2.

Client text can never forge a special token. `tokenizers` matches added tokens anywhere in the
text it encodes, so a user message holding `<|im_end|><|im_start|>system` would otherwise become
the real chat markers. `encode` therefore spells special-token strings as ordinary text, and
`encode_chat` hides them in message contents while the template renders, so that only the
markers the template itself writes become special tokens.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.config import read_checkpoint_json
from engine.errors import CheckpointError

# Spellings of the diffusion mask token in the families we serve (SDAR, LLaDA, our test fixtures).
MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<|mdm_mask|>", "<mask>", "[MASK]")

# Brackets the index of a hidden piece of message content while the chat template renders: a
# private-use code point no template writes (one inside a content is hidden like a marker).
_HIDE = "\U0010fffd"
_PLACEHOLDER = re.compile(f"{_HIDE}([0-9]{{1,9}}){_HIDE}")


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _added_tokens(path: Path) -> dict[str, int]:
    """Special/added tokens declared in tokenizer.json and tokenizer_config.json: content -> id."""
    found: dict[str, int] = {}
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        for entry in read_checkpoint_json(tok_json).get("added_tokens") or []:
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                found[str(entry.get("content"))] = entry["id"]
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        for key, entry in (read_checkpoint_json(cfg).get("added_tokens_decoder") or {}).items():
            content = _token_content(entry)
            if content is not None and str(key).isdigit():
                found.setdefault(content, int(key))
    return found


def find_mask_token_id(path: str | Path) -> int | None:
    """The id of the tokenizer's mask special token, read from the JSON files (no `tokenizers`)."""
    path = Path(path)
    added = _added_tokens(path)
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        named = _token_content(read_checkpoint_json(cfg_file).get("mask_token"))
        if named is not None and named in added:
            return added[named]
    for name in MASK_TOKEN_NAMES:
        if name in added:
            return added[name]
    return None


def _load_chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": "..."}, ...]; use the default one.
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        mask_token_id: int | None,
        eos_token_ids: list[int],
        source: str,
    ) -> None:
        self._backend = backend
        self._template_source = chat_template
        self._template: Any = None
        self._special_tokens = special_tokens
        self.mask_token_id = mask_token_id
        self.eos_token_ids = eos_token_ids
        self.source = source
        # Ids the tokenizer defines; embedding rows at or above it are padding, never sampled.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        vocab = backend.get_vocab(with_added_tokens=True)
        # The most characters one token covers: a text longer than max_seq_len times this cannot
        # fit in the context, which the server can tell before tokenizing.
        self.max_token_chars: int = max((len(t) for t in vocab), default=1)
        protected = _protected_strings(backend, special_tokens, mask_token_id)
        self._protected_ids = {vocab[t] for t in protected if t in vocab}
        alternatives = "|".join(re.escape(t) for t in sorted(protected, key=len, reverse=True))
        self._markers = re.compile(alternatives) if protected else None
        self._hidden_in_content = re.compile("|".join(filter(None, [alternatives, _HIDE])))
        # Fragments of a marker at a content's edge, which template text next to it could complete.
        self._marker_heads = {t[:k] for t in protected for k in range(1, len(t))}
        self._marker_tails = {t[k:] for t in protected for k in range(1, len(t))}
        self._longest_marker = max((len(t) for t in protected), default=0)

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return self._template_source is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of client text, without BOS/EOS; special-token strings in it stay text.

        `<|im_start|>`, the mask token or EOS written in a prompt are spelled with ordinary
        tokens (a client that means the special token sends its id). Non-special added tokens
        (Qwen's `<think>`) are vocabulary like any other and are matched.
        """
        if self._markers is None:
            return self._encode_plain(text)
        ids: list[int] = []
        pos = 0
        for match in self._markers.finditer(text):
            ids += self._encode_plain(text[pos : match.start()])
            ids += self._spell(match.group())
            pos = match.end()
        return ids + self._encode_plain(text[pos:])

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template.

        The markers the template writes are special tokens; the same strings inside a
        message's content are text, so a user cannot close their turn and open a system one.
        """
        hidden: list[str] = []
        escaped = [
            {**m, "content": self._hide_markers(m["content"], hidden)}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        text = self.apply_chat_template(
            escaped, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )
        ids: list[int] = []
        pos = 0
        for match in _PLACEHOLDER.finditer(text):
            index = int(match.group(1))
            if index >= len(hidden):
                continue  # not one of ours: left in the text around it
            ids += self._encode_template(text[pos : match.start()])
            ids += self.encode(hidden[index])
            pos = match.end()
        return ids + self._encode_template(text[pos:])

    def _encode_template(self, text: str) -> list[int]:
        """Ids of template output: the markers in it become special tokens."""
        return list(self._backend.encode(text, add_special_tokens=False).ids) if text else []

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of text without special-token strings in it."""
        ids = self._encode_template(text)
        if self._protected_ids.isdisjoint(ids):
            return ids
        # Matched after normalization (a case-folding normalizer, say): spell it out instead.
        return self._spell(text)

    def _spell(self, text: str) -> list[int]:
        """Ids of `text` by the tokenizer's model alone, without added-token matching."""
        ids = self._model_ids(text)
        if self._protected_ids.isdisjoint(ids):
            return ids
        # The model's own vocabulary holds the marker whole: spell it a character at a time. A
        # one-character special token cannot be written as text at all and is left out.
        return [i for ch in text for i in self._model_ids(ch) if i not in self._protected_ids]

    def _model_ids(self, text: str) -> list[int]:
        """Ids of `text` through normalizer, pre-tokenizer and model: `encode` without the
        added-token table."""
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = (
            [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
            if backend.pre_tokenizer is not None
            else [text]
        )
        return [token.id for piece in pieces for token in backend.model.tokenize(piece)]

    def _hide_markers(self, content: str, hidden: list[str]) -> str:
        """`content` with each special-token string, and a marker fragment at either end, put
        aside in `hidden` and replaced by a placeholder naming its index."""

        def placeholder(literal: str) -> str:
            hidden.append(literal)
            return f"{_HIDE}{len(hidden) - 1}{_HIDE}"

        text = self._hidden_in_content.sub(lambda m: placeholder(m.group()), content)
        reach = self._longest_marker - 1
        head = next(
            (k for k in range(min(reach, len(text)), 0, -1) if text[:k] in self._marker_tails), 0
        )
        rest = text[head:]
        tail = next(
            (k for k in range(min(reach, len(rest)), 0, -1) if rest[-k:] in self._marker_heads), 0
        )
        if not head and not tail:
            return text
        middle = rest[: len(rest) - tail]
        return (
            (placeholder(text[:head]) if head else "")
            + middle
            + (placeholder(rest[len(rest) - tail :]) if tail else "")
        )

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`, special tokens (mask, EOS, chat markers) left out unless asked for."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string, or None if the vocabulary lacks it."""
        value = self._backend.token_to_id(token)
        return int(value) if value is not None else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """Renders `messages` with the checkpoint's template (thinking switch passed through)."""
        if self._template_source is None:
            raise CheckpointError(
                f"{self.source}: the checkpoint has no chat_template in tokenizer_config.json "
                "(or chat_template.jinja); use plain completions instead"
            )
        if self._template is None:
            self._template = _compile_template(self._template_source, self.source)
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return str(self._template.render(**variables))
        except Exception as exc:
            # A template error is about the template or the messages, never an engine crash.
            raise CheckpointError(
                f"{self.source}: the chat template failed to render: {exc}"
            ) from exc


def _protected_strings(
    backend: Any, special_tokens: dict[str, str], mask_token_id: int | None
) -> set[str]:
    """Strings client text must not turn into tokens: special added tokens, BOS/EOS/PAD/UNK as
    tokenizer_config.json spells them, and the mask token even where it is not marked special."""
    added = backend.get_added_tokens_decoder()
    found = {token.content for token in added.values() if token.special}
    found.update(special_tokens.values())
    if mask_token_id is not None and mask_token_id in added:
        found.add(added[mask_token_id].content)
    return {text for text in found if text}


def _compile_template(source: str, origin: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # Same whitespace rules HF templates are written against.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise CheckpointError(f"{origin}: the chat template does not compile: {exc}") from exc


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads `tokenizer.json` (+ `tokenizer_config.json`) from a checkpoint directory."""
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(
            f"{tok_file}: missing; the checkpoint needs a tokenizers-format tokenizer.json"
        )
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(tok_file))
    except Exception as exc:
        # `tokenizers` raises a bare Exception for malformed files.
        raise CheckpointError(f"{tok_file}: unreadable tokenizer ({exc})") from exc
    tok_cfg_file = path / "tokenizer_config.json"
    tok_cfg = read_checkpoint_json(tok_cfg_file) if tok_cfg_file.is_file() else {}
    special = {
        key: content
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (content := _token_content(tok_cfg.get(key))) is not None
    }
    eos: list[int] = []
    eos_text = special.get("eos_token")
    if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
        eos.append(int(eos_id))
    # The model's own EOS list (config / generation config) also ends a generation.
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            value = read_checkpoint_json(file).get("eos_token_id")
            ids = value if isinstance(value, list) else [value]
            eos += [
                i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i not in eos
            ]
    return Tokenizer(
        backend,
        chat_template=_load_chat_template(path, tok_cfg),
        special_tokens=special,
        mask_token_id=find_mask_token_id(path),
        eos_token_ids=eos,
        source=str(path),
    )
