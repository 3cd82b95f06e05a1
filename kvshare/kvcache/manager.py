"""Block tables, allocation as sequences grow, prefix-cache hits, copy-on-write, and the one
release path that finish, abort and preemption all go through."""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.kvcache.block_pool import Block, BlockPool, BlockPoolError
from kvshare.kvcache.hashing import BlockHasher


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens served from cache
    cow_copies: int = 0
    forks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(block_size)
        self.tables: dict[str, list[Block]] = {}
        # Per sequence: chained hashes of its full blocks, and how many of its blocks are registered.
        self._hashes: dict[str, list[bytes]] = {}
        self._registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # Copies the model runner must perform before the next forward pass: (src, dst) block ids.
        self.pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def usage(self) -> float:
        return self.num_used_blocks() / self.pool.num_blocks

    def num_shared_blocks(self) -> int:
        return sum(1 for b in self.pool.blocks if b.ref_count > 1)

    def stats_dict(self) -> dict:
        s = self.stats
        return {
            "prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
            "blocks_shared": self.num_shared_blocks(), "cow_copies": s.cow_copies, "forks": s.forks,
            "evictions": self.pool.num_evictions, "allocations": self.pool.num_allocations,
            "blocks_in_use": self.num_used_blocks(), "blocks_cached_free": self.pool.num_cached_free(),
            "blocks_total": self.num_blocks,
        }

    def assert_idle_whole(self) -> None:
        """When nothing runs: no block referenced, every block free (cached or not)."""
        held = [b.block_id for b in self.pool.blocks if b.ref_count != 0]
        if held or self.tables or self.pool.num_free != self.num_blocks:
            raise BlockPoolError(
                f"pool not whole when idle: referenced blocks {held[:10]}, tables {list(self.tables)[:10]}, "
                f"free {self.pool.num_free} of {self.num_blocks}"
            )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, seq_id: str, token_ids: list[int], cache_salt: str | None, upto_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq_id, [])
        bs = self.block_size
        extra = self.hasher.extra_keys(cache_salt)
        while len(hashes) < upto_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.hasher.hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def find_cached_prefix(self, seq_id: str, token_ids: list[int], cache_salt: str | None) -> list[Block]:
        """Longest run of cached full blocks, stopping at len - 1 tokens so the last prompt
        token is always computed and its logits exist."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._block_hashes(seq_id, token_ids, cache_salt, max_blocks)
        hits: list[Block] = []
        bs = self.block_size
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a request that waits a step is not counted twice)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def hashes_completed_by(self, seq_id: str, token_ids: list[int], cache_salt: str | None, start: int,
                            end: int) -> list[bytes]:
        """Hashes of the full blocks that computing tokens [start, end) will complete."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        first, last = -(-start // bs), end // bs
        if last <= first:
            return []
        return self._block_hashes(seq_id, token_ids, cache_salt, last)[first:last]

    def first_missing_hash(self, seq_id: str, token_ids: list[int], cache_salt: str | None,
                           num_cached_blocks: int) -> bytes | None:
        """Hash of the block a new admission would compute first, if that block is full."""
        if not self.enable_prefix_caching or (num_cached_blocks + 1) * self.block_size > len(token_ids) - 1:
            return None
        return self._block_hashes(seq_id, token_ids, cache_salt, num_cached_blocks + 1)[num_cached_blocks]

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int, cache_salt: str | None) -> None:
        """Publish blocks whose KV is now written (called after the step that computed them)."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id)
        if not table:
            return
        full = min(num_computed // self.block_size, len(table))
        done = self._registered.get(seq_id, 0)
        if full <= done:
            return
        hashes = self._block_hashes(seq_id, token_ids, cache_salt, full)
        bs = self.block_size
        for i in range(done, full):
            block = table[i]
            if block.block_hash is None:
                self.pool.register_hash(block, hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]))
        self._registered[seq_id] = full

    # ---- allocation ----------------------------------------------------------------------
    def can_admit(self, cached: list[Block], num_computed: int, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(cached)
        revived = sum(1 for b in cached if b.ref_count == 0)
        return needed <= self.pool.num_free - revived

    def admit(self, seq_id: str, cached: list[Block]) -> None:
        if seq_id in self.tables and self.tables[seq_id]:
            raise BlockPoolError(f"sequence {seq_id} admitted while it still holds blocks")
        table: list[Block] = []
        for block in cached:
            self.pool.incref(block, seq_id)
            table.append(block)
        self.tables[seq_id] = table
        self._registered[seq_id] = len(cached)

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Make room for tokens [num_computed, num_computed + num_new_tokens). False if the pool
        cannot supply the blocks (nothing is changed then)."""
        table = self.tables.setdefault(seq_id, [])
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(table)
        first = num_computed // self.block_size
        cow = first < len(table) and table[first].ref_count > 1
        if max(needed, 0) + (1 if cow else 0) > self.pool.num_free:
            return False
        if cow:
            self._copy_on_write(seq_id, table, first)
        for _ in range(needed):
            table.append(self.pool.allocate(seq_id))
        return True

    def _copy_on_write(self, seq_id: str, table: list[Block], index: int) -> None:
        # A shared block is about to be written: this sequence gets a private copy first.
        shared = table[index]
        private = self.pool.allocate(seq_id)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.decref(shared, seq_id)
        table[index] = private
        self.stats.cow_copies += 1
        # Hashes registered for this block index stay valid only for the shared original.
        self._registered[seq_id] = min(self._registered.get(seq_id, 0), index)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block; the first write into a shared one copies it."""
        parent = self.tables.get(parent_id, [])
        for block in parent:
            self.pool.incref(block, child_id)
        self.tables[child_id] = list(parent)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))
        self._registered[child_id] = self._registered.get(parent_id, 0)
        self.stats.forks += 1

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq_id: str) -> None:
        """The one release path: finish, abort and preemption all end here."""
        table = self.tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        if not table:
            return
        # Tail first, so a chain's tail blocks are the first to be evicted later.
        for block in reversed(table):
            self.pool.decref(block, seq_id)

    def reset_hashes(self, seq_id: str) -> None:
        self._hashes.pop(seq_id, None)
