"""The Llama family: Llama / SmolLM2 and Mistral, and the layer Qwen2 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm) and Phi-3 (kvshare.model.families.qwen, .phi3) share with them: pre-norm attention
with q, k and v in one matmul, a pre-norm SiLU-gated MLP.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvshare.model import ops as O
from kvshare.model.config import windows_every_layer
from kvshare.model.families.registry import Family
from kvshare.model.load_error import ModelLoadError


class _Layer:
    __slots__ = ("in_norm", "qkv", "qkv_b", "qk_norm", "o", "post_norm", "gate_up", "down")


class LlamaModel(O.Model):
    """Plain tensors and functions rather than nn.Modules: inference only, no autograd state.
    With tensor parallelism `config` and the weights are this rank's shard (its heads, its part of
    the MLP and of the vocabulary); q/k/v and gate/up are column parallel, o and down row parallel."""

    lora_sites = True  # layers_forward names each linear's site: LoRA adapters apply

    def build(self, weights: dict) -> None:
        c, ops = self.config, self.ops
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        # Tied models read token embeddings from the lm_head's own storage (one copy).
        embed = weights.pop("model.embed_tokens.weight")
        if "lm_head.weight" in weights:
            self.lm_head = ops.linear(weights.pop("lm_head.weight"))
            self.embed = ops.linear(embed)
        else:
            self.lm_head = self.embed = ops.linear(embed)
        self.norm = ops.dense(weights.pop("model.norm.weight"))
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = ops.dense(weights.pop(p + "input_layernorm.weight"))
            layer.post_norm = ops.dense(weights.pop(p + "post_attention_layernorm.weight"))
            layer.qkv = ops.linear(ops.fuse([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            layer.qkv_b = None
            if p + "self_attn.q_proj.bias" in weights:
                layer.qkv_b = torch.cat([ops.dense(weights.pop(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
            layer.qk_norm = None
            if c.qk_norm:
                # One [q heads + kv heads, head_dim] weight: q and k normalized in one pass.
                q_norm = ops.dense(weights.pop(p + "self_attn.q_norm.weight"))
                k_norm = ops.dense(weights.pop(p + "self_attn.k_norm.weight"))
                layer.qk_norm = torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])
            layer.o = ops.linear(weights.pop(p + "self_attn.o_proj.weight"))
            layer.gate_up = ops.linear(ops.fuse([weights.pop(p + "mlp.gate_proj.weight"),
                                                 weights.pop(p + "mlp.up_proj.weight")]))
            layer.down = ops.linear(weights.pop(p + "mlp.down_proj.weight"))
            self.layers.append(layer)
        self.rotary = ops.rotary(c)

    def fused_layers(self) -> O.Stack:
        return O.Stack([O.StackLayer(layer.in_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down,
                                     qkv_b=layer.qkv_b, qk_norm=layer.qk_norm) for layer in self.layers])

    def small_weight_bytes(self) -> int:
        small = self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            small += (layer.in_norm.numel() + layer.post_norm.numel()) * layer.in_norm.element_size()
            if layer.qkv_b is not None:
                small += layer.qkv_b.numel() * layer.qkv_b.element_size()
            if layer.qk_norm is not None:  # counted as the two head_dim vectors the file holds
                small += 2 * self.config.head_dim * layer.qk_norm.element_size()
        return small

    def rope_tables(self, positions: torch.Tensor) -> list:
        return [self.rotary.tables(positions)]

    def layers_forward(self, ops: O.StepOps, h: torch.Tensor, tables: list) -> torch.Tensor:
        c = self.config
        n = h.shape[0]
        cos, sin = tables[0]
        heads_qk = c.num_heads + c.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = O.norm(h, layer.in_norm, c.rms_norm_eps)
            qkv = ops.linear(layer.qkv, x, site=(i, "qkv"))
            if layer.qkv_b is not None:
                qkv = qkv + layer.qkv_b
            # q and k sit side by side in qkv: normalize (Qwen3) and rotate both in one pass.
            qk = qkv[:, :self.q_size + self.kv_size].reshape(n, heads_qk, c.head_dim)
            if layer.qk_norm is not None:
                qk = O.head_norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = O.rope(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
            attn = ops.attention(i, q, k, v, self.scale)
            h = h + ops.linear(layer.o, attn.reshape(n, self.q_size), row_parallel=True, site=(i, "o"))
            x = O.norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = ops.linear(layer.gate_up, x, site=(i, "gate_up")).chunk(2, dim=-1)
            h = h + ops.linear(layer.down, F.silu(gate) * up, row_parallel=True, site=(i, "down"))
        return h

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return O.norm(hidden, self.norm, self.config.rms_norm_eps)


def _llama_hf(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: Llama with mlp_bias=true is not supported.")
    return {}


def _mistral_hf(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    return windows_every_layer(cfg, MISTRAL.hf_defaults)


LLAMA = Family("llama", LlamaModel, hf_model_type="llama", hf_config=_llama_hf, gguf_permuted_qk=True,
               hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "bos_token_id": 1,
                            "eos_token_id": 2})
MISTRAL = Family("mistral", LlamaModel, hf_model_type="mistral", hf_config=_mistral_hf, gguf_permuted_qk=True,
                 hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "bos_token_id": 1,
                              "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096})
