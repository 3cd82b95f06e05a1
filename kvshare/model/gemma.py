"""The Gemma 2 and Gemma 3 (text) families over the paged KV cache.

What differs from the Llama family (kvshare.model.llama), as HF transformers' modeling_gemma2 /
modeling_gemma3 define it:

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
loader takes back the 1 llama.cpp's converter adds to every Gemma norm. The shared projections
(q/k/v, o, gate/up, down) are fused and put on their kernels exactly as for Llama.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvshare.model.attention import AttentionBackend, AttentionMetadata, PagedKVStorage, TorchPagedAttention
from kvshare.model.config import ModelArchConfig
from kvshare.model.fused_decode import FusedDecode
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.layers import RotaryEmbedding
from kvshare.model.llama import _fuse
from kvshare.model.load_error import ModelLoadError
from kvshare.model.qlinear import DequantScratch, make_linear

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# HF model_type -> kvshare architecture (the GGUF name, so both loaders agree).
HF_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
# Every other layer local (Gemma 2), five local to one global (Gemma 3): the architectures'
# defaults in transformers and llama.cpp alike.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
_GELU_TANH = ("gelu_pytorch_tanh",)
_SLIDING, _FULL = "sliding_attention", "full_attention"

# llama.cpp names for Gemma's per-layer norms. Note ffn_norm: for Llama the norm before the MLP
# is HF's post_attention_layernorm; for Gemma that name is the norm *after* attention.
GGUF_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale computed in float32, cast back to x's dtype; `scale` is
    float32 1 + weight (Gemma's RMSNorm). HF casts only at the end, unlike Llama's norm."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def extra_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a Gemma checkpoint has on top of the Llama ones (loader.expected_weight_shapes)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "pre_feedforward_layernorm.weight"] = (config.hidden_size,)
        shapes[p + "post_feedforward_layernorm.weight"] = (config.hidden_size,)
        if config.architecture == "gemma3":
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def _windows(layer_is_local: list[bool], window: int | None) -> dict[str, Any]:
    """sliding_window / layer_windows for ModelArchConfig from each layer's kind."""
    if not window or not any(layer_is_local):
        return {"sliding_window": None, "layer_windows": None}
    if all(layer_is_local):
        return {"sliding_window": int(window), "layer_windows": None}
    return {"sliding_window": int(window), "layer_windows": [int(window) if x else None for x in layer_is_local]}


def _linear_rope(params: dict[str, Any], where: str) -> dict[str, Any] | None:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(params["factor"])}
    raise ModelLoadError(f"{where}: rope type {kind!r} is not supported for Gemma (supported: default, linear).")


def _gemma3_rope(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Global and local RoPE of a Gemma 3 config.json, either layout: transformers >= 5 keeps
    one rope_parameters dict per layer type; older configs have rope_theta (+ rope_scaling) for
    the global layers and rope_local_base_freq for the local ones."""
    params = cfg.get("rope_parameters") or {}
    if _FULL in params or _SLIDING in params:
        glob, local = params.get(_FULL) or {}, params.get(_SLIDING) or {}
    else:
        glob = {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    if _linear_rope(local, where) is not None:
        raise ModelLoadError(f"{where}: RoPE scaling on Gemma 3's sliding-window layers is not supported.")
    return {"rope_theta": float(glob.get("rope_theta", 1e6)), "rope_scaling": _linear_rope(glob, where),
            "local_rope_theta": float(local.get("rope_theta", 1e4))}


def hf_config_fields(cfg: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """What a Gemma config.json sets beyond the Llama fields, with transformers' defaults for
    what it leaves out (Gemma2Config / Gemma3TextConfig)."""
    model_type = cfg["model_type"]
    arch = HF_MODEL_TYPES[model_type]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ModelLoadError(f"{where}: Gemma hidden_activation {act!r} is not supported (supported: {_GELU_TANH}).")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{where}: Gemma with attention_bias=true is not supported.")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: bidirectional (embedding-model) Gemma attention is not supported.")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(cfg.get("sliding_window_pattern", _DEFAULT_PATTERN[arch]))
        layer_types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown or len(layer_types) != num_layers:
        raise ModelLoadError(f"{where}: layer_types must list {_SLIDING!r} or {_FULL!r} for each of the "
                             f"{num_layers} layers; got {len(layer_types)} entries (unknown kinds: {unknown}).")
    fields: dict[str, Any] = {
        "architecture": arch,
        "head_dim": int(cfg.get("head_dim") or 256),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "attn_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        **_windows([t == _SLIDING for t in layer_types], cfg.get("sliding_window", 4096)),
    }
    if arch == "gemma2":
        # Gemma2Config caps by default; an explicit null turns capping off.
        fields["attn_logit_softcap"] = _cap(cfg.get("attn_logit_softcapping", 50.0))
        fields["final_logit_softcap"] = _cap(cfg.get("final_logit_softcapping", 30.0))
    else:
        # Gemma3Attention never passes attn_logit_softcapping to attention: it has no effect.
        fields["final_logit_softcap"] = _cap(cfg.get("final_logit_softcapping"))
        fields.update(_gemma3_rope(cfg, where))
    return fields


def _cap(value) -> float | None:
    return float(value) if value else None


def gguf_config_fields(key: Callable[..., Any], arch: str, num_layers: int, hidden: int, num_heads: int,
                       head_dim: int, rope_theta: float) -> dict[str, Any]:
    """What a gemma2 / gemma3 GGUF sets beyond the Llama fields, read as llama.cpp reads it
    (src/models/gemma2.cpp, gemma3.cpp). `key(name, default)` reads "{arch}.{name}"."""
    default_pattern = _DEFAULT_PATTERN[arch]
    if arch == "gemma2":
        window = key("attention.sliding_window", 4096)
    else:
        window = key("attention.sliding_window", None)  # absent or 0: every layer global
    pattern = key("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                                 f"{num_layers} layers.")
        local = [bool(x) for x in pattern]
    else:  # every n-th layer global, counting from 1; 0 means all local (llama.cpp's set_swa_pattern)
        n = int(pattern)
        local = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    # The file does not store query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B
    # models (46 layers for Gemma 2, 62 for Gemma 3) and head_dim for every other size.
    is_27b = num_layers == (46 if arch == "gemma2" else 62)
    fields: dict[str, Any] = {
        "attn_scale": (hidden // num_heads if is_27b else head_dim) ** -0.5,
        **_windows(local, window),
    }
    swa_base = key("rope.freq_base_swa", None)
    if arch == "gemma2":
        fields["attn_logit_softcap"] = _cap(key("attn_logit_softcapping", 50.0))
        fields["final_logit_softcap"] = _cap(key("final_logit_softcapping", 30.0))
        if swa_base is not None and float(swa_base) != rope_theta:
            fields["local_rope_theta"] = float(swa_base)
    else:
        fields["final_logit_softcap"] = _cap(key("final_logit_softcapping", None))
        # Only the global base is in the file; local layers use the architecture's 10k, unscaled.
        fields["local_rope_theta"] = float(swa_base) if swa_base is not None else 10000.0
    return fields


class _Layer:
    __slots__ = ("in_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm",
                 "qkv", "o", "gate_up", "down", "rotary")


class GemmaModel:
    """Plain tensors and functions, as LlamaModel: inference only."""

    def __init__(self, config: ModelArchConfig, weights: dict, dtype: torch.dtype,
                 backend: AttentionBackend, max_positions: int, prefill_dtype: torch.dtype | None = None) -> None:
        c = config
        if c.attn_logit_softcap is not None and isinstance(backend, TorchPagedAttention):
            # The C++ decode kernel cannot cap scores: every step takes the PyTorch attention.
            backend = TorchPagedAttention(backend.block_size, use_cpp_kernel=False)
        self.config = config
        self.dtype = dtype
        self.backend = backend
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim ** -0.5
        self.scratch = DequantScratch(prefill_dtype or dtype)
        # HF multiplies by the scale rounded to the weights' dtype (bfloat16: sqrt(640) = 25.298
        # becomes 25.25).
        self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            w = weights.pop(name)
            w = w.dequantize() if isinstance(w, GroupAffine) else w
            return (1.0 + w.float()).contiguous()  # float32, as HF computes 1 + weight

        def linear(w):
            return make_linear(w, dtype, self.scratch)

        embed = weights.pop("model.embed_tokens.weight")
        if "lm_head.weight" in weights:
            self.lm_head = linear(weights.pop("lm_head.weight"))
            self.embed = linear(embed)
        else:
            self.lm_head = self.embed = linear(embed)
        self.norm = norm("model.norm.weight")
        global_rotary = RotaryEmbedding(c, max_positions, dtype)
        local_rotary = global_rotary
        if c.local_rope_theta is not None:
            local_rotary = RotaryEmbedding(dataclasses.replace(c, rope_theta=c.local_rope_theta, rope_scaling=None),
                                           max_positions, dtype)
        self.rotaries = [global_rotary] if local_rotary is global_rotary else [global_rotary, local_rotary]
        self.layers: list[_Layer] = []
        for i, window in enumerate(c.attention_windows()):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = norm(p + "input_layernorm.weight")
            layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
            layer.pre_ffn_norm = norm(p + "pre_feedforward_layernorm.weight")
            layer.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight")
            if p + "self_attn.q_norm.weight" in weights:
                layer.q_norm = norm(p + "self_attn.q_norm.weight")
                layer.k_norm = norm(p + "self_attn.k_norm.weight")
            else:
                layer.q_norm = layer.k_norm = None
            layer.qkv = linear(_fuse([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            layer.o = linear(weights.pop(p + "self_attn.o_proj.weight"))
            layer.gate_up = linear(_fuse([weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")]))
            layer.down = linear(weights.pop(p + "mlp.down_proj.weight"))
            layer.rotary = self.rotaries.index(local_rotary if window is not None else global_rotary)
            self.layers.append(layer)
        self.fused_decode = FusedDecode(self, unsupported=(
            f"{c.architecture} layers (four (1 + w) norms, GELU MLP, q/k norms or soft-capping) are not in the "
            f"C++ decode step"))

    def linears(self) -> list:
        """Every weight matrix once (the tied embedding is the lm_head)."""
        out = [self.lm_head] + ([self.embed] if self.embed is not self.lm_head else [])
        for layer in self.layers:
            out += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return out

    @property
    def weight_bytes(self) -> int:
        small = self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            for t in (layer.in_norm, layer.post_attn_norm, layer.pre_ffn_norm, layer.post_ffn_norm,
                      layer.q_norm, layer.k_norm):
                if t is not None:
                    small += t.numel() * t.element_size()
        return small + sum(lin.nbytes for lin in self.linears())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVStorage) -> torch.Tensor:
        c = self.config
        eps = c.rms_norm_eps
        n = input_ids.shape[0]
        h = self.embed.rows(input_ids) * self.embed_scale
        tables = [rotary.tables(positions) for rotary in self.rotaries]  # once per forward, shared by layers
        nd = meta.num_decode  # rows [0, nd) are decode rows, the rest prompt tokens (see qlinear)
        for i, layer in enumerate(self.layers):
            x = gemma_rms_norm(h, layer.in_norm, eps)
            qkv = layer.qkv(x, nd)
            q = qkv[:, :self.q_size].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:  # Gemma 3: per-head norms, before RoPE
                q = gemma_rms_norm(q, layer.q_norm, eps)
                k = gemma_rms_norm(k, layer.k_norm, eps)
            cos, sin = tables[layer.rotary]
            q = RotaryEmbedding.rotate(q, cos, sin)
            k = RotaryEmbedding.rotate(k, cos, sin)
            k_cache, v_cache = kv_cache.layer(i)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta.for_layer(i), self.scale,
                                        softcap=c.attn_logit_softcap)
            h = h + gemma_rms_norm(layer.o(attn.reshape(n, self.q_size), nd), layer.post_attn_norm, eps)
            x = gemma_rms_norm(h, layer.pre_ffn_norm, eps)
            gate, up = layer.gate_up(x, nd).chunk(2, dim=-1)
            mlp = layer.down(F.gelu(gate, approximate="tanh") * up, nd)
            h = h + gemma_rms_norm(mlp, layer.post_ffn_norm, eps)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = gemma_rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(x).float()
        if self.config.final_logit_softcap is not None:
            logits = soft_cap(logits, self.config.final_logit_softcap)
        return logits
