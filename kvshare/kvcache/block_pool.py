"""Physical KV blocks: reference counts and the free list.

Free blocks sit in an LRU-ordered queue. A freed block that holds a cached prefix keeps its
hash while it waits there, so a later request can revive it; it only loses the hash when the
pool hands it out for new data or the prefix cache is reset (`evict`, the one eviction path).
Blocks without a hash are handed out first. `on_evict` hooks hear of every eviction while the
block still holds its data (e.g. a host-RAM tier copying it out before it is overwritten).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace
from kvshare.kvcache.events import EventLog, Recorder
from kvshare.kvcache.prefix_updates import NullPrefixUpdateQueue, PrefixUpdateQueue


class BlockPoolError(RuntimeError):
    """A reference-count rule was broken: always a bug in kvshare, never bad user input."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its KV has been written; identifies its content.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: bytes | None = None  # the chain link, kept so an audit can recompute the hash
    owners: set[str] = field(default_factory=set)  # sequence ids holding a reference
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # whose data it holds: the allocating sequence's
    generation: int = 0  # bumped on every allocation: new data, old KV meaningless
    group: int = 0  # while cached: the KV cache group whose layers' KV it holds (what a KV tier keeps with it)


@dataclass
class TierBlock(Block):
    """A prefix hit whose KV is in a KV tier (kvshare/kvcache/kv_tiers.py), not yet in the pool
    (block_id -1, no holder): admitting it loads it into a free pool block first."""

    tier: str = "cpu"


class PoolTiers(Protocol):
    """What the pool and the coordinator ask of the KV tiers under the pool (kvshare/kvcache/kv_tiers.py's
    KVTiers)."""

    suspended: bool  # True while a reset evicts: those evictions forget, they keep nothing
    hit_tokens: int  # prompt tokens whose KV a tier supplied (counted once per position, over all groups)

    def find(self, block_hash: bytes, token_ids: tuple[int, ...], namespace: CacheNamespace,
             group: int) -> TierBlock | None: ...

    def loaded(self, block: Block, hit: TierBlock) -> None: ...

    def clear_ram(self) -> None: ...

    def drop_adapter(self, adapter: str) -> int: ...

    def stats(self) -> dict: ...

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[tuple[str, bytes, int]]]: ...


EvictHook = Callable[[int, bytes], None]  # (block id, its hash), called before the hash is dropped


class BlockPool:
    events = Recorder()  # the block event log, or a NullEventLog

    def __init__(self, num_blocks: int, events: EventLog | None = None, on_evict: EvictHook | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evictions = 0
        self.num_allocations = 0
        self.events = events
        # What routers see (BlockStored / BlockRemoved, kvshare.kvcache.prefix_updates): the engine
        # installs a PrefixUpdateQueue when a publisher is configured.
        self.prefix_updates: PrefixUpdateQueue | NullPrefixUpdateQueue = NullPrefixUpdateQueue()
        self.on_evict: list[EvictHook] = [on_evict] if on_evict is not None else []
        self.tiers: PoolTiers | None = None  # KV tiers under the pool (kvcache/kv_tiers.py), which set it

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, owner: str, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> Block:
        if not self._free:
            raise BlockPoolError("allocate() on an exhausted pool: the scheduler must check num_free first")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.evict(block)
        block.ref_count = 1
        block.owners = {owner}
        block.namespace = namespace
        block.generation += 1
        self.num_allocations += 1
        self.events.record("alloc", block=block_id, seq=owner)
        return block

    def evict(self, block: Block) -> None:
        """Drop a block's prefix-cache entry: its KV is about to be overwritten (or the cache is reset)."""
        assert block.block_hash is not None  # only a cached block is evicted
        for hook in self.on_evict:
            hook(block.block_id, block.block_hash)
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
            self.prefix_updates.removed(block.block_hash)
        block.block_hash = None
        block.token_ids = None
        block.parent_hash = None
        self.num_evictions += 1
        self.events.record("evict", block=block.block_id)

    def incref(self, block: Block, owner: str) -> None:
        if block.ref_count == 0:
            # Reviving a cached free block.
            self._free.pop(block.block_id, None)
        block.ref_count += 1
        block.owners.add(owner)
        self.events.record("incref", block=block.block_id, seq=owner, ref=block.ref_count)

    def decref(self, block: Block, owner: str) -> bool:
        """Drop one reference; returns True when the block went back to the free queue."""
        if block.ref_count <= 0:
            raise BlockPoolError(f"block {block.block_id}: reference count would go below zero (owner {owner})")
        block.ref_count -= 1
        block.owners.discard(owner)
        self.events.record("decref", block=block.block_id, seq=owner, ref=block.ref_count)
        if block.ref_count == 0:
            self.events.record("free", block=block.block_id)
            if block.block_hash is None:
                # Nothing worth keeping: hand it out before any cached block.
                self._free[block.block_id] = None
                self._free.move_to_end(block.block_id, last=False)
            else:
                self._free[block.block_id] = None
            return True
        return False

    def publish(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...],
                parent_hash: bytes | None = None, group: int = 0) -> None:
        """Make a full, written block a prefix-cache hit for later requests ("publish" is the
        one word for it; the event log calls it "register")."""
        if block_hash in self.cached:
            return  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        block.group = group
        self.cached[block_hash] = block.block_id
        self.prefix_updates.stored(block_hash, parent_hash, token_ids)
        self.events.record("register", block=block.block_id, hash=block_hash.hex()[:16],
                           parent=parent_hash.hex()[:16] if parent_hash else None,
                           **block.namespace.event_fields(), tokens=list(token_ids))

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...], namespace: CacheNamespace | None = None,
               group: int = 0) -> Block | None:
        """The cached block for this hash, or (a pool miss) the KV tiers' `TierBlock` of KV cache
        group `group`, or None. Without a namespace: the pool only."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            if self.tiers is None or namespace is None:
                return None
            return self.tiers.find(block_hash, token_ids, namespace, group)
        block = self.blocks[block_id]
        # Confirm by content, so a hash collision can never serve another prompt's KV.
        if block.token_ids != token_ids:
            return None
        return block

    def pin(self, block: Block) -> None:
        """Take a cached free block out of the free queue ahead of its revival (its incref, in the
        same admission), so the allocations in between cannot evict it."""
        self._free.pop(block.block_id, None)

    def take_for_load(self, hit: TierBlock) -> Block:
        """A free block for a tier hit's KV: cached at once under the hit's hash (its load runs
        before any forward reads it) and back in the free queue, unheld, until the admission that
        found the hit revives it (every tier hit of one admission: k <= free blocks, so none of them
        reaches the head of the queue meanwhile)."""
        assert self.tiers is not None and hit.block_hash is not None and hit.token_ids is not None
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.evict(block)
        block.namespace = hit.namespace
        block.generation += 1
        self.num_allocations += 1
        self._free[block_id] = None
        self.events.record("tier_load", block=block_id, hash=hit.block_hash.hex()[:16], tier=hit.tier,
                           group=hit.group, **hit.namespace.event_fields())
        self.tiers.loaded(block, hit)
        self.publish(block, hit.block_hash, hit.token_ids, hit.parent_hash, hit.group)
        return block

    def drop_adapter(self, adapter: str) -> int:
        """Forget every cached block nobody holds whose KV was computed under this LoRA adapter
        (its cache key); returns how many."""
        dropped = 0
        for block_id in list(self.cached.values()):
            block = self.blocks[block_id]
            if block.ref_count == 0 and block.namespace.adapter == adapter:
                self.evict(block)
                dropped += 1
        return dropped

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.evict(block)
        if not self.cached:
            self.prefix_updates.cleared()
