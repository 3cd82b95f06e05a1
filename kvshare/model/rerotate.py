"""Re-rotating cached keys in place: RoPE is applied before K is written, so moving a key from
cache position p to p + shift is one more rotation, R(p + shift) = R(shift) R(p).

Attention sinks use it when tokens leave the cache (shift < 0): the kept keys slide back so the
cache positions stay contiguous and bounded. V carries no position and is left alone.
"""
from __future__ import annotations

import torch

from kvshare.model.attention import PagedKVStorage
from kvshare.model.layers import rotate_half


def rerotate_keys(kv_cache: PagedKVStorage, block_ids: list[int], shift: int, inv_freq: torch.Tensor) -> None:
    """Rotate every layer's keys in these blocks by `shift` positions (rotate-half layout)."""
    if not block_ids or shift == 0:
        return
    if kv_cache.scales is not None:
        raise NotImplementedError("re-rotating quantized keys would requantize them at every eviction")
    bs = kv_cache.block_size
    slots = (torch.tensor(block_ids, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)).flatten()
    keys = kv_cache.data[:, 0]  # [layers, kv_heads, slots, head_dim], a view into the cache
    x = keys.index_select(2, slots).float()
    # The angle in float64: it is exact for any shift, and composes with the float32 tables.
    angle = shift * inv_freq.double()
    cos = torch.cat((angle.cos(), angle.cos())).float()
    sin = torch.cat((angle.sin(), angle.sin())).float()
    rot = cos.shape[0]  # a partial rotary embedding turns only the first dims of each head
    rotated = torch.cat((x[..., :rot] * cos + rotate_half(x[..., :rot]) * sin, x[..., rot:]), dim=-1)
    keys.index_copy_(2, slots, rotated.to(keys.dtype))
