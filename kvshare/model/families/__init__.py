"""Model families: each a config and tensor-name map plus its layer's math over kvshare.model.ops,
registered once here for the loaders, tensor parallelism, the memory planner and the tokenizer."""
from __future__ import annotations

from kvshare.model import ops
from kvshare.model.config import ModelArchConfig
from kvshare.model.families import gemma, llama, phi3, qwen
from kvshare.model.families.registry import Family, FamilyRegistry
from kvshare.model.ops import Model

__all__ = ["Family", "FamilyRegistry", "REGISTRY", "build_model"]

# The one list of architectures kvshare serves; tests may add one for their duration.
REGISTRY = FamilyRegistry([llama.LLAMA, qwen.QWEN2, llama.MISTRAL, qwen.QWEN3, phi3.PHI3, gemma.GEMMA2, gemma.GEMMA3])


def build_model(config: ModelArchConfig, weights: dict, *args, **kwargs) -> Model:
    """The model of `config`'s family over its ops (kvshare.model.ops.build_model says what the
    other arguments are)."""
    family = REGISTRY.get(config.architecture)
    if family is None:
        raise NotImplementedError(f"architecture {config.architecture!r} is not supported "
                                  f"(supported: {', '.join(REGISTRY.architectures())})")
    return ops.build_model(family.model, config, weights, *args, **kwargs)
