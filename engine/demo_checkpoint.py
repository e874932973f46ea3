"""A deterministic demo checkpoint: a real Hugging Face-style directory with random weights.

The directory has everything a downloaded SDAR-MoE checkpoint has — `config.json` in the
Qwen3-MoE layout (plus `mask_token_id` and `block_size`), `model.safetensors` with the per-expert
parameter names, a byte-level BPE `tokenizer.json` trained here on a small built-in corpus,
`tokenizer_config.json` with a Qwen3-style chat template (thinking switch included) and
`generation_config.json`. The same seed and size give byte-identical files, so tests and demos
are reproducible and a snapshot digest of the directory is stable.

The weights are random: the model produces fluent-looking token soup, not English.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = ("tiny", "small")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Qwen3 adds the thinking markers as ordinary (non-special) added tokens: they stay in the text.
THINK_TOKENS = ["<think>", "</think>"]

# Qwen3-style: system/user/assistant turns between <|im_start|> and <|im_end|>; with
# enable_thinking=false the assistant turn opens with an empty think section, so the model
# answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Original text, a few paragraphs about the system itself: enough pairs for a few hundred merges.
CORPUS = """\
A fleet of machines serves language models to people who ask questions and expect answers.
Each host runs an agent, and each agent starts an engine for the model it was told to serve.
The engine reads a checkpoint directory, loads the weights, and waits for requests.
When a request arrives, the prompt is split into tokens and written into the cache.
The model then fills a block of masked positions, a few tokens at a time, until none are left.
Confident guesses are accepted first; uncertain ones wait for the next step of denoising.
A finished block is committed, and the next block starts as masks again.
Many requests share one forward pass, so the machine stays busy and the queue stays short.
When the queue is full, the server answers politely that the client should try again later.
Operators watch the metrics: requests running, requests waiting, tokens per forward, latency.
A rollout moves traffic from the stable version to the canary in small, careful steps.
If the canary is slower or fails more often, the controller aborts and restores the stable one.
Hello, how are you today? I am fine, thank you. What would you like to know about the weather?
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.
Numbers matter too: one, two, three, four, five, six, seven, eight, nine, ten, 2024, 3.14.
Good software says what went wrong and what to do next, in one clear sentence.
The river runs past the old mill, through the village, and down to the sea.
She wrote a short letter to her friend and walked to the post office before noon.
Questions, answers, stories and lists: the tokenizer learns the pieces that appear most often.
"""


@dataclass(frozen=True)
class DemoShape:
    """Architecture of one demo size (Qwen3-MoE fields)."""

    bpe_vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_tok: int
    moe_intermediate: int
    intermediate: int
    block_size: int
    max_positions: int
    dtype: str  # "float32" | "bfloat16", as config.json spells it


SHAPES: dict[str, DemoShape] = {
    # Loads in milliseconds; fp32 so tests can compare logits exactly.
    "tiny": DemoShape(
        bpe_vocab=384,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=4,
        experts_per_tok=2,
        moe_intermediate=32,
        intermediate=128,
        block_size=4,
        max_positions=2048,
        dtype="float32",
    ),
    # The README demo: a few million parameters, bf16 like a served checkpoint.
    "small": DemoShape(
        bpe_vocab=1024,
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=2,
        head_dim=32,
        experts=8,
        experts_per_tok=2,
        moe_intermediate=256,
        intermediate=768,
        block_size=32,
        max_positions=4096,
        dtype="bfloat16",
    ),
}


def train_tokenizer(
    vocab_size: int,
    texts: Iterable[str] | None = None,
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    added_tokens: Sequence[str] = THINK_TOKENS,
) -> Any:
    """Train a byte-level BPE tokenizer on `texts` (default: the built-in corpus's lines);
    deterministic, no download. `special_tokens` take ids 0.. in order; `added_tokens` come
    after the BPE vocabulary as ordinary (non-special) added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS.splitlines() if texts is None else texts
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tokenizer


def _padded(n: int, multiple: int = 64) -> int:
    # Real checkpoints pad the embedding to a round size; rows past the tokenizer stay unused.
    return -(-n // multiple) * multiple


def checkpoint_config(shape: DemoShape, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["SDARMoeForCausalLM"],
        "model_type": "sdar_moe",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "mask_token_id": ids["<|mask|>"],
        "block_size": shape.block_size,
        "torch_dtype": shape.dtype,
        "use_cache": True,
    }


def _weights(shape: DemoShape, vocab_size: int, seed: int) -> dict[str, Any]:
    """Random weights under the Hugging Face Qwen3-MoE names, drawn in a fixed order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if shape.dtype == "bfloat16" else torch.float32

    def normal(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ones(h)
        out[f"{p}.post_attention_layernorm.weight"] = ones(h)
        out[f"{p}.self_attn.q_proj.weight"] = normal(q_dim, h)
        out[f"{p}.self_attn.k_proj.weight"] = normal(kv_dim, h)
        out[f"{p}.self_attn.v_proj.weight"] = normal(kv_dim, h)
        out[f"{p}.self_attn.o_proj.weight"] = normal(h, q_dim)
        out[f"{p}.self_attn.q_norm.weight"] = ones(shape.head_dim)
        out[f"{p}.self_attn.k_norm.weight"] = ones(shape.head_dim)
        out[f"{p}.mlp.gate.weight"] = normal(shape.experts, h)
        for e in range(shape.experts):
            m = shape.moe_intermediate
            out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = normal(m, h)
            out[f"{p}.mlp.experts.{e}.up_proj.weight"] = normal(m, h)
            out[f"{p}.mlp.experts.{e}.down_proj.weight"] = normal(h, m)
    out["model.norm.weight"] = ones(h)
    out["lm_head.weight"] = normal(vocab_size, h)
    return out


def _tokenizer_config(
    ids: dict[str, int], max_positions: int, chat_template: str | None
) -> dict[str, Any]:
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + THINK_TOKENS
    }
    config: dict[str, Any] = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "mask_token": "<|mask|>",
        "model_max_length": max_positions,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is None:
        del config["chat_template"]
    return config


def write_json(path: Path, data: dict[str, Any]) -> None:
    # Fixed key order and formatting: part of the byte-identical promise.
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(
    directory: str | Path,
    *,
    vocab_size: int,
    max_positions: int = 2048,
    chat_template: str | None = CHAT_TEMPLATE,
    texts: Iterable[str] | None = None,
) -> Any:
    """Write the demo tokenizer (`tokenizer.json` + `tokenizer_config.json`) into `directory`.

    `vocab_size` counts the BPE vocabulary (special tokens included); the two thinking markers
    come on top. The special tokens are ids 0..3 in SPECIAL_TOKENS order. `chat_template=None`
    writes a tokenizer without one. Returns the `tokenizers.Tokenizer` it trained.
    """
    out = Path(directory)
    tokenizer = train_tokenizer(vocab_size, texts)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", _tokenizer_config(ids, max_positions, chat_template))
    return tokenizer


def prepare_demo_directory(directory: str | Path) -> Path:
    """Create `directory` (parents too) for a new checkpoint; ValueError if it holds files."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def create_demo_checkpoint(directory: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write the demo checkpoint into `directory` (created if missing) and return its path.

    Raises ValueError for an unknown size or a directory that already holds other files.
    """
    if size not in SHAPES:
        raise ValueError(f"size must be one of {', '.join(SIZES)} (got {size!r})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed})")
    shape = SHAPES[size]
    out = prepare_demo_directory(directory)
    from safetensors.torch import save_file  # torch: only once the arguments are known good

    tokenizer = write_tokenizer(out, vocab_size=shape.bpe_vocab, max_positions=shape.max_positions)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    vocab_size = _padded(tokenizer.get_vocab_size(with_added_tokens=True))
    write_json(out / "config.json", checkpoint_config(shape, vocab_size, ids))
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "mask_token_id": ids["<|mask|>"],
            "block_size": shape.block_size,
            "do_sample": False,
        },
    )
    # One metadata key only: safetensors stores metadata in a hash map, so a single key keeps
    # the header byte-identical across runs.
    save_file(_weights(shape, vocab_size, seed), str(out / "model.safetensors"), {"format": "pt"})
    return out
