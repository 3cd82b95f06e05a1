"""Phi-3: the Llama layer (kvshare.model.families.llama) with longrope and partial rotary
embeddings; its fused qkv / gate_up checkpoint tensors are split by the loaders into the Llama
names and fused again by the layer."""
from __future__ import annotations

import math
from typing import Any

from kvshare.model.config import windows_every_layer
from kvshare.model.families.llama import LlamaModel
from kvshare.model.families.registry import Family
from kvshare.model.load_error import ModelLoadError


def _rope(cfg: dict[str, Any], scaling: dict[str, Any] | None, head_dim: int, directory: str,
          defaults: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
    """(rope_scaling, rotary_dim) of a Phi-3 config, every longrope value resolved as transformers'
    Phi3Config and _compute_longrope_parameters resolve it."""
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", (cfg.get("rope_scaling") or {}).get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelLoadError(f"{directory}: partial_rotary_factor {partial} gives {rotary_dim} rotary dims of "
                             f"{head_dim}; need an even number between 2 and head_dim.")
    if scaling is None:
        return None, (rotary_dim if rotary_dim != head_dim else None)
    kind = scaling["rope_type"]
    if kind in ("su", "yarn"):  # Phi3Config renames both to longrope
        kind = "longrope"
    if kind != "longrope":
        raise ModelLoadError(f"{directory}: Phi-3 rope type {kind!r} is not supported (supported: default, longrope).")
    max_pos = int(cfg.get("max_position_embeddings", defaults["max_position_embeddings"]))
    # Phi3Config always has a top-level original_max_position_embeddings (default 4096), and
    # transformers lets it win over the rope dict's.
    original = int(cfg.get("original_max_position_embeddings", defaults["original_max_position_embeddings"]))
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = scaling.get(name)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ModelLoadError(f"{directory}: longrope {name} must list {rotary_dim // 2} numbers "
                                 f"(one per rotary frequency); got {values!r:.80}.")
        factors[name] = [float(v) for v in values]
    return ({"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
             "attention_factor": float(attention_factor)}, (rotary_dim if rotary_dim != head_dim else None))


def _phi3_hf(cfg: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    scaling, rotary_dim = _rope(cfg, fields["rope_scaling"], fields["head_dim"], where, PHI3.hf_defaults)
    # Phi3Model masks every layer by sliding_window when set.
    return {"rope_scaling": scaling, "rotary_dim": rotary_dim, **windows_every_layer(cfg, PHI3.hf_defaults)}


PHI3 = Family("phi3", LlamaModel, hf_model_type="phi3", hf_config=_phi3_hf, partial_rotary=True,
              gguf_fused_gate_up=True,
              hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "bos_token_id": 1,
                           "eos_token_id": 32000, "sliding_window": None, "original_max_position_embeddings": 4096})
