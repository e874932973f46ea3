"""A tiny random-weight Llama vLLM can load, and a check that transformers loads it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .report import Report, StepFailed

# Small enough to load in seconds; head_dim 64 suits every vLLM attention backend.
LLAMA_SHAPE = {
    "hidden": 256,
    "intermediate": 512,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "bpe_vocab": 384,
    "max_positions": 2048,
}


def write_tiny_checkpoint(path: Path) -> Path:
    """A random bf16 LlamaForCausalLM with the demo's tokenizer and chat template.

    config.json is written in the layout transformers 4 and 5 both read, so the checkpoint does
    not depend on which transformers the vLLM venv pulls. The vocabulary is exactly the
    tokenizer's: no id the model can sample lacks a token.
    """
    import torch
    from safetensors.torch import save_file

    from engine.demo_checkpoint import THINK_TOKENS, prepare_demo_directory, write_json
    from engine.demo_checkpoint import write_tokenizer as write_demo_tokenizer

    s = LLAMA_SHAPE
    out = prepare_demo_directory(path)
    tokenizer = write_demo_tokenizer(
        out, vocab_size=s["bpe_vocab"], max_positions=s["max_positions"]
    )
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    assert vocab == s["bpe_vocab"] + len(THINK_TOKENS)
    ids = {t: tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": s["hidden"],
            "intermediate_size": s["intermediate"],
            "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"],
            "hidden_act": "silu",
            "max_position_embeddings": s["max_positions"],
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "torch_dtype": "bfloat16",
        },
    )
    write_json(
        out / "generation_config.json", {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    )
    gen = torch.Generator().manual_seed(0)
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": normal(vocab, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": normal(vocab, h),
    }
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": normal(q, h),
            f"{p}.self_attn.k_proj.weight": normal(kv, h),
            f"{p}.self_attn.v_proj.weight": normal(kv, h),
            f"{p}.self_attn.o_proj.weight": normal(h, q),
            f"{p}.mlp.gate_proj.weight": normal(s["intermediate"], h),
            f"{p}.mlp.up_proj.weight": normal(s["intermediate"], h),
            f"{p}.mlp.down_proj.weight": normal(h, s["intermediate"]),
        }
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    return out


# Loads the tokenizer as vLLM does (AutoTokenizer, chat template) and the model with
# AutoModelForCausalLM (every weight name matched), one forward pass; exits 3 without
# transformers. Runs in the vLLM interpreter (it brings its own transformers), so a bad
# checkpoint shows in seconds, not after a vLLM start.
_LOAD_CHECK = """\
import sys
try:
    import torch, transformers
except ImportError:
    sys.exit(3)
path = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(path)
ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
ids = ids["input_ids"] if hasattr(ids, "keys") else ids
model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
assert not info["missing_keys"] and not info["unexpected_keys"], info
logits = model(torch.tensor([ids])).logits
assert logits.shape[-1] == model.config.vocab_size == len(tok), (logits.shape, len(tok))
print(f"transformers {transformers.__version__}: {type(tok).__name__}, "
      f"{sum(p.numel() for p in model.parameters())} parameters, {len(ids)} prompt tokens")
"""


def check_checkpoint(python: str, path: Path, report: Report) -> None:
    """The checkpoint loads with transformers in PYTHON (skipped where it has none)."""
    try:
        done = subprocess.run(
            [python, "-c", _LOAD_CHECK, str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        report.add("FAIL", "checkpoint loads", f"{python} took over 300 s to load {path}")
        raise StepFailed("checkpoint loads", "see why the interpreter hangs") from None
    if done.returncode == 3:
        report.add("SKIP", "checkpoint loads", f"no transformers for {python}")
    elif not report.expect(
        done.returncode == 0,
        "checkpoint loads",
        (done.stdout.strip() or done.stderr.strip()[-600:]),
    ):
        raise StepFailed("checkpoint loads", f"fix the checkpoint writer ({path})")
