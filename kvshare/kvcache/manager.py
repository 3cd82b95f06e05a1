"""Block tables, allocation as sequences grow, prefix-cache hits, copy-on-write, and the one
release path that finish, abort and preemption all go through.

With a bounded-KV policy (kv_policy: model sliding windows, attention sinks) a sequence also
lets go of blocks no later query reads (`slide`): they go back through the pool (still hashed,
so the prefix cache keeps them as freed cached blocks) and leave a `None` placeholder in the
table, so table index i still means positions [i * block_size, (i + 1) * block_size)."""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.kvcache.block_pool import Block, BlockPool, BlockPoolError
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_policy import SinkWindow, SlidingWindow


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: EventLog | None = None, policy: SlidingWindow | SinkWindow | None = None) -> None:
        self.block_size = block_size
        self.policy = policy
        # Blocks a sequence may publish to the prefix cache (None: all); fixed by the policy.
        self.publish_limit = policy.publishable_blocks() if policy is not None else None
        self.events = events
        self.pool = BlockPool(num_blocks, events)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(block_size)
        self.tables: dict[str, list[Block | None]] = {}  # None: released (outside every window)
        # Released entries always form one run [policy.keep_head, _released[seq]): windows only
        # move forward. Kept so that per-step work does not grow with the sequence's length.
        self._released: dict[str, int] = {}
        # Per sequence: chained hashes of its full blocks, and how many of its blocks are registered.
        self._hashes: dict[str, list[bytes]] = {}
        self._registered: dict[str, int] = {}
        self.salts: dict[str, str | None] = {}  # tenant of each live sequence
        self.stats = PrefixCacheStats()
        # Copies the model runner must perform before the next forward pass: (src, dst) block ids.
        self.pending_copies: list[tuple[int, int]] = []
        # Sink sequences: how far back their kept keys have been rotated, and the rotations the
        # runner must apply (after the copies) before the next forward: seq -> (block ids, shift).
        self._rope_offset: dict[str, int] = {}
        self.pending_rotations: dict[str, tuple[list[int], int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq_id: str) -> list[int | None]:
        return [b.block_id if b is not None else None for b in self.tables.get(seq_id, ())]

    def num_held_blocks(self, seq_id: str) -> int:
        return len(self.tables.get(seq_id, ())) - self._num_released(seq_id)

    def _num_released(self, seq_id: str) -> int:
        if self.policy is None:
            return 0
        return max(0, self._released.get(seq_id, 0) - self.policy.keep_head)

    def held_indices(self, seq_id: str, upto: int) -> list[int]:
        """Table indices below `upto` that still hold a block, in order."""
        head = self.policy.keep_head if self.policy is not None else 0
        return list(range(min(head, upto))) + list(range(head + self._num_released(seq_id), upto))

    def rope_offset(self, seq_id: str) -> int:
        """Text position minus cache position for this sequence's new tokens (sinks only)."""
        return self._rope_offset.get(seq_id, 0)

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
        limit = self.publish_limit
        if limit is not None:
            max_blocks = min(max_blocks, limit)
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
        limit = self.publish_limit
        if limit is not None:
            last = min(last, limit)  # the rest will never be published: nobody should wait for it
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
        limit = self.publish_limit
        if limit is not None:
            # Re-rotated keys no longer match their hash position-wise: a sink sequence
            # publishes only blocks computed before any masking, and nothing once it rotated.
            full = 0 if self._rope_offset.get(seq_id, 0) else min(full, limit)
        done = self._registered.get(seq_id, 0)
        if full <= done:
            return
        hashes = self._block_hashes(seq_id, token_ids, cache_salt, full)
        bs = self.block_size
        for i in range(done, full):
            block = table[i]
            if block is not None and block.block_hash is None:
                self.pool.register_hash(block, hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]),
                                        hashes[i - 1] if i else None)
        self._registered[seq_id] = full

    # ---- allocation ----------------------------------------------------------------------
    def can_admit(self, cached: list[Block], num_computed: int, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(cached)
        revived = sum(1 for b in cached if b is not None and b.ref_count == 0)
        return needed <= self.pool.num_free - revived

    def admit(self, seq_id: str, cached: list[Block], salt: str | None = None) -> None:
        if seq_id in self.tables and self.tables[seq_id]:
            raise BlockPoolError(f"sequence {seq_id} admitted while it still holds blocks")
        self.salts[seq_id] = salt
        if self.events is not None:
            self.events.record("admit", seq=seq_id, salt=salt)
        table: list[Block | None] = []
        for block in cached:
            if block is None:
                table.append(None)  # a hit no query of this sequence will read
                continue
            if self.events is not None:
                self.events.record("cache_hit", block=block.block_id, seq=seq_id)
            self.pool.incref(block, seq_id)
            table.append(block)
        self.tables[seq_id] = table
        self._released[seq_id] = max((i + 1 for i, b in enumerate(cached) if b is None), default=0)
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
        salt = self.salts.get(seq_id)
        for _ in range(needed):
            table.append(self.pool.allocate(seq_id, salt))
        return True

    def _copy_on_write(self, seq_id: str, table: list[Block], index: int) -> None:
        # A shared block is about to be written: this sequence gets a private copy first.
        shared = table[index]
        private = self.pool.allocate(seq_id, self.salts.get(seq_id))
        if self.events is not None:
            self.events.record("cow", seq=seq_id, src=shared.block_id, dst=private.block_id)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.decref(shared, seq_id)
        table[index] = private
        self.stats.cow_copies += 1
        # Hashes registered for this block index stay valid only for the shared original.
        self._registered[seq_id] = min(self._registered.get(seq_id, 0), index)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block; the first write into a shared one copies it."""
        parent = self.tables.get(parent_id, [])
        self.salts[child_id] = self.salts.get(parent_id)
        if self.events is not None:
            self.events.record("fork", seq=child_id, parent=parent_id)
        for block in parent:
            if block is not None:
                self.pool.incref(block, child_id)
        self.tables[child_id] = list(parent)
        self._released[child_id] = self._released.get(parent_id, 0)
        if parent_id in self._rope_offset:
            self._rope_offset[child_id] = self._rope_offset[parent_id]
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))
        self._registered[child_id] = self._registered.get(parent_id, 0)
        self.stats.forks += 1

    # ---- bounded KV (kv_policy) -------------------------------------------------------------
    def unread_hits_dropped(self, cached: list[Block], num_computed: int) -> list[Block | None]:
        """Prefix hits that no query from `num_computed` on reads become placeholders: they are
        neither revived nor counted against the pool."""
        if self.policy is None:
            return cached
        head = self.policy.keep_head
        end = min(self.policy.released_blocks(num_computed), len(cached))
        return [None if head <= i < end else b for i, b in enumerate(cached)]

    def chunk_limit(self, seq_id: str, start: int) -> int | None:
        """Most tokens a chunk from `start` may compute (None: no limit from the policy)."""
        return self.policy.chunk_limit(start) if self.policy is not None else None

    def slide(self, seq_id: str, start: int) -> bool:
        """Before computing positions from `start`: release the blocks no query from there on
        reads and, for sink sequences, queue the re-rotation of the kept keys. False (with the
        releases done, nothing else changed) if a block to re-rotate needs a private copy and
        the pool has no free block for it."""
        table = self.tables.get(seq_id)
        if self.policy is None or not table:
            return True
        policy = self.policy
        end = min(policy.released_blocks(start), len(table))
        for i in range(max(policy.keep_head, self._released.get(seq_id, 0)), end):
            block = table[i]
            if block is not None:
                table[i] = None
                self.pool.decref(block, seq_id)
        self._released[seq_id] = max(self._released.get(seq_id, 0), end)
        offset = policy.rope_offset(start)
        old = self._rope_offset.get(seq_id, 0)
        if offset == old:
            return True
        # Kept non-sink blocks holding keys written so far (positions < start).
        kept = [i for i in range(max(policy.keep_head, end), min(-(-start // self.block_size), len(table)))
                if table[i] is not None]
        # Shared or published blocks are never changed in place: the rotation goes into a
        # private copy, and the original stays for its other holders or in the prefix cache.
        frozen = [i for i in kept if table[i].ref_count > 1 or table[i].block_hash is not None]
        if len(frozen) > self.pool.num_free:
            return False
        for i in frozen:
            self._copy_on_write(seq_id, table, i)
        rotate = [table[i].block_id for i in kept]
        self.pending_rotations[seq_id] = (rotate, old - offset)
        self._rope_offset[seq_id] = offset
        return True

    def take_pending_rotations(self) -> list[tuple[str, list[int], int]]:
        rotations = [(seq_id, ids, shift) for seq_id, (ids, shift) in self.pending_rotations.items()]
        self.pending_rotations = {}
        return rotations

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq_id: str) -> None:
        """The one release path: finish, abort and preemption all end here."""
        table = self.tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        self.salts.pop(seq_id, None)
        self._rope_offset.pop(seq_id, None)
        self._released.pop(seq_id, None)
        self.pending_rotations.pop(seq_id, None)
        if not table:
            return
        # Tail first, so a chain's tail blocks are the first to be evicted later.
        for block in reversed(table):
            if block is not None:
                self.pool.decref(block, seq_id)

    def reset_hashes(self, seq_id: str) -> None:
        self._hashes.pop(seq_id, None)
