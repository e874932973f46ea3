"""The distributed `ModelShard`: a rank's vocabulary rows and experts, and the collectives that
complete its partial results over the process group (`torch.distributed`'s default group).

Per layer a forward makes one all-reduce after the attention's output projection and one after
the MLP (DiffusionGemma: one each after its dense MLP and its experts, which are normed apart).
`expert` placement reduces the experts' combined output too: each rank computes its experts'
part for every token and the all-reduce sums the parts. That keeps one collective of
(tokens, hidden) per layer whatever the routing; an all-to-all that sends each token only to
its experts' ranks moves k / N of the rows twice instead, which pays only at batches of many
hundred tokens (see `bench/engine_parallel.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import ModelShard
from engine.parallel.group import DRIVER
from engine.parallel.plan import RankShare


class DistributedShard(ModelShard):
    """SHARE's rank of a model with VOCAB_SIZE rows, split over the default process group."""

    def __init__(self, share: RankShare, vocab_size: int) -> None:
        self.share = share
        self.rank, self.size = share.rank, share.size
        self.vocab_size = vocab_size
        self.vocab = share.vocab(vocab_size)
        self.vocab_width = -(-vocab_size // share.size)  # every rank's rows, the last padded

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows (`RankShare.vocab`)."""
        if vocab_size != self.vocab_size:
            raise ValueError(
                f"this shard splits a vocabulary of {self.vocab_size}, not {vocab_size}"
            )
        return self.vocab.start, self.vocab.stop

    def experts(self, num_experts: int) -> tuple[int, int]:
        """This rank's experts (`RankShare.experts`)."""
        span = self.share.experts(num_experts)
        return span.start, span.count

    def reduce(self, partial: Tensor) -> Tensor:
        """All-reduce (sum), in place."""
        dist.all_reduce(partial)
        return partial

    def embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        """Rows held here looked up, the others zero, summed over the ranks: each id's row
        comes from the one rank holding it (exact: the other terms are zeros)."""
        local = ids - self.vocab.start
        held = (local >= 0) & (local < self.vocab.count)
        out = table(local.clamp(0, self.vocab.count - 1))
        out.masked_fill_(~held.unsqueeze(-1), 0)
        return self.reduce(out)

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Every rank's columns gathered on the driver (others keep their own): padded to one
        width for the collective, cut back to the vocabulary after."""
        padded = F.pad(logits, (0, self.vocab_width - logits.shape[-1])).contiguous()
        if self.rank != DRIVER:
            dist.gather(padded, None, dst=DRIVER)
            return logits
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.gather(padded, parts, dst=DRIVER)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def softmax_vocab(self, logits: Tensor) -> Tensor:
        """Softmax over every rank's columns: the maximum and the normaliser all-reduced."""
        x = logits.float()
        top = x.amax(dim=-1, keepdim=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        exp = (x - top).exp_()
        total = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(total)
        return exp.div_(total)

    def scatter_vocab(
        self, whole: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """This rank's columns of WHOLE (*SHAPE, vocab) of DTYPE, which only the driver has,
        on DEVICE."""
        part = torch.empty((*shape, self.vocab_width), dtype=dtype, device=device)
        parts = None
        if self.rank == DRIVER:
            if whole is None:
                raise ValueError("the driver scatters a tensor it holds")
            padded = F.pad(
                whole.to(device, dtype), (0, self.vocab_width * self.size - whole.shape[-1])
            )
            parts = [c.contiguous() for c in padded.split(self.vocab_width, dim=-1)]
        dist.scatter(part, parts, src=DRIVER)
        return part[..., : self.vocab.count]
