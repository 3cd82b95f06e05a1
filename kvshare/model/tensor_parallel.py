"""Tensor parallelism inside the model: which slice of each weight a rank holds, and the three
collectives a sharded forward needs.

Megatron's split, over `tensor_parallel_size` ranks:
- q / k / v (and gate / up) are column parallel: a rank holds the output rows of its heads (of
  its part of the MLP), so attention runs on its own heads over its own KV cache, no exchange.
- o and down are row parallel: a rank holds the matching input columns; each rank's product is a
  partial sum, and one all-reduce per layer half gives every rank the full result.
- The embedding and the lm_head are split by vocabulary rows: a token's embedding comes from the
  one rank holding its row (all-reduce over zeros elsewhere, exact), and rank 0 gathers the
  logit columns.
How the ranks exchange data is kvshare.model.tp_transport's concern.

Heads are split by KV head, each rank taking the query heads that read its KV heads. The split
may be uneven (the bundled SmolLM2 has 3 KV heads: 2 on rank 0, 1 on rank 1); vLLM requires the
head counts to divide evenly, kvshare only that every rank gets at least one KV head.
Weights kept quantized (GroupAffine) stay packed: rows split freely, and columns split at group
boundaries (head_dim and the MLP split are multiples of 32).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvshare.model.config import ModelArchConfig
from kvshare.model.gguf_quants import GroupAffine

# The MLP is split in whole units of this many columns so down_proj's column slices fall on the
# quantization groups (16 or 32 weights) of every kept-quantized format.
_MLP_UNIT = 32


def even_split(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part when n items split as evenly as possible, the first ranks
    taking one more when n does not divide."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`, for a model of `config`: the head, MLP and vocabulary ranges it holds."""

    rank: int
    size: int
    config: ModelArchConfig

    def __post_init__(self) -> None:
        check_shardable(self.config, self.size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        return even_split(self.config.num_kv_heads, self.size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        per_kv = self.config.num_heads // self.config.num_kv_heads
        lo, hi = self.kv_heads
        return lo * per_kv, hi * per_kv

    @property
    def mlp(self) -> tuple[int, int]:
        inter = self.config.intermediate_size
        unit = _MLP_UNIT if inter % _MLP_UNIT == 0 else 1
        lo, hi = even_split(inter // unit, self.size, self.rank)
        return lo * unit, hi * unit

    @property
    def vocab(self) -> tuple[int, int]:
        return even_split(self.config.vocab_size, self.size, self.rank)

    @property
    def vocab_padded(self) -> int:
        """Every rank's logit slice is padded to this width for the gather (equal sizes)."""
        return -(-self.config.vocab_size // self.size)

    def local_config(self) -> ModelArchConfig:
        """The architecture this rank's layers compute: its heads and its part of the MLP."""
        (q0, q1), (k0, k1), (m0, m1) = self.q_heads, self.kv_heads, self.mlp
        return dataclasses.replace(self.config, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=m1 - m0)


def check_shardable(config: ModelArchConfig, size: int) -> None:
    """A clear error when `config`'s heads cannot be split over `size` ranks (whether its family
    supports tensor parallel at all is the registry's to say: kvshare.model.families)."""
    if config.num_kv_heads < size:
        raise ValueError(f"tensor_parallel_size={size} is invalid for this model: it has {config.num_kv_heads} KV "
                         f"head(s), and each rank needs at least one (use tensor_parallel_size <= "
                         f"{config.num_kv_heads})")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"tensor parallel needs num_heads ({config.num_heads}) to be a multiple of num_kv_heads "
                         f"({config.num_kv_heads})")


def _rows(w, lo: int, hi: int):
    if isinstance(w, GroupAffine):
        return w.row_slice(lo, hi)
    return w[lo:hi].contiguous()


def _cols(w, lo: int, hi: int):
    if isinstance(w, GroupAffine):
        if lo % w.group or hi % w.group:  # not on a group boundary: this weight goes dense
            w = w.dequantize()
        else:
            return w.col_slice(lo, hi)
    return w[:, lo:hi].contiguous()


def shard_weights(weights: dict, shard: TPShard) -> dict:
    """This rank's slices of a checkpoint under the HF Llama names every family uses, in place of the
    full tensors; what no rule names (norms) every rank holds whole."""
    c = shard.config
    d = c.head_dim
    (q0, q1), (k0, k1), (m0, m1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.mlp, shard.vocab
    out = {}
    for name, w in weights.items():
        part = name.rsplit(".", 2)
        kind = part[-2] if len(part) == 3 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = _rows(w, v0, v1)
        elif kind == "q_proj":
            w = _rows(w, q0 * d, q1 * d)
        elif kind in ("k_proj", "v_proj"):
            w = _rows(w, k0 * d, k1 * d)
        elif kind == "o_proj" and name.endswith("weight"):
            w = _cols(w, q0 * d, q1 * d)
        elif kind in ("gate_proj", "up_proj"):
            w = _rows(w, m0, m1)
        elif kind == "down_proj":
            w = _cols(w, m0, m1)
        out[name] = w
    return out


class TPCollectives:
    """The collectives of one rank's sharded forward, over a transport (kvshare.model.tp_transport:
    shared memory, or gloo). Every rank calls them in the same order: the ranks run the same step
    plan through the same code."""

    def __init__(self, transport, shard: TPShard) -> None:
        self.transport = transport
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (row-parallel outputs are partial sums)."""
        return self.transport.all_reduce_(x.contiguous())

    def embed(self, embedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocabulary-split embedding: each rank fills the rows it holds, zeros elsewhere."""
        v0, v1 = self.shard.vocab
        local = ids - v0
        held = (local >= 0) & (local < v1 - v0)
        rows = embedding.rows(local.clamp(0, v1 - v0 - 1))
        rows = rows * held.unsqueeze(1).to(rows.dtype)
        return self.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rank 0: the full [rows, vocab] logits; other ranks: an empty [rows, 0] tensor (they
        sample nothing, and the runner's slicing stays the same)."""
        rows, width = logits.shape
        pad = self.shard.vocab_padded
        if width < pad:  # every rank sends the same shape
            logits = torch.cat([logits, logits.new_full((rows, pad - width), float("-inf"))], dim=1)
        parts = self.transport.gather0(logits.contiguous())
        if parts is None:
            return logits.new_empty(rows, 0)
        widths = [hi - lo for lo, hi in (even_split(self.shard.config.vocab_size, self.size, r) for r in range(self.size))]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)
