"""Attention over the paged KV cache, for mixed batches of decode rows and prefill chunks.

The batch is packed: decode rows first (one query each), then prefill chunks back to back,
with no padding between prompts. K/V are read block by block through each sequence's block
table, so a sequence can only ever see blocks of its own table.

Cache layout per layer: [kv_heads, num_blocks * block_size, head_dim]. Gathering whole
blocks along dim 1 copies contiguous block_size x head_dim tiles, and the gathered tensor is
already in the [heads, tokens, dim] shape the matmuls want, so K/V are copied once per layer.
The cache may be stored in another dtype than the model's (`kv_cache_dtype`): K/V are cast or
quantized on write and cast or dequantized on read (`kv_quant`); the C++ kernel reads every
storage format itself.

`AttentionBackend` is the seam a CUDA backend will plug into; `TorchPagedAttention` is the
CPU implementation: pure PyTorch, except that decode rows go to the C++ kernel in
`kernels.paged_attention` (one pass over each row's own blocks) when it loads and is not
disabled, and so do float32 prompt chunks from position 0 (causal over their own keys, skipping
the hidden ones).
Which of the two a backend runs is decided when it is built, once (kvshare.model.numerics).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvshare.model import kv_quant
from kvshare.model.kernels import paged_attention
from kvshare.model.kv_quant import QuantizedKV


@dataclass
class DecodeGroup:
    """Decode rows padded to one width, each row's own (kvshare.engine.model_runner.padded_blocks)."""

    row_start: int
    num_rows: int
    block_tables: torch.Tensor  # [rows, blocks]
    bias: torch.Tensor  # [1, rows, 1, blocks * block_size]: 0 where the row sees the key, else -inf


@dataclass
class PrefillChunk:
    query_start: int  # row offset in the packed batch
    query_len: int
    block_table: torch.Tensor  # [blocks] covering positions 0 .. start + query_len - 1
    mask: torch.Tensor  # [query_len, blocks * block_size] bool, True = may attend
    # True when the mask is plain causal over the first query_len keys and hides the rest (a chunk
    # from position 0 with nothing windowed away): SDPA's is_causal then skips the hidden half of
    # the scores instead of reading a mask (~1.8x faster at 2,048 tokens; the same sums up to their
    # float rounding order).
    causal: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode: int = 0
    # Built only if backend.wants_decode_groups (the pure-PyTorch path), with the policy's mask.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # All decode rows at once, for kernels that walk block tables themselves:
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks], zero padded
    decode_context_lens: torch.Tensor | None = None  # [num_decode] keys per row (position + 1)
    # Bounded-KV rows see [0, sink_end) and [window_start, ctx) only; None: every earlier key.
    decode_sink_end: torch.Tensor | None = None  # [num_decode]
    decode_window_start: torch.Tensor | None = None  # [num_decode]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Models mixing sliding-window and global layers: layer i attends with layer_metadata[i]
    # (same slots and tables, its own masks). None when every layer attends alike.
    layer_metadata: list["AttentionMetadata"] | None = None

    def for_layer(self, i: int) -> "AttentionMetadata":
        return self.layer_metadata[i] if self.layer_metadata is not None else self


class PagedKVStorage:
    """K and V for every layer (or every layer slot of a block, with KV cache groups);
    slot = block_id * block_size + offset.

    `dtype` is the storage dtype (see kv_quant): int8 and float8_e4m3fn caches also hold one
    float32 scale per (layer, K/V, kv head, slot) in `scales`, and `layer` hands out QuantizedKV
    pairs for them instead of plain tensors.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, layer_slots: list[int] | None = None) -> None:
        """`num_layers` is how many layers' KV one block holds. With KV cache groups a block
        belongs to one group of that many layers, and model layer i uses slot layer_slots[i]
        (at the block ids of its group's tables); None: layer i is slot i."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layer_slots = layer_slots
        # Zeroed, not empty: padded decode reads touch unused slots, and 0 * NaN would leak.
        # Lazily zeroed: the pool is anonymous memory, so a page costs RAM (and time) only once
        # a block on it is written or read, not at start-up.
        self._maps: list[mmap.mmap] = []
        self.data = self._lazy_zeros((num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim), dtype)
        self.scales = None
        if kv_quant.is_quantized_dtype(dtype):
            self.scales = self._lazy_zeros((num_layers, 2, num_kv_heads, num_blocks * block_size),
                                           kv_quant.SCALE_DTYPE)

    def _lazy_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        buf = mmap.mmap(-1, nbytes)  # anonymous: zero-filled by the kernel on first touch
        self._maps.append(buf)  # the tensor borrows this memory: keep it alive with the cache
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedKV, QuantizedKV]:
        if self.layer_slots is not None:
            i = self.layer_slots[i]
        if self.scales is None:
            return self.data[i, 0], self.data[i, 1]
        return QuantizedKV(self.data[i, 0], self.scales[i, 0]), QuantizedKV(self.data[i, 1], self.scales[i, 1])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.data[..., dst * bs:(dst + 1) * bs, :] = self.data[..., src * bs:(src + 1) * bs, :]
            if self.scales is not None:  # a copied token without its scale would dequantize wrong
                self.scales[..., dst * bs:(dst + 1) * bs] = self.scales[..., src * bs:(src + 1) * bs]

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scale_bytes


class AttentionBackend:
    # Whether the runner must build padded `decode_groups` (else only the full decode tables).
    wants_decode_groups: bool = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        """softcap: scaled scores become softcap * tanh(scores / softcap) before masking (Gemma 2)."""
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    def __init__(self, block_size: int, use_cpp_kernel: bool = True) -> None:
        self.block_size = block_size
        # Decided here, once (loading the library, or compiling it if no cached build exists):
        # a step never asks whether a build has finished, so its rows' kernel cannot change mid-run.
        self.use_cpp_kernel = use_cpp_kernel and paged_attention.ATTENTION.settle() is None

    @property
    def wants_decode_groups(self) -> bool:
        return not self.use_cpp_kernel

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None):
        # q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, slots, D] (or QuantizedKV of those)
        if softcap is not None and self.use_cpp_kernel:
            # The C++ kernel has no capping: a model that caps builds its backend without it.
            raise ValueError("attention soft-capping needs TorchPagedAttention(use_cpp_kernel=False)")
        kv_quant.write(k_cache, meta.slot_mapping, k)
        kv_quant.write(v_cache, meta.slot_mapping, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        out = torch.empty_like(q)
        bs = self.block_size
        if meta.decode_block_tables is not None and self.use_cpp_kernel:
            if meta.num_decode:
                nd = meta.num_decode
                if isinstance(k_cache, QuantizedKV):
                    paged_attention.paged_decode_attention(
                        q[:nd], k_cache.data, v_cache.data, meta.decode_block_tables, meta.decode_context_lens,
                        bs, scale, out=out[:nd], k_scale=k_cache.scale, v_scale=v_cache.scale,
                        sink_end=meta.decode_sink_end, window_start=meta.decode_window_start)
                else:
                    paged_attention.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                           meta.decode_context_lens, bs, scale, out=out[:nd],
                                                           sink_end=meta.decode_sink_end,
                                                           window_start=meta.decode_window_start)
            decode_groups = []
        else:
            decode_groups = meta.decode_groups
        for g in decode_groups:
            # One query row per sequence: plain matmul-softmax-matmul beats SDPA here by far.
            s, n = g.row_start, g.num_rows
            keys = kv_quant.gather_blocks(k_cache, g.block_tables, bs, q.dtype)  # [KVH, n, L, D]
            vals = kv_quant.gather_blocks(v_cache, g.block_tables, bs, q.dtype)
            qd = q[s:s + n].view(n, num_kv, group, head_dim).transpose(0, 1)  # [KVH, n, G, D]
            scores = torch.matmul(qd, keys.transpose(-1, -2)).float()  # [KVH, n, G, L]
            scores.mul_(scale)
            if softcap is not None:
                scores.div_(softcap).tanh_().mul_(softcap)
            scores.add_(g.bias)
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            o = torch.matmul(probs, vals)  # [KVH, n, G, D]
            out[s:s + n] = o.transpose(0, 1).reshape(n, num_heads, head_dim)
        for c in meta.prefills:
            s, n = c.query_start, c.query_len
            qc = q[s:s + n].transpose(0, 1)  # [H, n, D]
            fresh = _as_cached(k[s:s + n], v[s:s + n], k_cache) if c.causal and softcap is None else None
            if fresh is not None:
                # The chunk sees only its own keys, just written to the cache: read them from k / v
                # (as the cache holds them) rather than gather its whole block table back.
                fk, fv = fresh
                if self.use_cpp_kernel and paged_attention.causal_prefill_fits(q, fk):
                    # kvshare's kernel skips the hidden keys, which torch's SDPA computes below 512.
                    paged_attention.causal_prefill_attention(q[s:s + n], fk, fv, scale, out=out[s:s + n])
                    continue
                o = F.scaled_dot_product_attention(
                    qc.unsqueeze(0), fk.transpose(0, 1).unsqueeze(0),
                    fv.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=group > 1,
                )
                out[s:s + n] = o[0].transpose(0, 1)
                continue
            keys = kv_quant.gather_blocks(k_cache, c.block_table, bs, q.dtype)  # [KVH, C, D]
            vals = kv_quant.gather_blocks(v_cache, c.block_table, bs, q.dtype)
            if softcap is not None:  # SDPA cannot cap scores before the mask
                out[s:s + n] = _softcapped_attention(qc, keys, vals, c.mask, scale, softcap).transpose(0, 1)
                continue
            if c.causal:
                o = F.scaled_dot_product_attention(
                    qc.unsqueeze(0), keys[:, :n].unsqueeze(0), vals[:, :n].unsqueeze(0), is_causal=True,
                    scale=scale, enable_gqa=group > 1,
                )
            else:
                o = F.scaled_dot_product_attention(
                    qc.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=c.mask,
                    scale=scale, enable_gqa=group > 1,
                )
            out[s:s + n] = o[0].transpose(0, 1)
        return out


def _as_cached(k: torch.Tensor, v: torch.Tensor, k_cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """k and v with the values a float cache now holds for them (rounded to its dtype, e.g. a
    bfloat16 cache under float32 activations: the same numbers a gather would read back, so a
    prompt's attention does not depend on how it was chunked); None for a quantized cache."""
    if isinstance(k_cache, QuantizedKV):
        return None
    if k_cache.dtype == k.dtype:
        return k, v
    return k.to(k_cache.dtype).to(k.dtype), v.to(k_cache.dtype).to(k.dtype)


def _softcapped_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                          scale: float, softcap: float) -> torch.Tensor:
    """q [H, n, D] over keys/vals [KVH, C, D] with mask [n, C] (True = may attend), scores capped
    to softcap * tanh(s / softcap) before masking, softmax in float32: [H, n, D]."""
    num_heads, n, head_dim = q.shape
    num_kv = keys.shape[0]
    qg = q.reshape(num_kv, num_heads // num_kv, n, head_dim)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys.unsqueeze(1).transpose(-1, -2)).float()  # [KVH, G, n, C]
    scores.mul_(scale).div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vals.unsqueeze(1)).reshape(num_heads, n, head_dim)
