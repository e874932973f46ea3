"""The checkpoint's tokenizer: `tokenizer.json` via `tokenizers`, chat template via jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.config import read_checkpoint_json
from engine.errors import CheckpointError

# Spellings of the diffusion mask token in the families we serve (SDAR, LLaDA, our test fixtures).
MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<|mdm_mask|>", "<mask>", "[MASK]")


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

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return self._template_source is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS or any other added special token."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens (mask, EOS, chat markers) left out."""
        return str(self._backend.decode(list(ids), skip_special_tokens=True))

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
