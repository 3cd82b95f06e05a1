"""KV cache storage formats (`kv_cache_dtype`) and int8 / fp8 quantization of K and V.

Float formats (float32, bfloat16, float16) store K/V as they are, cast on write. int8 and
fp8_e4m3 store each K or V vector (one token, one kv head: head_dim values) quantized with its
own float32 scale, kept beside the cache: value ~= stored x scale, scale = max|x| / qmax.

Why one scale per (token, head) rather than per block: blocks fill a token at a time during
decode, so a per-block scale would have to grow, and every token already in the block be
re-quantized, whenever a louder token arrives. With per-token scales a slot's bytes depend on
that token's K/V alone, so a prefix-cache hit or a copy-on-write copy holds exactly what
recomputing it would. The price is 4 bytes per (layer, K/V, head, token), counted in
`KVFormat.bytes_per_token`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormat:
    name: str  # resolved: never "auto"
    storage: torch.dtype
    qmax: float | None = None  # largest stored magnitude for quantized formats; None for floats

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def element_bytes(self) -> int:
        return self.storage.itemsize

    @property
    def scale_bytes(self) -> int:
        return SCALE_DTYPE.itemsize if self.quantized else 0

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale bytes)."""
        return 2 * num_layers * num_kv_heads * (head_dim * self.element_bytes + self.scale_bytes)

    def formula(self, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
        base = f"2 x {num_layers} layers x {num_kv_heads} kv_heads x "
        if not self.quantized:
            return base + f"{head_dim} head_dim x {self.element_bytes} bytes ({self.name})"
        return (base + f"({head_dim} head_dim x {self.element_bytes} byte + {self.scale_bytes} bytes float32 "
                       f"scale) ({self.name}, one scale per token per head)")


_FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}
_QMAX = {f.storage: f.qmax for f in _FORMATS.values() if f.quantized}


def resolve_kv_format(kv_cache_dtype: str, model_dtype: str | torch.dtype,
                      field_name: str = "kv_cache_dtype") -> KVFormat:
    """The storage format for `kv_cache_dtype`; "auto" is the model's dtype."""
    check_kv_cache_dtype(kv_cache_dtype, field_name)
    if kv_cache_dtype == "auto":
        if isinstance(model_dtype, torch.dtype):
            model_dtype = str(model_dtype).removeprefix("torch.")
        if model_dtype not in _FORMATS:
            raise ValueError(f"{field_name}='auto' cannot follow dtype={model_dtype!r}: give a kv cache dtype")
        kv_cache_dtype = model_dtype
    return _FORMATS[kv_cache_dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, field_name: str = "kv_cache_dtype") -> None:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{field_name}={kv_cache_dtype!r} is invalid: allowed are "
                         f"{', '.join(repr(n) for n in KV_CACHE_DTYPES)}")


class QuantizedKV(NamedTuple):
    """One layer's K (or V) of a quantized cache."""

    data: torch.Tensor  # [kv_heads, slots, head_dim] int8 or float8_e4m3fn
    scale: torch.Tensor  # [kv_heads, slots] float32


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (stored [..., D] in `dtype`, scale [...] float32), one scale per vector."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    # An all-zero vector stores zeros under any scale; 1 keeps the division finite.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale.unsqueeze(-1)
    if dtype == torch.int8:
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write(cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [T, kv_heads, D] at slots slot_mapping [T] of one layer's K or V."""
    if isinstance(cache, QuantizedKV):
        q, scale = quantize(x, cache.data.dtype)
        # index_copy_ has no float8 kernel on CPU: copy the bytes.
        cache.data.view(torch.uint8).index_copy_(1, slot_mapping, q.transpose(0, 1).view(torch.uint8))
        cache.scale.index_copy_(1, slot_mapping, scale.transpose(0, 1))
    else:
        cache.index_copy_(1, slot_mapping, x.transpose(0, 1).to(cache.dtype))


def gather_blocks(cache: torch.Tensor | QuantizedKV, tables: torch.Tensor, block_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of one layer's K or V: tables [..., nblk] -> [kv_heads, ..., nblk * block_size, D]
    in `dtype` (dequantized when the cache is quantized)."""
    if isinstance(cache, QuantizedKV):
        kvh, slots, d = cache.data.shape
        data = cache.data.view(kvh, slots // block_size, block_size, d)[:, tables].flatten(-3, -2)
        scale = cache.scale.view(kvh, slots // block_size, block_size)[:, tables].flatten(-2, -1)
        return dequantize(data, scale, dtype)
    kvh, slots, d = cache.shape
    blocks = cache.view(kvh, slots // block_size, block_size, d)[:, tables].flatten(-3, -2)
    return blocks if blocks.dtype == dtype else blocks.to(dtype)
