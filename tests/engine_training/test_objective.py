"""The training objective sees exactly what the engine's decoder sees, and exports round-trip.

If the [noisy | clean] attention mask drifted from the engine's block-causal decoding, the demo
model would be trained for a different task than the one it serves: these tests tie the two
together on a real (tiny, random) checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.demo_checkpoint import create_demo_checkpoint
from engine.loader import load_model
from engine.model import Model
from engine.training.export import hf_state_dict
from engine.training.objective import (
    block_diffusion_loss,
    corrupt,
    masked_logits,
    training_mask,
)

MASK_ID = 3  # <|mask|> in the demo tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Model]:
    path = create_demo_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=1, size="tiny")
    return path, load_model(path, dtype="float32")


def test_the_mask_lets_noisy_blocks_see_only_themselves_and_earlier_clean_blocks() -> None:
    mask = training_mask(8, 4)
    noisy, clean = slice(0, 8), slice(8, 16)
    # Noisy position 5 (block 1): its own noisy block, and clean block 0, nothing else.
    assert mask[5, noisy].tolist() == [False] * 4 + [True] * 4
    assert mask[5, clean].tolist() == [True] * 4 + [False] * 4
    # Clean position 5: clean blocks 0 and 1 (block-causal), never a noisy token.
    assert mask[8 + 5, clean].tolist() == [True] * 8
    assert not mask[8 + 5, noisy].any()
    assert mask[8 + 1, clean].tolist() == [True] * 4 + [False] * 4


@pytest.mark.parametrize("block", [2, 4, 8])
def test_training_logits_equal_the_engines_denoising_logits(
    tiny: tuple[Path, Model], block: int
) -> None:
    _, model = tiny
    gen = torch.Generator().manual_seed(block)
    clean = torch.randint(4, 300, (2, 16), generator=gen)
    noisy, masked = corrupt(clean, block, MASK_ID, gen)
    trained = masked_logits(model, clean, noisy, masked, block)

    # The engine: for block b, the clean blocks before it plus the noisy block b, block-causal.
    expected = []
    for row in range(2):
        for b in range(16 // block):
            span = slice(b * block, (b + 1) * block)
            ids = torch.cat((clean[row, : b * block], noisy[row, span])).unsqueeze(0)
            logits = model(ids, block_size=block)[0, b * block :]
            expected.append(logits[masked[row, span]])
    torch.testing.assert_close(trained, torch.cat(expected), atol=2e-5, rtol=1e-4)


def test_corruption_masks_every_block_and_keeps_the_rest() -> None:
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(4, 300, (64, 32), generator=gen)
    noisy, masked = corrupt(clean, 8, MASK_ID, gen)
    assert masked.view(64, 4, 8).any(dim=-1).all()  # at least one target per block
    assert (noisy[masked] == MASK_ID).all()
    assert torch.equal(noisy[~masked], clean[~masked])
    ratios = masked.view(-1, 8).float().mean(dim=-1)
    # Ratios spread over (0, 1]: some nearly clean blocks, some fully masked.
    assert ratios.min() <= 0.25 and ratios.max() == 1.0


def test_the_loss_trains_the_engine_model(tiny: tuple[Path, Model]) -> None:
    path, _ = tiny
    model = load_model(path, dtype="float32")
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(4, 40, (4, 16), generator=gen)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        noisy, masked = corrupt(clean, 4, MASK_ID, gen)
        result = block_diffusion_loss(model, clean, noisy, masked, 4)
        optimiser.zero_grad()
        (result.diffusion + 0.01 * result.balance).backward()
        optimiser.step()
        losses.append(float(result.diffusion.detach()))
    # Gradients reach every parameter the engine loads, experts and router included.
    assert all(p.grad is not None for p in model.parameters())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_the_export_writes_back_the_checkpoint_it_was_loaded_from(
    tiny: tuple[Path, Model],
) -> None:
    path, model = tiny
    original = load_file(str(path / "model.safetensors"))
    exported = hf_state_dict(model, torch.float32)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_block_size_one_is_autoregressive_prediction() -> None:
    # B = 1 (the recipe's AR phase): every position is a target and sees only earlier tokens.
    mask = training_mask(4, 1)
    assert mask[2, :4].tolist() == [False, False, True, False]  # itself (the mask token)
    assert mask[2, 4:].tolist() == [True, True, False, False]  # clean tokens before it
    gen = torch.Generator().manual_seed(0)
    _, masked = corrupt(torch.randint(4, 300, (8, 16), generator=gen), 1, MASK_ID, gen, 0.5)
    assert masked.all()


def test_suffix_masks_leave_a_clean_prefix_in_their_share_of_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(4, 300, (256, 16), generator=gen)
    _, masked = corrupt(clean, 8, MASK_ID, gen, suffix_share=1.0)
    blocks = masked.view(-1, 8).long()
    # Once masked, masked to the end of the block: a clean prefix of k in [0, 8) tokens.
    assert (blocks.diff(dim=-1) >= 0).all() and blocks[:, -1].all()
    assert set(blocks.sum(dim=-1).tolist()) == set(range(1, 9))
    # Without suffix masks the draws are the old ones (evaluations keep their held-out masks).
    a = corrupt(clean, 8, MASK_ID, torch.Generator().manual_seed(1))
    b = corrupt(clean, 8, MASK_ID, torch.Generator().manual_seed(1), suffix_share=0.0)
    assert torch.equal(a[1], b[1])
