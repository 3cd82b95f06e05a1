"""Building blocks shared by model families: RMSNorm and rotary embeddings."""
from __future__ import annotations

import math

import torch

from kvshare.model.config import ModelArchConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op, the same arithmetic as below (x * rsqrt(mean(x^2) + eps) * weight).
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalize in float32 whatever the activation dtype, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelArchConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotated dims (config.rope_dims() of each head).

    longrope (Phi-3) divides each frequency by its own factor: `short_factor` for positions
    below original_max_position_embeddings, `long_factor` (long=True) from there on."""
    dim = config.rope_dims()
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        # HF's arithmetic order (factor times base**exponent, then the reciprocal), so float32
        # tables agree to the last bit.
        return 1.0 / (factors * config.rope_theta ** exponents)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind not in ("default", None):
        raise NotImplementedError(
            f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)")
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions (rotate-half layout)."""

    def __init__(self, config: ModelArchConfig, max_positions: int, dtype: torch.dtype) -> None:
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(config))
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            # HF picks the factors per forward pass by its largest position: long ones once the
            # sequence is longer than original_max_position_embeddings. Keys already cached
            # keep the rotation they were written with, so in HF's prefill-then-decode a token
            # at position p is rotated with the long factors iff p >= original (as here) --
            # except a prompt longer than `original`, which HF rotates with the long factors
            # throughout. kvshare decides per position instead (a cached block's keys then
            # depend on its tokens and positions alone, so prefix caching, chunked prefill and
            # preemption stay exact); tests/test_families.py checks both cases against HF.
            switch = min(int(scaling["original_max_position_embeddings"]), max_positions)
            freqs[switch:] = torch.outer(pos[switch:], rope_inv_freq(config, long=True))
        emb = torch.cat((freqs, freqs), dim=-1)
        # longrope's attention factor scales cos and sin (so q.k by its square), as HF does.
        mscale = float(scaling.get("attention_factor", 1.0)) if scaling.get("rope_type") == "longrope" else 1.0
        self.cos = (emb.cos() * mscale).to(dtype)
        self.sin = (emb.sin() * mscale).to(dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for these positions, [T, 1, D], the sin with rotate_half's sign folded in
        (negative on the first half): gathered once per forward, shared by every layer."""
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1).clone()
        sin[..., :half].neg_()
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated: x * cos + rotate_half(x) * sin, in four ops (the half swap
        is one flip of a [.., 2, D/2] view). With a partial rotary embedding (tables narrower
        than D) only the first dims of each head turn; the rest pass through."""
        t, heads, dim = x.shape
        rot = cos.shape[-1]
        if rot != dim:
            turned = RotaryEmbedding.rotate(x[..., :rot].contiguous(), cos, signed_sin)
            return torch.cat((turned, x[..., rot:]), dim=-1)
        swapped = x.reshape(t, heads, 2, dim // 2).flip(2).reshape(t, heads, dim)
        return torch.addcmul(x * cos, swapped, signed_sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, heads, D] with a weight per head [heads, D] (Qwen3's
    q_norm / k_norm, q's and k's heads normalized in one pass); float32 arithmetic as in rms_norm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
