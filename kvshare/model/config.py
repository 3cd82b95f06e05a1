"""Architecture description shared by every loader and model family."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArchConfig:
    """What the model code needs to know about a checkpoint, whatever file it came from.

    Weight names everywhere in kvshare follow the Hugging Face Llama layout
    (``model.layers.{i}.self_attn.q_proj.weight`` ...), so a GGUF file and an HF directory
    load into the same modules and can be compared tensor by tensor.
    """

    architecture: str  # a registered family's name (kvshare.model.families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; Phi-3's {"rope_type": "longrope",
    # "short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"}
    # (every value resolved by the loader); None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    # Dims of each head RoPE rotates (the first ones; the rest pass through), None = head_dim.
    # Phi-3 configs' partial_rotary_factor * head_dim.
    rotary_dim: int | None = None
    sliding_window: int | None = None  # the window of the windowed layers (None: no layer has one)
    # Per layer: its window, or None for global attention; None (the field) means every layer
    # uses `sliding_window`. Set when a config mixes local and global layers (Qwen2 layer_types).
    layer_windows: list[int | None] | None = None
    # Gemma 2 / 3 (kvshare.model.families.gemma); the defaults mean "as Llama".
    # Attention softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    # Scores, then logits, become cap * tanh(x / cap) (Gemma 2); None: no capping.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # RoPE base of the sliding-window layers when it differs from the global layers' (Gemma 3:
    # 10k local vs 1M global); those layers then take no rope_scaling. None: all layers alike.
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def rope_dims(self) -> int:
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window (keys with query - key < window are seen), None = global."""
        if self.layer_windows is not None:
            return list(self.layer_windows)
        return [self.sliding_window] * self.num_layers


def windows_every_layer(cfg: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The window of a config.json whose sliding_window, when set, masks every layer (Mistral,
    Phi-3), as ModelArchConfig fields."""
    window = cfg.get("sliding_window", defaults["sliding_window"])
    return {"sliding_window": int(window) if window else None, "layer_windows": None}
