"""The Llama family over the paged KV cache: Llama / SmolLM2, Qwen2 (q/k/v bias), Mistral, Qwen3
(per-head q/k RMSNorm) and Phi-3 (longrope, partial rotary; its fused qkv / gate_up checkpoint
tensors are split by the loaders into the Llama names and fused again here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.model.attention import AttentionBackend, AttentionMetadata, PagedKVStorage
from kvshare.model.config import ModelArchConfig
from kvshare.model.fused_decode import FusedDecode
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.layers import RotaryEmbedding, head_rms_norm, rms_norm
from kvshare.model.qlinear import DequantScratch, make_linear
from kvshare.model.tensor_parallel import TPCollectives


class _Layer:
    __slots__ = ("in_norm", "qkv", "qkv_b", "qk_norm", "o", "post_norm", "gate_up", "down")


def _fuse(parts: list) -> torch.Tensor | GroupAffine:
    """Row-wise concatenation of weights, kept packed when every part is packed alike."""
    if all(isinstance(p, GroupAffine) for p in parts):
        try:
            return GroupAffine.cat(parts)
        except ValueError:
            pass  # mixed formats (e.g. Q4_K q/k with a Q6_K v): fuse densely
    return torch.cat([p.dequantize() if isinstance(p, GroupAffine) else p.float() for p in parts])


class LlamaModel:
    """Plain tensors and functions rather than nn.Modules: inference only, no autograd state.

    Weights arrive as dense tensors or, kept quantized, as GroupAffine; `make_linear` puts each
    on its kernel (kvshare.model.qlinear)."""

    def __init__(self, config: ModelArchConfig, weights: dict, dtype: torch.dtype,
                 backend: AttentionBackend, max_positions: int, prefill_dtype: torch.dtype | None = None,
                 tp: TPCollectives | None = None) -> None:
        """With `tp` (tensor parallel), `config` and `weights` are this rank's shard
        (kvshare.model.tensor_parallel): its heads, its part of the MLP and of the vocabulary."""
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.backend = backend
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.scratch = DequantScratch(prefill_dtype or dtype)

        def dense(name: str) -> torch.Tensor:
            w = weights.pop(name)
            return (w.dequantize() if isinstance(w, GroupAffine) else w).to(dtype).contiguous()

        def linear(w):
            return make_linear(w, dtype, self.scratch)

        # Tied models read token embeddings from the lm_head's own storage (one copy).
        embed = weights.pop("model.embed_tokens.weight")
        if "lm_head.weight" in weights:
            self.lm_head = linear(weights.pop("lm_head.weight"))
            self.embed = linear(embed)
        else:
            self.lm_head = self.embed = linear(embed)
        self.norm = dense("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = dense(p + "input_layernorm.weight")
            layer.post_norm = dense(p + "post_attention_layernorm.weight")
            # One matmul for q, k and v, one for gate and up: fewer, larger GEMMs.
            layer.qkv = linear(_fuse([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if p + "self_attn.q_proj.bias" in weights:
                layer.qkv_b = torch.cat([dense(p + f"self_attn.{n}_proj.bias") for n in "qkv"]).contiguous()
            else:
                layer.qkv_b = None
            if c.qk_norm:
                # One [q heads + kv heads, head_dim] weight: q and k normalized in one pass.
                q_norm, k_norm = dense(p + "self_attn.q_norm.weight"), dense(p + "self_attn.k_norm.weight")
                layer.qk_norm = torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])
            else:
                layer.qk_norm = None
            layer.o = linear(weights.pop(p + "self_attn.o_proj.weight"))
            layer.gate_up = linear(_fuse([weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")]))
            layer.down = linear(weights.pop(p + "mlp.down_proj.weight"))
            self.layers.append(layer)
        self.rotary = RotaryEmbedding(config, max_positions, dtype)
        self.fused_decode = FusedDecode(self)  # with tp, it all-reduces in C++ (shared memory transport)

    def linears(self) -> list:
        """Every weight matrix once (the tied embedding is the lm_head)."""
        out = [self.lm_head] + ([self.embed] if self.embed is not self.lm_head else [])
        for layer in self.layers:
            out += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return out

    @property
    def weight_bytes(self) -> int:
        c = self.config
        small = self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            small += (layer.in_norm.numel() + layer.post_norm.numel()) * layer.in_norm.element_size()
            if layer.qkv_b is not None:
                small += layer.qkv_b.numel() * layer.qkv_b.element_size()
            if layer.qk_norm is not None:  # counted as the two head_dim vectors the file holds
                small += 2 * c.head_dim * layer.qk_norm.element_size()
        return small + sum(lin.nbytes for lin in self.linears())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVStorage) -> torch.Tensor:
        c = self.config
        n = input_ids.shape[0]
        h = self.embed.rows(input_ids) if self.tp is None else self.tp.embed(self.embed, input_ids)
        cos, sin = self.rotary.tables(positions)
        if self.fused_decode.reason(meta, n, kv_cache) is None:
            return self.fused_decode.run(h, cos, sin, meta, kv_cache)
        heads_qk = c.num_heads + c.num_kv_heads
        nd = meta.num_decode  # rows [0, nd) are decode rows, the rest prompt tokens (see qlinear)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.in_norm, c.rms_norm_eps)
            qkv = layer.qkv(x, nd)
            if layer.qkv_b is not None:
                qkv = qkv + layer.qkv_b
            # q and k sit side by side in qkv: normalize (Qwen3) and rotate both in one pass.
            qk = qkv[:, :self.q_size + self.kv_size].reshape(n, heads_qk, c.head_dim)
            if layer.qk_norm is not None:
                qk = head_rms_norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = self.rotary.rotate(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta.for_layer(i), self.scale)
            h = h + self._reduce(layer.o(attn.reshape(n, self.q_size), nd))
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(x, nd).chunk(2, dim=-1)
            h = h + self._reduce(layer.down(F.silu(gate) * up, nd))
        return h

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's output: the sum over ranks of each rank's partial product."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that sample or report logprobs come here: the vocab matmul is the
        # single most expensive op at small batch.
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(x).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)


ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "phi3")


def build_model(config: ModelArchConfig, weights, dtype, backend, max_positions, prefill_dtype=None,
                tp: TPCollectives | None = None):
    """prefill_dtype: the dtype of many-row GEMMs on kept-quantized weights (None: dtype). tp: this
    rank's collectives under tensor parallelism; `config` and `weights` are then its shard."""
    if tp is not None:
        return LlamaModel(config, weights, dtype, backend, max_positions, prefill_dtype, tp)
    if config.architecture in ("gemma2", "gemma3"):
        from kvshare.model.gemma import GemmaModel  # here: gemma imports this module's shared pieces

        return GemmaModel(config, weights, dtype, backend, max_positions, prefill_dtype)
    if config.architecture not in ARCHITECTURES:
        raise NotImplementedError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES + ('gemma2', 'gemma3'))})"
        )
    return LlamaModel(config, weights, dtype, backend, max_positions, prefill_dtype)
