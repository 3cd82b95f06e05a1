"""The KV core's seams, model-free: eviction is one named operation whose hooks (`on_evict`) hear
of every evicted block while it still holds its data, and one coordinator serves one group or
several alike."""
from __future__ import annotations

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import plan_kv_groups

BS = 4


def admit(core: KVCacheCoordinator, seq_id: str, tokens: list[int]) -> None:
    plan = core.plan_admission(seq_id, tokens, DEFAULT_NAMESPACE, max_new_tokens=len(tokens))
    assert plan.refusal is None, plan.refusal
    core.commit_admission(plan)
    core.publish_full_blocks(seq_id, tokens, len(tokens))


def test_an_allocation_that_reuses_a_cached_block_calls_on_evict_with_its_id_and_hash():
    heard = []
    core = KVCacheCoordinator(4, BS, plan_kv_groups([None], BS),
                              on_evict=lambda block_id, block_hash: heard.append(
                                  (block_id, block_hash, core.pool.blocks[block_id].token_ids)))
    admit(core, "a", list(range(9)))  # 2 full blocks published, 1 partial
    cached = {b.block_id: b.block_hash for b in core.pool.blocks if b.block_hash is not None}
    assert len(cached) == 2 and heard == []
    core.free("a")
    assert heard == []  # freed cached blocks stay in the cache: nothing evicted yet
    admit(core, "b", list(range(100, 113)))  # 4 blocks: the free ones first, then the 2 cached ones
    assert sorted((bid, h) for bid, h, _ in heard) == sorted(cached.items())
    # Called before the data goes: the hook still sees the block's tokens.
    assert all(tokens is not None for _, _, tokens in heard)
    assert core.pool.num_evictions == 2 and not set(cached.values()) & set(core.pool.cached)


def test_reset_prefix_cache_evicts_through_the_same_hooks():
    heard: list[int] = []
    core = KVCacheCoordinator(8, BS, plan_kv_groups([None], BS))
    core.pool.on_evict.append(lambda block_id, block_hash: heard.append(block_id))
    core.pool.on_evict.append(lambda block_id, block_hash: heard.append(-block_id - 1))  # several hooks
    admit(core, "a", list(range(9)))
    held = [b.block_id for b in core.pool.blocks if b.block_hash is not None]
    core.reset_prefix_cache()
    assert heard == []  # held blocks are not evicted
    core.free("a")
    core.reset_prefix_cache()
    assert sorted(b for b in heard if b >= 0) == sorted(held) and len(heard) == 2 * len(held)


def test_evict_is_the_named_operation_and_drops_the_cache_entry():
    core = KVCacheCoordinator(4, BS, plan_kv_groups([None], BS))
    admit(core, "a", list(range(5)))
    core.free("a")
    block = next(b for b in core.pool.blocks if b.block_hash is not None)
    h = block.block_hash
    core.pool.evict(block)
    assert block.block_hash is None and h not in core.pool.cached and core.pool.num_evictions == 1


def test_one_group_and_several_groups_are_one_coordinator():
    one = KVCacheCoordinator(16, BS, plan_kv_groups([None, None], BS))
    two = KVCacheCoordinator(16, BS, plan_kv_groups([None, 8], BS))
    assert (one.num_groups, two.num_groups) == (1, 2)
    for core in (one, two):
        admit(core, "a", list(range(10)))  # 3 blocks per group
        assert core.num_held_blocks("a") == 3 * core.num_groups == core.num_used_blocks()
        assert [len(w) for w, _, _ in core.access_by_group("a", 9, 10)] == [1] * core.num_groups
        core.free("a")
        core.assert_idle_whole()
