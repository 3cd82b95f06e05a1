"""What every rank builds alike from the engine config and the loaded model: the KV layout plan
(groups, eviction policy), then the model, its KV storage and the runner. The engine builds them
in its own process; with tensor parallelism each worker rank builds its shard the same way
(kvshare.engine.tensor_parallel), so the ranks cannot disagree on how a step plan is run."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

from kvshare.config import EngineConfig
from kvshare.engine.kv_tier_store import (FORMAT_VERSION, KVTierStore, model_identity, probe_tier_loads,
                                          tokenizer_identity)
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.startup import KVLayout, ReportedModel
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_groups import (KVCacheGroup, grouped_blocks_per_seq, layer_slots, layers_per_block, one_group,
                                       plan_kv_groups)
from kvshare.kvcache.kv_tiers import KVTiers, TierEntry
from kvshare.kvcache.kv_policy import AttentionPolicy, SinkWindow, build_kv_policy
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model.attention import PagedKVStorage, TorchPagedAttention
from kvshare.model.config import ModelArchConfig
from kvshare.model.families import REGISTRY, build_model
from kvshare.model.kernels.qmatmul import qmatmul_paths
from kvshare.model.numerics import NumericsPolicy
from kvshare.model.tensor_parallel import TPCollectives, check_shardable, shard_weights

logger = logging.getLogger("kvshare")


@dataclass
class KVPlan:
    max_model_len: int
    # One block table per group of layers (one group when every layer attends alike; hybrid models:
    # one per attention type and layer slice, a block then holding one group's layers' KV).
    groups: list[KVCacheGroup]
    # The model's own sliding windows, or the opt-in sink policy, over every layer: what bounds
    # one sequence's length and KV as a whole.
    policy: AttentionPolicy
    group_of: list[int]  # each layer's group
    slot_of: list[int]  # each layer's storage slot in a block
    layers_per_block: int  # how many layers' KV one block holds


def check_tensor_parallel(config: ModelArchConfig, size: int) -> None:
    """A clear error when `config` cannot be split over `size` ranks: its family, then its heads."""
    supported = REGISTRY.tensor_parallel_architectures()
    if config.architecture not in supported:
        raise ValueError(f"tensor_parallel_size={size} is not supported for architecture {config.architecture!r} "
                         f"(supported: {', '.join(supported)})")
    check_shardable(config, size)


def plan_kv(config: EngineConfig, mc: ModelArchConfig) -> KVPlan:
    max_model_len = config.max_model_len or mc.max_position_embeddings
    policy = build_kv_policy(config, mc, max_model_len)
    # Sinks are one policy over every layer: never split into groups.
    split = config.kv_cache_groups and not isinstance(policy, SinkWindow)
    groups = plan_kv_groups(mc.attention_windows(), config.block_size) if split else one_group(policy)
    group_of, slot_of = layer_slots(groups, mc.num_layers)
    return KVPlan(max_model_len, groups, policy, group_of, slot_of, layers_per_block(groups))


def build_kv_core(config: EngineConfig, mc: ModelArchConfig, kv: KVPlan) -> tuple[KVLayout, KVCacheCoordinator]:
    """The KV pool's layout and the block bookkeeping over it (the engine's rank only: worker
    ranks hold KV storage, never the bookkeeping). Sized by the same code as `kvshare memory`
    plans with (scale bytes included when quantized)."""
    kv_format = config.kv_format
    bytes_per_token = kv_format.bytes_per_token(kv.layers_per_block, mc.num_kv_heads, mc.head_dim)
    num_blocks = kv_pool_blocks(config.kv_budget_bytes(), bytes_per_token, config.block_size)
    seq_blocks = grouped_blocks_per_seq(kv.groups, config.block_size, kv.max_model_len, config.max_num_batched_tokens)
    layout = KVLayout(bytes_per_token, config.block_size, num_blocks, kv.max_model_len, kv_format.name,
                      len(kv.groups), seq_blocks or 0)
    hasher = BlockHasher.seeded(config.block_size, config.prefix_caching_hash_seed)
    return layout, KVCacheCoordinator(num_blocks, config.block_size, kv.groups, config.enable_prefix_caching,
                                      hasher=hasher)


def build_rank(config: EngineConfig, mc: ModelArchConfig, weights: dict, kv: KVPlan, num_blocks: int,
               numerics: NumericsPolicy, tp: TPCollectives | None = None
               ) -> tuple[ReportedModel, PagedKVStorage, ModelRunner]:
    """(model, KV storage, runner) of this process: the whole model, or with `tp` this rank's
    shard of it (its heads' KV in the storage, the same block ids as every other rank), on the
    kernels `numerics` chose (its libraries already loaded)."""
    if tp is not None:
        weights = shard_weights(weights, tp.shard)
        mc = tp.shard.local_config()
    kv_cache = PagedKVStorage(kv.layers_per_block, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                              config.kv_format.storage, layer_slots=kv.slot_of)
    backend = TorchPagedAttention(config.block_size, use_cpp_kernel=numerics.uses("paged_attention"))
    model = build_model(mc, weights, config.torch_dtype, backend, kv.max_model_len,
                        prefill_dtype=config.prefill_torch_dtype, tp=tp)
    # Token rows need the C++ attention kernel (a model that caps scores runs PyTorch's).
    token_rows = numerics.token_rows and backend is model.backend and backend.use_cpp_kernel
    runner = ModelRunner(model, kv_cache, [g.policy for g in kv.groups], kv.group_of, kv.slot_of,
                         token_rows=token_rows)
    return model, kv_cache, runner


def transparency_gaps(numerics: NumericsPolicy, runner: ModelRunner, kv: KVPlan,
                      tensor_parallel: bool) -> tuple[str, ...]:
    """Why a request's tokens and logprobs may depend on what shares its batch, what is cached or
    how its prompt is chunked (empty: they cannot; the doctor then demands exact equality).
    docs/transparency.md has the measured size of each."""
    gaps = []
    if numerics.mode != "default":
        gaps.append(f"{numerics.mode} mode: prompt rows on dense GEMMs and the causal prompt kernel (HF parity, "
                    f"not token rows)")
    elif not runner.token_rows:
        gaps.append("no token rows (the PyTorch attention path: the C++ kernels are disabled or unavailable, or the "
                    "model caps attention scores): prompt rows take other kernels than decode rows")
    linears = runner.model.linears()
    if numerics.mode == "default" and any(lin.kind == "dense" for lin in linears):
        gaps.append("dense weights (F.linear): a GEMM's summation blocking follows its row count")
    rows_kept = [lin for lin in linears if lin.kind != "dense" and lin.blocks is None]
    if numerics.mode == "default" and rows_kept and numerics.uses("qmatmul") and "avx512" not in qmatmul_paths():
        gaps.append("group matmuls on their AVX2 / scalar paths: not verified row-independent")
    if isinstance(kv.policy, SinkWindow):
        gaps.append("attention sinks: kept keys are re-rotated when the window moves, fresh ones are not")
    if tensor_parallel:
        gaps.append("tensor parallel: not verified bit-transparent (ranks' partial sums meet in an all-reduce)")
    return tuple(gaps)


def build_kv_tiers(config: EngineConfig, kv: KVCacheCoordinator, kv_cache: PagedKVStorage, runner: ModelRunner,
                   source: str, tokenizer) -> KVTiers | None:
    """The KV tiers under the pool (kvshare/kvcache/kv_tiers.py) and their bytes (the runner's
    `tier_store`), with the disk tier's start: adopted with a hash seed, cleared without one.
    None when no tier is configured."""
    if not config.kv_tiers:
        return None
    layout = list(kv_cache.data.shape)
    layout[3] = kv_cache.block_size  # one block's slots
    identity = {"format": FORMAT_VERSION, "model": model_identity(source), "tokenizer": tokenizer_identity(tokenizer),
                "block_size": config.block_size, "kv_dtype": str(kv_cache.data.dtype).replace("torch.", ""),
                "layout": layout + (["scales"] if kv_cache.scales is not None else []),
                "hash_seed": hashlib.sha256(kv.hasher.root).hexdigest()}
    disk = config.kv_disk_path
    if disk is not None:
        try:
            os.makedirs(disk, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_disk_path={disk!r} is invalid: cannot create the directory ({e})") from None
    store = KVTierStore(kv_cache, identity, disk, lambda key: tiers.describe(key))
    if config.kv_tier_probe:
        timing = probe_tier_loads(store, runner)
        recompute, ram, on_disk = timing["recompute"], timing["ram"], timing["disk"]
        logger.info(f"KV tiers: one block recomputed in {recompute * 1e3:.2f} ms, loaded from host RAM in "
                    f"{ram * 1e3:.2f} ms" + (f", from disk in {on_disk * 1e3:.2f} ms" if on_disk is not None else ""))
        if ram >= recompute:
            logger.warning("KV tiers off: loading a block from host RAM measured no faster than recomputing it "
                           "(--no-kv-tier-probe keeps them)")
            return None
        if on_disk is not None and on_disk >= recompute:
            logger.warning("KV disk tier off: loading a block from disk measured no faster than recomputing it "
                           "(--no-kv-tier-probe keeps it)")
            disk = store.disk_path = None
    block_bytes = store.file_bytes()
    ram_blocks = int(config.kv_host_memory or 0) // block_bytes
    disk_blocks = int(config.kv_disk_size) // block_bytes if disk else 0
    # A directory shared with other engines is read live only where hashes agree across processes.
    shared = disk is not None and config.prefix_caching_hash_seed is not None
    tiers = KVTiers(kv.pool, kv.hasher, ram_blocks, disk_blocks, store.fetch if disk else None,
                    store.discover if shared else None)
    runner.tier_store = store
    logger.info(f"KV tiers: host RAM {ram_blocks} blocks ({ram_blocks * block_bytes / 2**20:.1f} MiB)")
    if disk is not None:
        if config.prefix_caching_hash_seed is None:
            removed = store.clear_disk()
            note = (f"no --prefix-caching-hash-seed: block hashes are this process's, so the disk tier is too "
                    f"(cleared at start: {removed} files removed)")
        else:
            found, foreign = store.scan()
            tiers.adopt_disk([(key, TierEntry(tuple(h["tokens"]), bytes.fromhex(h["parent"]) if h["parent"] else None,
                                              h["namespace"], h["group"], h.get("adapter"))) for key, h in found])
            note = (f"kept across restarts (hash seed set): {len(found)} blocks found"
                    + (f", {foreign} files of another model, tokenizer, KV layout or hash seed ignored" if foreign
                       else ""))
        logger.info(f"KV tiers: disk {disk} {disk_blocks} blocks ({disk_blocks * block_bytes / 2**20:.1f} MiB); {note}")
    return tiers


def persist_kv_tiers(tiers: KVTiers | None, runner) -> None:
    """A clean shutdown: what the pool still caches is written to the disk tier now."""
    if tiers is not None and runner.tier_store is not None:
        tiers.persist_pool()
        runner.tier_store.apply(*tiers.take_transfers())
