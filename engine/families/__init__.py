"""Model families beyond the SDAR / Qwen3-MoE layout: one package per family."""
