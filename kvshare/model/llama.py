"""The Llama family (Llama / SmolLM2, Qwen2 with q/k/v bias, Mistral) over the paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.model.attention import AttentionBackend, AttentionMetadata, KVCache
from kvshare.model.config import ModelArchConfig
from kvshare.model.layers import RotaryEmbedding, rms_norm


class _Layer:
    __slots__ = ("in_norm", "qkv_w", "qkv_b", "o_w", "post_norm", "gate_up_w", "down_w")


class LlamaModel:
    """Plain tensors and functions rather than nn.Modules: inference only, no autograd state."""

    def __init__(self, config: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 backend: AttentionBackend, max_positions: int) -> None:
        self.config = config
        self.dtype = dtype
        self.backend = backend
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5

        def w(name: str) -> torch.Tensor:
            return weights[name].to(dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = w(p + "input_layernorm.weight")
            layer.post_norm = w(p + "post_attention_layernorm.weight")
            # One matmul for q, k and v, one for gate and up: fewer, larger GEMMs.
            layer.qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
            if p + "self_attn.q_proj.bias" in weights:
                layer.qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]).contiguous()
            else:
                layer.qkv_b = None
            layer.o_w = w(p + "self_attn.o_proj.weight")
            layer.gate_up_w = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous()
            layer.down_w = w(p + "mlp.down_proj.weight")
            self.layers.append(layer)
        self.rotary = RotaryEmbedding(config, max_positions, dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        c = self.config
        n = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.in_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, c.num_heads, c.head_dim)
            k = k.view(n, c.num_kv_heads, c.head_dim)
            v = v.view(n, c.num_kv_heads, c.head_dim)
            q, k = self.rotary.apply(q, k, positions)
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta.for_layer(i), self.scale)
            h = h + F.linear(attn.reshape(n, self.q_size), layer.o_w)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up_w).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down_w)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that sample or report logprobs come here: the vocab matmul is the
        # single most expensive op at small batch.
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()


def build_model(config: ModelArchConfig, weights, dtype, backend, max_positions):
    if config.architecture not in ("llama", "qwen2", "mistral"):
        raise NotImplementedError(
            f"architecture {config.architecture!r} is not supported (supported: llama, qwen2, mistral)"
        )
    return LlamaModel(config, weights, dtype, backend, max_positions)
