"""What a family declares, once, for every part of kvshare that reads a checkpoint of it.

The loaders (GGUF and HF), tensor parallelism, the memory planner and the tokenizer ask the
registry about an architecture; none of them spells an architecture's name.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

# A hook that reads a family's own config fields: (what the file holds, the common fields read
# so far, where the file is) -> the fields to set or replace. `source` is the config.json dict
# for HF directories and a `key(name, default)` reader of "{arch}.{name}" for GGUF files.
ConfigHook = Callable[[Any, dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    architecture: str  # ModelArchConfig.architecture: the GGUF general.architecture name
    model: type  # a kvshare.model.ops.Model subclass: the layer's math
    hf_model_type: str | None = None  # config.json's model_type (None: not loadable from HF)
    # transformers' config defaults for what config.json leaves out (rms_norm_eps,
    # max_position_embeddings, bos_token_id, eos_token_id, num_key_value_heads, head_dim, ...)
    hf_defaults: dict[str, Any] = field(default_factory=dict)
    hf_config: ConfigHook | None = None
    gguf_config: ConfigHook | None = None
    # GGUF layer tensor names (after "blk.{i}.") -> HF names, over the common Llama map.
    gguf_layer_tensors: dict[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the q/k rows
    gguf_norm_offset: float = 0.0  # the converter stored norm weights plus this
    gguf_fused_gate_up: bool = False  # an ffn_up with no ffn_gate holds gate and up
    partial_rotary: bool = False  # RoPE may turn only the first dims of each head
    # Weight shapes beyond the common Llama layout (kvshare.model.loader.expected_weight_shapes).
    extra_weights: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    tensor_parallel: bool = True  # weights shard by heads, MLP and vocabulary (Megatron)
    # GGUF tokenizer.ggml.general.architecture values whose 'llama' tokenizer is this family's
    # SentencePiece (Gemma's byte-fallback pieces); empty: none.
    spm_tokenizer_architectures: tuple[str, ...] = ()


class FamilyRegistry:
    """The families kvshare serves, by architecture. Built once from the bundled families; a
    test may add one for its duration (`registered`)."""

    def __init__(self, families: list[Family]) -> None:
        self._families = {f.architecture: f for f in families}

    def get(self, architecture: str) -> Family | None:
        return self._families.get(architecture)

    def architectures(self) -> tuple[str, ...]:
        return tuple(self._families)

    def by_hf_model_type(self, model_type: str) -> Family | None:
        return next((f for f in self._families.values() if f.hf_model_type == model_type), None)

    def hf_model_types(self) -> tuple[str, ...]:
        return tuple(f.hf_model_type for f in self._families.values() if f.hf_model_type)

    def tensor_parallel_architectures(self) -> tuple[str, ...]:
        return tuple(a for a, f in self._families.items() if f.tensor_parallel)

    def spm_tokenizer_architectures(self) -> tuple[str, ...]:
        return tuple(a for f in self._families.values() for a in f.spm_tokenizer_architectures)

    @contextlib.contextmanager
    def registered(self, family: Family) -> Iterator[Family]:
        if family.architecture in self._families:
            raise ValueError(f"architecture {family.architecture!r} is already registered")
        self._families[family.architecture] = family
        try:
            yield family
        finally:
            del self._families[family.architecture]
