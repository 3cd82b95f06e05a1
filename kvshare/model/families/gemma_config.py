"""How Gemma 2 and Gemma 3 checkpoints describe themselves: their config.json and GGUF metadata
fields beyond the Llama ones, their extra tensors (kvshare.model.families.gemma registers them)."""
from __future__ import annotations

from typing import Any, Callable

from kvshare.model.config import ModelArchConfig
from kvshare.model.load_error import ModelLoadError

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


def hf_config_fields(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    """What a Gemma config.json sets beyond the Llama fields, with transformers' defaults for
    what it leaves out (Gemma2Config / Gemma3TextConfig)."""
    arch, num_layers = fields["architecture"], fields["num_layers"]
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


def gguf_config_fields(key: Callable[..., Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    """What a gemma2 / gemma3 GGUF sets beyond the Llama fields, read as llama.cpp reads it
    (src/models/gemma2.cpp, gemma3.cpp). `key(name, default)` reads "{arch}.{name}"."""
    arch, num_layers, hidden = fields["architecture"], fields["num_layers"], fields["hidden_size"]
    num_heads, head_dim, rope_theta = fields["num_heads"], fields["head_dim"], fields["rope_theta"]
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
