"""Model families: each a config and tensor-name map plus its layer's math over kvshare.model.ops,
registered once here for the loaders, tensor parallelism, the memory planner and the tokenizer."""
from __future__ import annotations

from kvshare.model import ops
from kvshare.model.config import ModelArchConfig
from kvshare.model.families import gemma, llama, phi3, qwen
from kvshare.model.families.registry import Family, FamilyRegistry
from kvshare.model.ops import Model
from kvshare.model.tensor_parallel import check_shardable

__all__ = ["Family", "FamilyRegistry", "REGISTRY", "build_model"]

# The one list of architectures kvshare serves; tests may add one for their duration.
REGISTRY = FamilyRegistry([llama.LLAMA, qwen.QWEN2, llama.MISTRAL, qwen.QWEN3, phi3.PHI3, gemma.GEMMA2, gemma.GEMMA3])


def check_tensor_parallel(config: ModelArchConfig, size: int) -> None:
    """A clear error when `config` cannot be split over `size` ranks: its family, then its heads."""
    supported = REGISTRY.tensor_parallel_architectures()
    if config.architecture not in supported:
        raise ValueError(f"tensor_parallel_size={size} is not supported for architecture {config.architecture!r} "
                         f"(supported: {', '.join(supported)})")
    check_shardable(config, size)


def build_model(config: ModelArchConfig, weights: dict, *args, **kwargs) -> Model:
    """The model of `config`'s family over its ops (kvshare.model.ops.build_model says what the
    other arguments are)."""
    family = REGISTRY.get(config.architecture)
    if family is None:
        raise NotImplementedError(f"architecture {config.architecture!r} is not supported "
                                  f"(supported: {', '.join(REGISTRY.architectures())})")
    return ops.build_model(family.model, config, weights, *args, **kwargs)
