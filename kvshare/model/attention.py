"""Attention over the paged KV cache, for mixed batches of decode rows and prefill chunks.

The batch is packed: decode rows first (one query each), then prefill chunks back to back,
with no padding between prompts. K/V are read through slot indices derived from each
sequence's block table, so a sequence can only ever see slots of its own blocks.

`AttentionBackend` is the seam a CUDA backend will plug into; `TorchPagedAttention` is the
pure-PyTorch CPU implementation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # row offset in the packed batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] slot ids, positions 0 .. start+query_len-1
    mask: torch.Tensor  # [query_len, context_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [D, L] context slots per decode row (padded)
    decode_bias: torch.Tensor | None = None  # [D, 1, 1, L] 0 or -inf
    prefills: list[PrefillChunk] = field(default_factory=list)


class KVCache:
    """K and V for every layer, as flat slot arrays: slot = block_id * block_size + offset."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Zeroed, not empty: padded decode reads touch unused slots, and 0 * NaN would leak.
        self.data = torch.zeros(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.data[:, :, dst * bs:(dst + 1) * bs] = self.data[:, :, src * bs:(src + 1) * bs]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class AttentionBackend:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        # q: [T, H, D]; k, v: [T, KVH, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            # One query row per sequence: plain matmul-softmax-matmul beats SDPA here by far.
            keys = k_cache[meta.decode_slots]  # [D, L, KVH, D]
            vals = v_cache[meta.decode_slots]
            qd = q[:nd].view(nd, num_kv, group, head_dim)
            scores = torch.matmul(qd, keys.permute(0, 2, 3, 1)) * scale  # [D, KVH, G, L]
            scores = scores.float() + meta.decode_bias
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[:nd] = torch.matmul(probs, vals.permute(0, 2, 1, 3)).reshape(nd, num_heads, head_dim)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            keys = k_cache[chunk.context_slots].transpose(0, 1)  # [KVH, C, D]
            vals = v_cache[chunk.context_slots].transpose(0, 1)
            qc = q[s:s + n].transpose(0, 1)  # [H, n, D]
            o = F.scaled_dot_product_attention(
                qc.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=chunk.mask,
                scale=scale, enable_gqa=group > 1,
            )
            out[s:s + n] = o[0].transpose(0, 1)
        return out
