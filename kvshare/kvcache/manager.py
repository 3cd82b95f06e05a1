"""One KV cache group's block tables: a sequence's KV state in one record, and the life of its
blocks: prefix-cache hits, growth, copy-on-write, fork, sliding release, and the one release path
that finish, abort and preemption all go through. The coordinator (kvcache/coordinator.py) runs
one per group over a shared pool and decides what spans groups (admission, room in the pool).

The attention policy (kv_policy: full attention, model sliding windows, attention sinks) says
which blocks a sequence can let go of (`slide`): they go back through the pool (still hashed,
so the prefix cache keeps them as freed cached blocks) and leave a `None` placeholder in the
table, so table index i still means positions [i * block_size, (i + 1) * block_size). Under
full attention nothing is ever released."""
from __future__ import annotations

from itertools import takewhile

from kvshare.kvcache.block_pool import Block, BlockPool, BlockPoolError
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.events import EventLog, Recorder
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_policy import FullAttention
from kvshare.kvcache.seq_kv import AdmissionPlan, PrefixCacheStats, SeqKV

__all__ = ["AdmissionPlan", "KVCacheManager", "PrefixCacheStats", "SeqKV"]


class KVCacheManager:
    events = Recorder()  # the block event log, or a NullEventLog

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: EventLog | None = None, policy=None, pool: BlockPool | None = None,
                 hasher: BlockHasher | None = None, chain_root: bytes | None = None, group: int = 0) -> None:
        self.block_size = block_size
        self.group = group  # which KV cache group this is (its blocks say so to the KV tiers)
        self.policy = policy or FullAttention(block_size)
        # Blocks a sequence may publish to the prefix cache (None: all); fixed by the policy.
        self.publish_limit = self.policy.publishable_blocks()
        self.events = events
        # Groups share the pool and the hasher; each group's hash chain starts from its own root,
        # so the same tokens hash differently in each group (one pool-wide index, no cross-group hits).
        self.pool = pool if pool is not None else BlockPool(num_blocks, events)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher if hasher is not None else BlockHasher(block_size)
        self.chain_root = chain_root  # parent hash of block 0 (None: the hasher's own root)
        self.seqs: dict[str, SeqKV] = {}  # every sequence looked up or admitted, until freed
        self.stats = PrefixCacheStats()  # this group's copies (the coordinator counts the rest)
        # Copies the model runner must perform before the next forward pass: (src, dst) block ids.
        self.pending_copies: list[tuple[int, int]] = []
        # Sink sequences' kept keys to re-rotate (after the copies) before the next forward:
        # seq -> (block ids, shift).
        self.pending_rotations: dict[str, tuple[list[int], int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, list[Block | None]]:
        """Block table of every admitted sequence (a snapshot mapping; the lists are live)."""
        return {s: r.blocks for s, r in self.seqs.items() if r.admitted}

    @property
    def namespaces(self) -> dict[str, CacheNamespace]:
        return {s: r.namespace for s, r in self.seqs.items() if r.admitted}

    def record(self, seq_id: str) -> SeqKV:
        return self.seqs.setdefault(seq_id, SeqKV())

    def block_ids(self, seq_id: str) -> list[int | None]:
        rec = self.seqs.get(seq_id)
        return [] if rec is None else [b.block_id if b is not None else None for b in rec.blocks]

    def num_held_blocks(self, seq_id: str) -> int:
        rec = self.seqs.get(seq_id)
        return 0 if rec is None else len(rec.blocks) - self._num_released(rec)

    def _num_released(self, rec: SeqKV) -> int:
        return max(0, rec.released - self.policy.keep_head)

    def held_indices(self, seq_id: str, upto: int) -> list[int]:
        """Table indices below `upto` that still hold a block, in order."""
        head = self.policy.keep_head
        rec = self.seqs.get(seq_id)
        released = 0 if rec is None else self._num_released(rec)
        return list(range(min(head, upto))) + list(range(head + released, upto))

    def blocks_read(self, seq_id: str, upto: int) -> tuple[list[int], list[int] | None]:
        """Block ids a query reading table entries below `upto` walks (those still held), and
        their table indices when some were released (None: they are 0 .. upto - 1)."""
        rec = self.seqs[seq_id]
        if self._num_released(rec) == 0:
            return [rec.held(i).block_id for i in range(len(rec.blocks[:upto]))], None
        index = self.held_indices(seq_id, upto)
        return [rec.held(i).block_id for i in index], index

    def access(self, seq_id: str, start: int, end: int) -> tuple[list[int], list[int], list[int] | None]:
        """What computing positions [start, end) writes and reads in this group: (write slots,
        block ids read, their table indices or None)."""
        bs = self.block_size
        read, index = self.blocks_read(seq_id, -(-end // bs))
        rec = self.seqs[seq_id]
        return [rec.held(p // bs).block_id * bs + p % bs for p in range(start, end)], read, index

    def rope_offset(self, seq_id: str) -> int:
        rec = self.seqs.get(seq_id)
        return 0 if rec is None else rec.rope_offset

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, rec: SeqKV, token_ids: list[int], upto_blocks: int) -> list[bytes]:
        hashes = rec.hashes
        bs = self.block_size
        extra = self.hasher.extra_keys(rec.namespace)
        while len(hashes) < upto_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.chain_root
            hashes.append(self.hasher.hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def find_cached_prefix(self, seq_id: str, token_ids: list[int], namespace: CacheNamespace) -> list[Block]:
        """Longest run of cached full blocks, stopping at len - 1 tokens so the last prompt
        token is always computed and its logits exist."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        if self.publish_limit is not None:
            max_blocks = min(max_blocks, self.publish_limit)
        self._set_namespace(self.record(seq_id), namespace)
        cached = (self.cached_block(seq_id, token_ids, i) for i in range(max_blocks))  # lazily: stops at a miss
        return [b for b in takewhile(lambda b: b is not None, cached) if b is not None]  # (narrowed for mypy)

    def cached_block(self, seq_id: str, token_ids: list[int], index: int) -> Block | None:
        """Full block `index`'s cached block (or a KV tier's, loaded on admission) or None."""
        rec = self.record(seq_id)
        bs = self.block_size
        return self.pool.lookup(self._block_hashes(rec, token_ids, index + 1)[index],
                                tuple(token_ids[index * bs:(index + 1) * bs]), rec.namespace, self.group)

    @staticmethod
    def _set_namespace(rec: SeqKV, namespace: CacheNamespace) -> None:
        if rec.admitted and rec.namespace != namespace:
            raise BlockPoolError(f"a sequence's cache namespace cannot change while it holds blocks "
                                 f"({rec.namespace!r} -> {namespace!r})")
        if rec.namespace != namespace:  # hashes are keyed by it: another namespace's are no use
            rec.namespace, rec.hashes = namespace, []

    def hashes_completed_by(self, seq_id: str, token_ids: list[int], start: int, end: int) -> list[bytes]:
        """Hashes of the full blocks that computing tokens [start, end) will complete."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        first, last = -(-start // bs), end // bs
        if self.publish_limit is not None:
            last = min(last, self.publish_limit)  # the rest will never be published: nobody should wait for it
        if last <= first:
            return []
        return self._block_hashes(self.record(seq_id), token_ids, last)[first:last]

    def publish_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publish blocks whose KV is now written (called after the step that computed them)."""
        rec = self.seqs.get(seq_id)
        if not self.enable_prefix_caching or rec is None or not rec.blocks:
            return
        full = min(num_computed // self.block_size, len(rec.blocks))
        if self.publish_limit is not None:
            # Re-rotated keys no longer match their hash position-wise: a sink sequence
            # publishes only blocks computed before any masking, and nothing once it rotated.
            full = 0 if rec.rope_offset else min(full, self.publish_limit)
        if full <= rec.registered:
            return
        hashes = self._block_hashes(rec, token_ids, full)
        bs = self.block_size
        for i in range(rec.registered, full):
            block = rec.blocks[i]
            if block is not None and block.block_hash is None:
                self.pool.publish(block, hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]),
                                  hashes[i - 1] if i else self.chain_root, self.group)
        rec.registered = full

    # ---- admission (planned by the coordinator) ------------------------------------------------
    def adopt_hits(self, plan: AdmissionPlan) -> None:
        """The first half of a commit: the sequence's table starts as its prefix hits (revived
        from the free queue first, so no allocation can hand one of them out meanwhile)."""
        if plan.refusal is not None:
            raise BlockPoolError(f"admission of {plan.seq_id} committed though refused: {plan.refusal}")
        rec = self.record(plan.seq_id)
        if rec.admitted:
            raise BlockPoolError(f"sequence {plan.seq_id} admitted while it still holds blocks")
        self.events.record("admit", seq=plan.seq_id, **rec.namespace.event_fields())
        for block in plan.hits:
            if block is not None:
                self.events.record("cache_hit", block=block.block_id, seq=plan.seq_id)
                self.pool.incref(block, plan.seq_id)
        rec.blocks = list(plan.hits)
        rec.admitted = True
        rec.released = max((i + 1 for i, b in enumerate(plan.hits) if b is None), default=0)
        rec.registered = len(plan.hits)

    # ---- growth --------------------------------------------------------------------------
    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Make room for tokens [num_computed, num_computed + num_new_tokens). False if the pool
        cannot supply the blocks (nothing is changed then)."""
        rec = self.record(seq_id)
        table = rec.blocks
        needed, cow = self.slots_cost(seq_id, num_computed, num_new_tokens)
        if needed + (1 if cow else 0) > self.pool.num_free:
            return False
        if cow:
            self.copy_on_write(seq_id, num_computed // self.block_size)
        for _ in range(needed):
            table.append(self.pool.allocate(seq_id, rec.namespace))
        return True

    def slots_cost(self, seq_id: str, num_computed: int, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks, whether the first written block needs a private copy) that
        `allocate_slots` would take from the pool."""
        rec = self.record(seq_id)
        first = num_computed // self.block_size
        cow = first < len(rec.blocks) and rec.held(first).ref_count > 1
        return max(0, self.blocks_needed(num_computed + num_new_tokens) - len(rec.blocks)), cow

    def copy_on_write(self, seq_id: str, index: int) -> None:
        """A shared block is about to be written: this sequence gets a private copy first."""
        rec = self.seqs[seq_id]
        shared = rec.held(index)
        private = self.pool.allocate(seq_id, rec.namespace)
        self.events.record("cow", seq=seq_id, src=shared.block_id, dst=private.block_id)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.decref(shared, seq_id)
        rec.blocks[index] = private
        self.stats.cow_copies += 1
        # Hashes registered for this block index stay valid only for the shared original.
        rec.registered = min(rec.registered, index)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block; the first write into a shared one copies it."""
        child = self.seqs[parent_id].copy()
        self.events.record("fork", seq=child_id, parent=parent_id)
        for block in child.blocks:
            if block is not None:
                self.pool.incref(block, child_id)
        self.seqs[child_id] = child
        self.stats.forks += 1

    # ---- bounded KV (the policy) ----------------------------------------------------------
    def slide(self, seq_id: str, start: int) -> bool:
        """Before computing positions from `start`: release the blocks no query from there on
        reads and, for sink sequences, queue the re-rotation of the kept keys. False (with the
        releases done, nothing else changed) if a block to re-rotate needs a private copy and
        the pool has no free block for it."""
        rec = self.seqs.get(seq_id)
        if rec is None or not rec.blocks:
            return True
        policy, table = self.policy, rec.blocks
        end = min(policy.released_blocks(start), len(table))
        for i in range(max(policy.keep_head, rec.released), end):
            block = table[i]
            if block is not None:
                table[i] = None
                self.pool.decref(block, seq_id)
        rec.released = max(rec.released, end)
        offset = policy.rope_offset(start)
        old = rec.rope_offset
        if offset == old:
            return True
        # Kept non-sink blocks holding keys written so far (positions < start).
        kept = [i for i in range(max(policy.keep_head, end), min(-(-start // self.block_size), len(table)))
                if table[i] is not None]
        # Shared or published blocks are never changed in place: the rotation goes into a
        # private copy, and the original stays for its other holders or in the prefix cache.
        frozen = [i for i in kept if rec.held(i).ref_count > 1 or rec.held(i).block_hash is not None]
        if len(frozen) > self.pool.num_free:
            return False
        for i in frozen:
            self.copy_on_write(seq_id, i)
        self.pending_rotations[seq_id] = ([rec.held(i).block_id for i in kept], old - offset)
        rec.rope_offset = offset
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
        rec = self.seqs.pop(seq_id, None)
        self.pending_rotations.pop(seq_id, None)
        if rec is None:
            return
        # A copy-on-write queued this step for a sequence preempted in the same step: its
        # private target goes back to the pool (and may be handed to another sequence), so
        # the copy must not run.
        mine = {b.block_id for b in rec.blocks if b is not None}
        self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in mine]
        # Tail first, so a chain's tail blocks are the first to be evicted later.
        for block in reversed(rec.blocks):
            if block is not None:
                self.pool.decref(block, seq_id)
