"""The Qwen3 / Qwen3-MoE (SDAR) transformer with block-causal attention and a slot KV cache.

One forward serves every use: the parity form `model(ids, block_size=B)`, a prompt prefill that
writes the cache and wants logits of one row, and a denoising step that runs a block against the
cache and wants logits of its still-masked rows only (`logits_rows`).

A model may be one rank's share of a tensor-parallel model (`engine.parallel`): its config then
holds the rank's heads and intermediate sizes, and its `ModelShard` the vocabulary rows and
experts it holds and the exchanges that complete each partial result. The default shard is the
whole model in one process, where every exchange is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import packing
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.packing import PackScope


class ModelShard:
    """What one process holds of a model and how its forward completes partial results with the
    processes holding the rest (`engine.parallel.collectives` is the distributed one).

    This base is the whole model in one process: every vocabulary row and expert is here and
    every exchange returns its input, so the single-process forward communicates nothing."""

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """The [start, stop) rows of the embedding and LM head held here."""
        return 0, vocab_size

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count): the routed experts whose weights are held here."""
        return 0, num_experts

    def reduce(self, partial: Tensor) -> Tensor:
        """The sum of PARTIAL over the shards (it may be summed in place)."""
        return partial

    def embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        """Embeddings of IDS from a table holding `vocab_rows` of the vocabulary."""
        return table(ids)

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Logits (rows, vocab) from this shard's columns (rows, its vocab rows); the whole
        vocabulary comes back on the shard that drives the model, its own columns elsewhere."""
        return logits

    def softmax_vocab(self, logits: Tensor) -> Tensor:
        """Softmax over the whole vocabulary, in fp32, of this shard's columns of LOGITS."""
        return logits.softmax(dim=-1, dtype=torch.float32)


WHOLE_MODEL = ModelShard()


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32, scaled by a learned weight (as Qwen3 does)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        """Normalises over the last dimension."""
        return self.normalize(x, self.weight)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        """Normalises over the last dimension with this norm's eps, scaled by WEIGHT."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return weight * normed.to(x.dtype)


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias in x's dtype; weights stored narrower than the compute dtype are
    widened here, one matrix at a time, so the widened copy stays in cache."""
    if packing.is_packed(weight):
        return packing.linear(x, weight, bias)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def vocab_logits(x: Tensor, weight: Tensor) -> Tensor:
    """The LM head; a narrower-stored head is widened in slices of ~4 MiB, never all at once
    (few, large slices: every op is a parallel region that a busy CPU makes expensive)."""
    if weight.dtype == x.dtype:
        return project(x, weight)
    rows = max(1, (1 << 20) // weight.shape[1])
    out = x.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows] = F.linear(x, weight[start : start + rows].to(x.dtype))
    return out


def default_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype activations use: the weights' own, except bf16/fp16 on a CPU without native
    support for them (no AVX512-BF16 / AMX), where widening each weight to fp32 is several
    times faster than emulated half-precision matmuls."""
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    cpu = torch.cpu
    native: tuple[str, ...]
    if dtype == torch.bfloat16:
        native = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    elif dtype == torch.float16:
        native = ("_is_amx_fp16_supported",)
    else:
        return dtype
    if any(getattr(cpu, name, lambda: False)() for name in native):
        return dtype
    return torch.float32


def rotary_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, signed sin), each (N, T, 1, head_dim) in DTYPE, for `rotate` at POSITIONS (N, T).

    The sin table's first half is negated once here, so each rotation is a roll and two
    products: -x2 * sin equals x2 * (-sin) exactly, the result is HF's rotate_half form."""
    freqs = positions.unsqueeze(-1).float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    return (
        torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(2),
        torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(2),
    )


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Applies rotary embedding in the half-split layout HF uses (not interleaved) to x
    (N, T, heads, head_dim), with the tables of `rotary_tables`."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm; q, k and v come from one fused projection."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(
            cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias, dtype=dtype, device=device
        )
        self.wo = nn.Linear(q, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: Tensor, ctx: _Step, layer: int) -> Tensor:
        """Attends x (N, T, hidden) to the cached prefix and to itself under ctx's mask."""
        n, t, _ = x.shape
        h, kv = self.num_heads, self.num_kv_heads
        qkv = project(x, self.wqkv.weight, self.wqkv.bias).view(n, t, h + 2 * kv, self.head_dim)
        # q and k heads are normalised and rotated together (one kernel of each, not two): the
        # norm is per head, so only the weight tells them apart.
        weight = torch.cat((self.q_norm.weight.expand(h, -1), self.k_norm.weight.expand(kv, -1)))
        qk = rotate(self.q_norm.normalize(qkv[:, :, : h + kv], weight), ctx.cos, ctx.sin)
        q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
        v = qkv[:, :, h + kv :].transpose(1, 2)
        keys, values = k, v
        if ctx.cache is not None:
            if ctx.cached_len > 0:
                ck, cv = ctx.cache.read(layer, ctx.slots, ctx.cached_len)
                ck, cv = ck.to(k.dtype), cv.to(v.dtype)
                keys, values = torch.cat((ck, k), dim=2), torch.cat((cv, v), dim=2)
            # Written after the read so a call that rewrites cached positions sees the old ones.
            if ctx.write_cache:
                ctx.cache.write(layer, ctx.slots, ctx.positions, k, v)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=ctx.mask,
            is_causal=ctx.mask is None and t > 1,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return project(out.transpose(1, 2).reshape(n, t, -1), self.wo.weight, self.wo.bias)


class DenseMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one projection (gate rows first)."""

    def __init__(
        self, hidden: int, inter: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype, device=device)
        self.w_down = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """x (S, hidden) -> (S, hidden)."""
        gate, up = project(x, self.w_gate_up.weight).chunk(2, dim=-1)
        return project(F.silu(gate) * up, self.w_down.weight)


class MoE(nn.Module):
    """Softmax top-k router over stacked experts, computed grouped by expert.

    The router scores every expert; only the shard's experts (`ModelShard.experts`) are held
    and computed, so a shard's output is its experts' part of the mix."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shard: ModelShard = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.first_expert, self.local_experts = shard.experts(e)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        local = self.local_experts
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype, device=device))
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * i, h, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(local, h, i, dtype=dtype, device=device))
        # Per expert (gate_up, down) in oneDNN's layout once `pack` ran (see engine.packing).
        self.packed_experts: list[tuple[Tensor, Tensor]] | None = None

    def pack(self) -> None:
        """Moves the router and every expert into the packed layout (inference only: the
        stacked expert parameters are emptied, not copied)."""
        self.router = nn.Parameter(packing.pack(self.router), requires_grad=False)
        self.packed_experts = [
            (packing.pack(self.w_gate_up[e]), packing.pack(self.w_down[e]))
            for e in range(self.local_experts)
        ]
        dtype, device = self.w_down.dtype, self.w_down.device
        self.w_gate_up = nn.Parameter(torch.empty(0, dtype=dtype, device=device), False)
        self.w_down = nn.Parameter(torch.empty(0, dtype=dtype, device=device), False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (S, hidden) -> (output (S, hidden), tokens routed to each expert (E,) int64)."""
        s = x.shape[0]
        # Routing probabilities in fp32, so bf16 models pick the same experts as the reference.
        probs = project(x, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.view(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = flat.argsort(stable=True)
        # Token order grouped by expert: one matmul per active expert, not per token. A shard
        # takes the span of that order routed to its own experts (all of it when it holds all).
        sizes = counts.tolist()
        first, last = self.first_expert, self.first_expert + self.local_experts
        skip = sum(sizes[:first])
        rows = order[skip : skip + sum(sizes[first:last])]
        grouped = x[rows // self.top_k]
        out = torch.empty_like(grouped)
        # The loop runs once per active expert (dozens per layer in real checkpoints), so it
        # keeps per-expert work to the matmuls: the down projection writes its rows in place.
        w_gate_up, w_down, dtype = self.w_gate_up, self.w_down, x.dtype
        packed = self.packed_experts
        start = 0
        for e, c in enumerate(sizes[first:last]):
            if c == 0:
                continue
            end = start + c
            if packed is not None:
                gate, up = packing.linear(grouped[start:end], packed[e][0]).chunk(2, dim=-1)
                out[start:end] = packing.linear(F.silu(gate).mul_(up), packed[e][1])
            else:
                gate, up = torch.mm(grouped[start:end], w_gate_up[e].to(dtype).t()).chunk(2, -1)
                hidden = F.silu(gate).mul_(up)
                torch.mm(hidden, w_down[e].to(dtype).t(), out=out[start:end])
            start = end
        # Back to (token, k) order; a sum over k is deterministic, unlike a scatter-add. Choices
        # of experts held elsewhere add nothing here.
        if self.local_experts == self.num_experts:
            per_choice = torch.empty_like(out)
        else:
            per_choice = out.new_zeros(s * self.top_k, x.shape[-1])
        per_choice[rows] = out
        per_choice = per_choice.view(s, self.top_k, x.shape[-1]) * weights.to(x.dtype).unsqueeze(-1)
        return per_choice.sum(dim=1), counts


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (dense or MoE) with residuals; the shard's partial attention
    and MLP outputs are summed over the shards before each residual."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shard: ModelShard = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        self.index = index
        self.shard = shard
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype=dtype, device=device)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp: MoE | DenseMLP = (
            MoE(cfg, dtype=dtype, device=device, shard=shard)
            if cfg.is_moe_layer(index)
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)
        )

    def forward(self, x: Tensor, ctx: _Step, rows: Tensor | None = None) -> Tensor:
        """x (N, T, hidden) -> (N, T, hidden); with `rows` (flat indices), only those rows
        go through the MLP and (len(rows), hidden) comes back."""
        x = x + self.shard.reduce(self.attn(self.attn_norm(x), ctx, self.index))
        x = x.view(-1, x.shape[-1]) if rows is None else x.view(-1, x.shape[-1])[rows]
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoE):
            out, counts = self.mlp(h)
            if ctx.expert_counts is not None:
                ctx.expert_counts[self.index] += counts
        else:
            out = self.mlp(h)
        return x + self.shard.reduce(out)


@dataclass
class _Step:
    """What every layer of one forward shares: rotary tables, the mask, the cache binding."""

    cos: Tensor
    sin: Tensor  # first half negated (see rotary_tables)
    mask: Tensor | None  # additive, in the compute dtype (or a boolean one, from training)
    positions: Tensor
    cache: KVCache | None
    slots: Tensor | None
    cached_len: int
    write_cache: bool
    expert_counts: Tensor | None


def attention_mask(
    positions: Tensor, block: Tensor, cache_lens: Tensor | None, cached_len: int
) -> Tensor:
    """Boolean (N, 1, T, cached_len + T) mask: True where a query may attend to a key.

    Cached keys count while below the row's committed length; the call's own keys follow the
    block-causal rule on absolute positions (key block <= query block).
    """
    blocks = positions // block.view(-1, 1)
    own = blocks.unsqueeze(1) <= blocks.unsqueeze(2)
    if cached_len == 0 or cache_lens is None:
        return own.unsqueeze(1)
    n, t = positions.shape
    keys = torch.arange(cached_len, device=positions.device).view(1, 1, -1)
    prefix = keys < cache_lens.view(-1, 1, 1)
    return torch.cat((prefix.expand(n, t, cached_len), own), dim=2).unsqueeze(1)


class Model(nn.Module):
    """Decoder-only LM: embeddings, decoder layers, final norm, LM head (tied or not).

    SHARD: the part of the model this process holds (`ModelShard`; the whole by default)."""

    family = "sdar"  # its runner: engine.families.sdar

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        shard: ModelShard = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        self.config = config
        self.shard = shard
        self._compute_dtype = compute_dtype
        start, stop = shard.vocab_rows(config.vocab_size)
        self.embed = nn.Embedding(stop - start, config.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=dev, shard=shard)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=dev)
        self.lm_head = nn.Linear(
            config.hidden_size, stop - start, bias=False, dtype=dtype, device=dev
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        shape = (config.num_layers, max(config.num_experts, 1))
        self.register_buffer(
            "inv_freq", torch.empty(config.head_dim // 2, device=dev), persistent=False
        )
        self.register_buffer(
            "expert_counts_total",
            torch.zeros(shape, dtype=torch.int64, device=dev),
            persistent=False,
        )
        self._track_experts = False
        self.packed_scope: PackScope = "none"
        if dev.type != "meta":
            self.reset_buffers()

    def materialize(self, device: str | torch.device) -> Model:
        """Allocates (uninitialised) storage on `device` for a model built on the meta device."""
        self.to_empty(device=torch.device(device))
        if self.config.tie_word_embeddings:
            # to_empty gives each module its own storage; tie the head to the embedding again.
            self.lm_head.weight = self.embed.weight
        self.reset_buffers()
        return self

    def reset_buffers(self) -> None:
        """Recomputes the rotary frequencies and zeroes the expert counts (after `to_empty`)."""
        cfg, dev = self.config, self.inv_freq.device
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=dev) / cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta**exponents)
        if cfg.rope_type == "linear":
            inv_freq = inv_freq / cfg.rope_factor
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq)
            self.expert_counts_total.zero_()

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.embed.weight.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of activations (see `default_compute_dtype`); logits are always fp32."""
        return self._compute_dtype or default_compute_dtype(self.dtype, self.device)

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed.weight.device

    @property
    def packed(self) -> bool:
        """Whether projection weights are in oneDNN's packed layout (`pack_weights`)."""
        return self.packed_scope != "none"

    @property
    def weights_layout(self) -> str:
        """How the projection weights are held, in words: plain, packed, or packed except
        the MoE router and experts."""
        return {"none": "plain", "all": "packed", "dense": "packed_except_experts"}[
            self.packed_scope
        ]

    def pack_weights(self, scope: PackScope = "all") -> int:
        """Moves projection weights into oneDNN's packed CPU layout (engine.packing), for
        inference only: all of them, or with SCOPE "dense" all but the MoE router and experts.
        Returns the extra bytes it took: 0, or a tied LM head's own copy (the embedding lookup
        keeps the plain matrix)."""
        if self.packed or scope == "none":
            return 0
        extra = 0
        with torch.no_grad():
            for layer in self.layers:
                for linear in (layer.attn.wqkv, layer.attn.wo):
                    linear.weight = nn.Parameter(packing.pack(linear.weight), False)
                if isinstance(layer.mlp, MoE):
                    if scope == "all":
                        layer.mlp.pack()
                else:
                    for linear in (layer.mlp.w_gate_up, layer.mlp.w_down):
                        linear.weight = nn.Parameter(packing.pack(linear.weight), False)
            if self.lm_head.weight is self.embed.weight:
                extra = self.embed.weight.numel() * self.embed.weight.element_size()
            self.lm_head.weight = nn.Parameter(packing.pack(self.lm_head.weight), False)
        self.packed_scope = scope
        return extra

    def weight_bytes(self) -> int:
        """Bytes the weights take, in whatever layout they are held (a tied matrix once)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for layer in self.layers:
            for pair in getattr(layer.mlp, "packed_experts", None) or ():
                total += sum(w.numel() * w.element_size() for w in pair)
        return total

    def track_experts(self, enabled: bool = True) -> None:
        """Turns cumulative per-expert token counting on or off."""
        self._track_experts = enabled

    def expert_token_counts(self) -> Tensor:
        """(num_layers, num_experts) int64: tokens routed to each expert since tracking began.

        The last layer routes only the rows whose logits were asked for (`logits_rows`).
        """
        return self.expert_counts_total[:, : self.config.num_experts].clone().cpu()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        block_size: int | Tensor = 1,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        cache_lens: Tensor | None = None,
        write_cache: bool = False,
        logits_rows: Tensor | None = None,
    ) -> Tensor:
        """Logits (N, T, vocab) in fp32, or (len(logits_rows), vocab) for the flat rows asked for
        (a shard that does not drive the model gets its own vocabulary columns).

        A query at absolute position p attends to its row's cached keys below cache_lens[i] and to
        this call's keys at positions q with q // B <= p // B (B = 1: causal).
        """
        with torch.no_grad():
            return self._forward(
                input_ids, positions, block_size, cache, slots, cache_lens, write_cache, logits_rows
            )

    def _forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None,
        block_size: int | Tensor,
        cache: KVCache | None,
        slots: Tensor | None,
        cache_lens: Tensor | None,
        write_cache: bool,
        logits_rows: Tensor | None,
    ) -> Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (N, T), got shape {tuple(input_ids.shape)}")
        n, t = input_ids.shape
        dev = self.device
        default_positions = positions is None
        if positions is None:
            positions = torch.arange(t, device=dev).expand(n, t)
        elif positions.shape != input_ids.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match input_ids {(n, t)}")
        block = (
            block_size.to(dev)
            if isinstance(block_size, Tensor)
            else torch.tensor([block_size], device=dev)
        )
        cached_len = 0
        if cache is not None:
            cached_len = cache.check_call(n, positions, block, slots, cache_lens, write_cache)
        elif write_cache:
            raise ValueError("write_cache=True needs a cache")
        plain_causal = (
            default_positions
            and cached_len == 0
            and not isinstance(block_size, Tensor)
            and block_size == 1
        )
        dtype = self.compute_dtype
        # SDPA's is_causal path skips building a mask for the plain causal LM call. Otherwise
        # the mask is made additive here, once, not converted from booleans in every layer.
        mask = None
        if not plain_causal:
            allowed = attention_mask(positions, block, cache_lens, cached_len)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(
                ~allowed, float("-inf")
            )
        cos, sin = rotary_tables(positions, self.inv_freq, dtype)
        counts = self.expert_counts_total if self._track_experts else None
        ctx = _Step(cos, sin, mask, positions, cache, slots, cached_len, write_cache, counts)

        x = self.shard.embed(self.embed, input_ids).to(dtype)
        *body, last = self.layers
        for layer in body:
            x = layer(x, ctx).view(n, t, -1)
        # Every layer's keys and values cover all rows, but past the last attention only the
        # rows the caller samples from matter: MLP, norm and LM head run for those alone.
        x = last(x, ctx, logits_rows)
        logits = self.shard.gather_vocab(vocab_logits(self.norm(x), self.lm_head.weight).float())
        return logits if logits_rows is not None else logits.view(n, t, -1)
