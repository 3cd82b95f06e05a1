"""Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before RoPE): the Llama layer
(kvshare.model.families.llama), with windows only where use_sliding_window says."""
from __future__ import annotations

from typing import Any

from kvshare.model.families.llama import LlamaModel
from kvshare.model.families.registry import Family
from kvshare.model.load_error import ModelLoadError

_SLIDING, _FULL = "sliding_attention", "full_attention"


def _windows(cfg: dict[str, Any], defaults: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """As transformers 5 reads the config: only with use_sliding_window, on the layers `layer_types`
    marks "sliding_attention" (by default those from max_window_layers on)."""
    window = cfg.get("sliding_window", defaults["sliding_window"])
    if not cfg.get("use_sliding_window", False) or not window:
        return {"sliding_window": None, "layer_windows": None}
    layer_types = cfg.get("layer_types") or [
        _SLIDING if i >= cfg.get("max_window_layers", defaults["max_window_layers"]) else _FULL
        for i in range(num_layers)
    ]
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown or len(layer_types) != num_layers:
        raise ModelLoadError(f"Qwen2 layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                             f"{num_layers} layers; got {len(layer_types)} entries (unknown kinds: {unknown}).")
    windows = [int(window) if t == _SLIDING else None for t in layer_types]
    if all(w is None for w in windows):
        return {"sliding_window": None, "layer_windows": None}
    if all(w is not None for w in windows):
        return {"sliding_window": int(window), "layer_windows": None}
    return {"sliding_window": int(window), "layer_windows": windows}


def _qwen2_hf(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    # Qwen2 always has q/k/v bias.
    return {"attention_bias": True, **_windows(cfg, QWEN2.hf_defaults, fields["num_layers"])}


def _qwen3_hf(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{where}: Qwen3 with attention_bias=true (q/k/v/o biases) is not supported.")
    return {"qk_norm": True, **_windows(cfg, QWEN3.hf_defaults, fields["num_layers"])}


_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
             "num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28}
QWEN2 = Family("qwen2", LlamaModel, hf_model_type="qwen2", hf_config=_qwen2_hf, hf_defaults=_DEFAULTS)
# head_dim: Qwen3Config's own default, not hidden_size // num_attention_heads
QWEN3 = Family("qwen3", LlamaModel, hf_model_type="qwen3", hf_config=_qwen3_hf,
               hf_defaults={**_DEFAULTS, "head_dim": 128})
