"""GGUF (llama.cpp) files -> ModelArchConfig + dequantized weights under HF Llama names."""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvshare.model.config import ModelArchConfig
from kvshare.model.families import REGISTRY
from kvshare.model.gguf_header import GGUFHeader, open_gguf_file
from kvshare.model.gguf_quants import GROUP_AFFINE_TYPES, GGUFBlocks, GroupAffine
from kvshare.model.hf_loader import split_fused_weights
from kvshare.model.load_error import ModelLoadError
from kvshare.model.tokenizer import Tokenizer

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS}
)

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3; split by split_fused_weights
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Not weights: rope_freqs holds llama3 RoPE factors and rope_factors_long/short Phi-3's longrope
# factors (both turned back into config.rope_scaling), and rot_embd is a precomputed table some
# old converters wrote.
_IGNORED_TENSORS = re.compile(
    r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str, architecture: str | None = None) -> str | None:
    """HF name for a GGUF tensor name (the family's own names first, then the common Llama
    ones); None for tensors that are not weights."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    family = REGISTRY.get(architecture) if architecture is not None else None
    if m and family is not None and m.group(2) in family.gguf_layer_tensors:
        return f"model.layers.{m.group(1)}.{family.gguf_layer_tensors[m.group(2)]}"
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    if _IGNORED_TENSORS.match(gguf_name):
        return None
    raise KeyError(gguf_name)


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """float32 torch tensor in row-major HF orientation (GGUF lists dims innermost first)."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ModelLoadError(
            f"tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which kvshare cannot dequantize "
            f"(supported: {supported})."
        )
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    data = tensor.data
    if tensor.tensor_type not in (Q.F32, Q.F16, Q.BF16) and data.dtype == np.uint8 and data.ndim == 1:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = data.reshape(rows, -1)  # gguf.quants dequantizes row by row
    arr = dequantize(data, tensor.tensor_type)
    # F32 comes back as a view of the read-only memory map; everything else is already a fresh array.
    arr = np.array(arr, dtype=np.float32) if tensor.tensor_type == Q.F32 else np.asarray(arr, dtype=np.float32)
    arr = arr.reshape(shape)
    return torch.from_numpy(arr)


def read_tensors(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file under its GGUF name, dequantized, no renaming or permutation."""
    return {t.name: dequantize_tensor(t).to(dtype) for t in open_gguf_file(path).tensors}


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row interleave for llama-family files.

    llama.cpp rotates adjacent pairs (GPT-J style) while HF rotates the two halves of each head, so
    the converter reorders each head's rows from [first half, second half] to interleaved pairs.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a tensor of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _llama3_factors(theta: float, head_dim: int, p: dict[str, Any]) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    old = p["original_max_position_embeddings"]
    lo, hi, factor = p["low_freq_factor"], p["high_freq_factor"], p["factor"]
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def _llama3_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int, path: str) -> dict[str, Any] | None:
    """Recover llama3 rope_scaling parameters from the per-frequency factors llama.cpp stores.

    The converter bakes {factor, low/high_freq_factor, original_max_position_embeddings} into a
    ``rope_freqs`` tensor. ``factor`` is its maximum; between the two cut-offs the "smooth" ramp is
    linear in 1/wavelength, and a line fit through it gives the rest, assuming low_freq_factor=1
    (true of every Llama 3.x release). The result is checked by recomputing the tensor.
    """
    factors = factors.astype(np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ModelLoadError(f"{path}: rope_freqs has {factors.shape[0]} entries, expected {head_dim // 2}.")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    candidates = []
    inv_wavelen = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))) / (2 * math.pi)
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        smooth = (factor / factors[mid] - 1) / (factor - 1)
        slope, intercept = np.polyfit(inv_wavelen[mid], smooth, 1)  # smooth = old/(hi-lo)*x - lo/(hi-lo)
        if intercept < 0:
            span = -1.0 / intercept  # hi - lo with lo = 1
            candidates.append((round(slope * span), round(1.0 + span, 4)))
    candidates.append((8192, 4.0))  # Llama 3.1/3.2 values, for ramps too short to fit
    for old, hi in candidates:
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": float(hi),
            "original_max_position_embeddings": int(old),
        }
        if np.allclose(_llama3_factors(theta, head_dim, params), factors, rtol=1e-4, atol=1e-5):
            return params
    raise ModelLoadError(
        f"{path}: the rope_freqs tensor does not match llama3 RoPE scaling with low_freq_factor=1, "
        f"which is the only frequency scaling kvshare can rebuild from a GGUF file."
    )


def _longrope_from_factors(tensors: dict, meta: dict[str, Any], arch: str, context_length: int, rope_dims: int,
                           path: str) -> dict[str, Any]:
    """Phi-3's longrope scaling from the rope_factors_long/short tensors and the rope.scaling keys
    llama.cpp's converter writes (its attn_factor is HF's default attention factor)."""
    if "rope_factors_short.weight" not in tensors:
        raise ModelLoadError(f"{path}: rope_factors_long.weight without rope_factors_short.weight.")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"{path}: longrope factors without {arch}.rope.scaling.original_context_length.")
    factors = {}
    for name in ("short", "long"):
        values = dequantize_tensor(tensors[f"rope_factors_{name}.weight"]).reshape(-1)
        if values.shape[0] != rope_dims // 2:
            raise ModelLoadError(
                f"{path}: rope_factors_{name} has {values.shape[0]} entries, expected {rope_dims // 2}.")
        factors[f"{name}_factor"] = values.tolist()
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn is None:
        factor = context_length / int(original)
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original),
            "attention_factor": float(attn)}


def config_from_gguf(meta: dict[str, Any], reader: GGUFHeader, path: str) -> ModelArchConfig:
    arch = meta.get("general.architecture")
    family = REGISTRY.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(REGISTRY.architectures())})."
        )

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ModelLoadError(f"{path}: GGUF metadata is missing {full!r}.")
        return default

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor.")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # some converters write one value per layer
        if len(set(num_kv_heads)) != 1:
            raise ModelLoadError(f"{path}: per-layer head_count_kv {num_kv_heads} is not supported.")
        num_kv_heads = num_kv_heads[0]
    # With partial rotary (Phi-3) rope.dimension_count may be a part of the head, never its size.
    rope_dims_as_head = 0 if family.partial_rotary else int(key("rope.dimension_count", 0))
    head_dim = int(key("attention.key_length", 0)) or rope_dims_as_head or hidden // num_heads
    rope_dims = int(key("rope.dimension_count", head_dim))
    # Phi-3 configs may rotate only part of each head (Phi-4-mini: 3/4); no other family here does.
    if rope_dims != head_dim and not (family.partial_rotary and 0 < rope_dims < head_dim and rope_dims % 2 == 0):
        raise ModelLoadError(f"{path}: partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported.")
    value_len = int(key("attention.value_length", head_dim))
    if value_len != head_dim:
        raise ModelLoadError(f"{path}: key length {head_dim} != value length {value_len} is not supported.")
    rope_theta = float(key("rope.freq_base", 10000.0))

    rope_scaling: dict[str, Any] | None = None
    scaling_type = key("rope.scaling.type", None)
    scaling_factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
    if scaling_type in (None, "linear") and scaling_factor not in (0.0, 1.0):
        rope_scaling = {"rope_type": "linear", "factor": scaling_factor}
    elif scaling_type not in (None, "none", "linear"):
        rope_scaling = {"rope_type": str(scaling_type), "factor": scaling_factor}
        orig = key("rope.scaling.original_context_length", None)
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        attn = key("rope.scaling.attn_factor", None)
        if attn is not None:
            rope_scaling["attention_factor"] = float(attn)
    if "rope_freqs.weight" in tensors:
        rope_scaling = _llama3_from_rope_freqs(
            dequantize_tensor(tensors["rope_freqs.weight"]).numpy(), rope_theta, head_dim, path
        )
    if "rope_factors_long.weight" in tensors:
        rope_scaling = _longrope_from_factors(tensors, meta, arch, int(key("context_length", 2048)), rope_dims, path)

    eos_ids: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if k in meta and int(meta[k]) not in eos_ids:
            eos_ids.append(int(meta[k]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    sliding = key("attention.sliding_window", None)
    embd_rows = int(tensors["token_embd.weight"].shape[-1])

    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(key("vocab_size", embd_rows)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rotary_dim=rope_dims if rope_dims != head_dim else None,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        name=str(meta.get("general.name", "")),
    )
    if family.gguf_config is not None:
        fields.update(family.gguf_config(key, fields, path))
    return ModelArchConfig(**fields)


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32, quantization: str | None = "auto"
) -> tuple[ModelArchConfig, dict[str, torch.Tensor | GroupAffine], Tokenizer | None, dict[str, str]]:
    """Config, weights under HF names, tokenizer, and each weight's GGUF type name.

    quantization="auto" keeps every 2-D tensor of a format in GROUP_AFFINE_TYPES in its affine
    group form (exactly the file's weights, see gguf_quants); quantization=None dequantizes
    everything to `dtype`, the exact reference path. The file is memory-mapped: nothing but the
    header is parsed up front, and each tensor's pages are read once, when converted."""
    gguf = open_gguf_file(path)
    meta = gguf.metadata
    config = config_from_gguf(meta, gguf, path)
    family = REGISTRY.get(config.architecture)
    # llama.cpp's llama-family converter interleaves Q/K rows; qwen2's does not (NEOX rope).
    permuted = family.gguf_permuted_qk

    weights: dict[str, torch.Tensor | GroupAffine] = {}
    types: dict[str, str] = {}
    for t in gguf.tensors:
        try:
            name = hf_tensor_name(t.name, config.architecture)
        except KeyError:
            raise ModelLoadError(
                f"{path}: unexpected tensor {t.name!r} for a {config.architecture} model."
            ) from None
        if name is None:
            continue
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = config.num_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = config.num_kv_heads
        types[name] = t.type_name
        if quantization == "auto" and t.tensor_type in GROUP_AFFINE_TYPES and len(t.shape) == 2:
            raw = t.data.reshape(t.rows_shape[0], -1)  # one row of blocks per output row
            rows = None
            if heads is not None:  # rows of blocks move as a whole: the un-permuted row order
                rows = _unpermute_rows(torch.arange(raw.shape[0]).unsqueeze(1), heads).squeeze(1).numpy()
            # Kept as the file's bytes: qlinear repacks them once into the kernel's layout.
            weights[name] = GGUFBlocks.of_tensor(raw, t.tensor_type, t.rows_shape, rows)
            continue
        w = dequantize_tensor(t)
        if heads is not None:
            w = _unpermute_rows(w, heads)
        if family.gguf_norm_offset and name.endswith("norm.weight"):
            w = w - family.gguf_norm_offset  # e.g. Gemma's converter stores 1 + w; kvshare keeps HF's w
        weights[name] = w.to(dtype)
    # Phi-3: attn_qkv holds q, k and v; ffn_up (with no ffn_gate beside it) holds gate and up.
    if family.gguf_fused_gate_up:
        for i in range(config.num_layers):
            up = f"model.layers.{i}.mlp.up_proj.weight"
            if f"model.layers.{i}.mlp.gate_proj.weight" not in weights and up in weights:
                weights[f"model.layers.{i}.mlp.gate_up_proj.weight"] = weights.pop(up)
                types[f"model.layers.{i}.mlp.gate_up_proj.weight"] = types.pop(up)
    split_fused_weights(weights, config, types)

    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        try:
            tokenizer = Tokenizer.from_gguf_metadata(meta)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata ({exc}).") from exc
    return config, weights, tokenizer, types
