"""The Gemma 2 and Gemma 3 (text) families over the ops layer.

What differs from the Llama family, as HF transformers' modeling_gemma2 / modeling_gemma3 define it:

- RMSNorm scales by (1 + weight), in float32 whatever the activation dtype; every layer has four
  of them: before and after attention, before and after the MLP (the "after" ones normalize the
  branch's output before it joins the residual stream).
- Token embeddings are multiplied by sqrt(hidden_size), rounded to the activation dtype.
- The MLP is gated GELU (tanh approximation), not SiLU.
- The attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
- Gemma 2 soft-caps attention scores and the final logits (cap * tanh(x / cap)); local
  (sliding-window) and global layers alternate.
- Gemma 3 RMS-normalizes each query and key head (q_norm, k_norm) before RoPE, has five local
  layers to one global by default, and rotates local layers with their own RoPE base (10k)
  while global layers use rope_theta (1M) and any rope_scaling.

Weights keep the HF names and HF's meaning of the norm weights (the scale is 1 + w): the GGUF
loader takes back the 1 llama.cpp's converter adds to every Gemma norm (`gguf_norm_offset`).
Config and tensor names: kvshare.model.families.gemma_config.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kvshare.model import ops as O
from kvshare.model.families import gemma_config
from kvshare.model.families.registry import Family


class _Layer:
    __slots__ = ("in_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm",
                 "qkv", "o", "gate_up", "down", "rotary")


class GemmaModel(O.Model):
    """Plain tensors and functions, as the Llama family: inference only."""

    def build(self, weights: dict) -> None:
        c, ops = self.config, self.ops
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim ** -0.5
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype (bfloat16: sqrt(640) = 25.298
        # becomes 25.25).
        self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), dtype=ops.dtype)

        def norm(name: str) -> torch.Tensor:
            return (1.0 + ops.float32(weights.pop(name))).contiguous()  # float32, as HF computes 1 + weight

        embed = weights.pop("model.embed_tokens.weight")
        if "lm_head.weight" in weights:
            self.lm_head = ops.linear(weights.pop("lm_head.weight"))
            self.embed = ops.linear(embed)
        else:
            self.lm_head = self.embed = ops.linear(embed)
        self.norm = norm("model.norm.weight")
        global_rotary = ops.rotary(c)
        local_rotary = global_rotary
        if c.local_rope_theta is not None:
            local_rotary = ops.rotary(dataclasses.replace(c, rope_theta=c.local_rope_theta, rope_scaling=None))
        self.rotaries = [global_rotary] if local_rotary is global_rotary else [global_rotary, local_rotary]
        self.layers: list[_Layer] = []
        for i, window in enumerate(c.attention_windows()):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = norm(p + "input_layernorm.weight")
            layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
            layer.pre_ffn_norm = norm(p + "pre_feedforward_layernorm.weight")
            layer.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight")
            layer.q_norm = layer.k_norm = None
            if p + "self_attn.q_norm.weight" in weights:
                layer.q_norm = norm(p + "self_attn.q_norm.weight")
                layer.k_norm = norm(p + "self_attn.k_norm.weight")
            layer.qkv = ops.linear(ops.fuse([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            layer.o = ops.linear(weights.pop(p + "self_attn.o_proj.weight"))
            layer.gate_up = ops.linear(ops.fuse([weights.pop(p + "mlp.gate_proj.weight"),
                                                 weights.pop(p + "mlp.up_proj.weight")]))
            layer.down = ops.linear(weights.pop(p + "mlp.down_proj.weight"))
            layer.rotary = self.rotaries.index(local_rotary if window is not None else global_rotary)
            self.layers.append(layer)

    def fused_layers(self) -> O.Stack | str:
        c = self.config
        if c.attn_logit_softcap is not None:
            return "attention soft-capping (Gemma 2) is not in the C++ attention kernel"
        layers = []
        for layer in self.layers:
            qk_norm = None
            if layer.q_norm is not None:  # one [head_dim] weight for every q head, one for every k head
                qk_norm = torch.cat([layer.q_norm.expand(c.num_heads, -1), layer.k_norm.expand(c.num_kv_heads, -1)])
            layers.append(O.StackLayer(layer.in_norm, layer.pre_ffn_norm, layer.qkv, layer.o, layer.gate_up,
                                       layer.down, qk_norm=qk_norm, rope_table=layer.rotary,
                                       attn_out_norm=layer.post_attn_norm, mlp_out_norm=layer.post_ffn_norm))
        return O.Stack(layers, norm_once=True, gelu_tanh=True)

    def small_weight_bytes(self) -> int:
        small = self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            for t in (layer.in_norm, layer.post_attn_norm, layer.pre_ffn_norm, layer.post_ffn_norm,
                      layer.q_norm, layer.k_norm):
                if t is not None:
                    small += t.numel() * t.element_size()
        return small

    def embed_rows(self, ops: O.Ops, ids: torch.Tensor) -> torch.Tensor:
        return ops.embed(self.embed, ids) * self.embed_scale

    def rope_tables(self, positions: torch.Tensor) -> list:
        return [rotary.tables(positions) for rotary in self.rotaries]  # once per forward, shared by layers

    def layers_forward(self, ops: O.StepOps, h: torch.Tensor, tables: list) -> torch.Tensor:
        c = self.config
        eps = c.rms_norm_eps
        n = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = O.norm_f32(h, layer.in_norm, eps)
            qkv = ops.linear(layer.qkv, x)
            q = qkv[:, :self.q_size].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:  # Gemma 3: per-head norms, before RoPE
                q = O.norm_f32(q, layer.q_norm, eps)
                k = O.norm_f32(k, layer.k_norm, eps)
            cos, sin = tables[layer.rotary]
            q, k = O.rope(q, cos, sin), O.rope(k, cos, sin)
            attn = ops.attention(i, q, k, v, self.scale, softcap=c.attn_logit_softcap)
            o = ops.linear(layer.o, attn.reshape(n, self.q_size), row_parallel=True)
            h = h + O.norm_f32(o, layer.post_attn_norm, eps)
            x = O.norm_f32(h, layer.pre_ffn_norm, eps)
            gate, up = ops.linear(layer.gate_up, x).chunk(2, dim=-1)
            mlp = ops.linear(layer.down, F.gelu(gate, approximate="tanh") * up, row_parallel=True)
            h = h + O.norm_f32(mlp, layer.post_ffn_norm, eps)
        return h

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return O.norm_f32(hidden, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else O.soft_cap(logits, cap)


# Tensor parallel is not offered: no sharded Gemma has been checked against a reference yet.
_COMMON = dict(hf_config=gemma_config.hf_config_fields, gguf_config=gemma_config.gguf_config_fields,
               gguf_layer_tensors=gemma_config.GGUF_LAYER_TENSORS, gguf_norm_offset=1.0,
               extra_weights=gemma_config.extra_weight_shapes, tensor_parallel=False)
GEMMA2 = Family("gemma2", GemmaModel, hf_model_type="gemma2", spm_tokenizer_architectures=("gemma", "gemma2"),
                hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "bos_token_id": 2,
                             "eos_token_id": 1, "num_key_value_heads": 4}, **_COMMON)
GEMMA3 = Family("gemma3", GemmaModel, hf_model_type="gemma3_text", spm_tokenizer_architectures=("gemma3",),
                hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "bos_token_id": 2,
                             "eos_token_id": 1, "num_key_value_heads": 4}, **_COMMON)
