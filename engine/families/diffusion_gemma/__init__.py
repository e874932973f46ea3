"""DiffusionGemma: an encoder over committed tokens and a bidirectional, self-conditioned decoder
that denoises a canvas of uniform-noise tokens (reference: `transformers.models.diffusion_gemma`).
"""
