"""What every rank builds alike from the engine config and the loaded model: the KV layout plan
(groups, eviction policy), then the model, its KV storage and the runner. The engine builds them
in its own process; with tensor parallelism each worker rank builds its shard the same way
(kvshare.engine.tensor_parallel), so the ranks cannot disagree on how a step plan is run."""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.config import EngineConfig
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.startup import KVLayout
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_groups import GroupedKVCacheManager, KVCacheGroup, blocks_per_seq, layer_slots, plan_kv_groups
from kvshare.kvcache.kv_policy import build_kv_policy
from kvshare.kvcache.manager import KVCacheManager
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model.attention import PagedKVStorage, TorchPagedAttention
from kvshare.model.config import ModelArchConfig
from kvshare.model.llama import build_model
from kvshare.model.tensor_parallel import TPCollectives, shard_weights


@dataclass
class KVPlan:
    max_model_len: int
    # Hybrid models (global and window layers): one block table per group of layers of one
    # attention type; a block then holds KV of one group's layers, not all of them. None: one table.
    groups: list[KVCacheGroup] | None
    # The model's own sliding windows, or the opt-in sink policy: what bounds KV per sequence.
    policy: object
    group_of: list[int] | None  # each layer's group (None without groups)
    slot_of: list[int] | None  # each layer's storage slot in a block (None without groups)
    layers_per_block: int  # how many layers' KV one block holds


def plan_kv(config: EngineConfig, mc: ModelArchConfig) -> KVPlan:
    max_model_len = config.max_model_len or mc.max_position_embeddings
    groups = (plan_kv_groups(mc.attention_windows(), config.block_size)
              if config.kv_cache_groups and config.kv_policy is None else None)
    group_of, slot_of = layer_slots(groups, mc.num_layers) if groups else (None, None)
    return KVPlan(max_model_len, groups, build_kv_policy(config, mc, max_model_len), group_of, slot_of,
                  groups[0].size if groups else mc.num_layers)


def build_kv_core(config: EngineConfig, mc: ModelArchConfig, kv: KVPlan) -> tuple[KVLayout, KVCacheManager]:
    """The KV pool's layout and the block bookkeeping over it (the engine's rank only: worker
    ranks hold KV storage, never the bookkeeping). Sized by the same code as `kvshare memory`
    plans with (scale bytes included when quantized)."""
    kv_format = config.kv_format
    bytes_per_token = kv_format.bytes_per_token(kv.layers_per_block, mc.num_kv_heads, mc.head_dim)
    num_blocks = kv_pool_blocks(config.kv_budget_bytes(), bytes_per_token, config.block_size)
    max_model_len = kv.max_model_len
    hasher = BlockHasher.seeded(config.block_size, config.prefix_caching_hash_seed)
    if kv.groups:
        layout = KVLayout(bytes_per_token, config.block_size, num_blocks, max_model_len,
                          kv_format.name, len(kv.groups),
                          blocks_per_seq(kv.groups, config.block_size, max_model_len,
                                         config.max_num_batched_tokens))
        return layout, GroupedKVCacheManager(num_blocks, config.block_size, kv.groups,
                                             config.enable_prefix_caching, hasher=hasher)
    layout = KVLayout(bytes_per_token, config.block_size, num_blocks, max_model_len, kv_format.name)
    return layout, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                  policy=kv.policy, hasher=hasher)


def build_rank(config: EngineConfig, mc: ModelArchConfig, weights: dict, kv: KVPlan, num_blocks: int,
               tp: TPCollectives | None = None) -> tuple[object, PagedKVStorage, ModelRunner]:
    """(model, KV storage, runner) of this process: the whole model, or with `tp` this rank's
    shard of it (its heads' KV in the storage, the same block ids as every other rank)."""
    if tp is not None:
        weights = shard_weights(weights, tp.shard)
        mc = tp.shard.local_config()
    kv_cache = PagedKVStorage(kv.layers_per_block, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                              config.kv_format.storage, layer_slots=kv.slot_of)
    model = build_model(mc, weights, config.torch_dtype, TorchPagedAttention(config.block_size), kv.max_model_len,
                        prefill_dtype=config.prefill_torch_dtype, tp=tp)
    runner = ModelRunner(model, kv_cache, kv.policy, [g.policy for g in kv.groups] if kv.groups else None,
                         kv.group_of)
    return model, kv_cache, runner
