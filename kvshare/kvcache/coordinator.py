"""The KV core: one coordinator over one block manager per KV cache group, all over one pool.

Every model is planned as N >= 1 groups (kvshare/kvcache/kv_groups.py): a model whose layers all
attend alike is one group, a hybrid (Gemma 3's 5 local : 1 global) one group per attention type
and layer slice. Every operation on a sequence is applied to each group's table, and checks that
span groups (room in the pool, prefix hits) are decided here, once, before any group changes.
This is the one place that knows how many groups there are; the scheduler and the engine see the
`KVCore` interface (kvshare/kvcache/interface.py).

Prefix hits of several groups: each group hashes the same token chain from its own root, so one
pool-wide hash index serves all groups without a cross-group hit. A hit of n blocks needs the
global groups' whole chain [0, n) and, in each window group, only the blocks covering the last
window before position n * block_size (the earlier ones may have been evicted). A single group
keeps the whole-chain rule whatever its policy.
"""
from __future__ import annotations

import hashlib

from kvshare.kvcache.block_pool import Block, BlockPool, BlockPoolError, EvictHook, TierBlock
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.events import EventLog, as_event_log
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_groups import KVCacheGroup
from kvshare.kvcache.manager import KVCacheManager
from kvshare.kvcache.seq_kv import AdmissionPlan, PrefixCacheStats


def _group_chain_root(hasher: BlockHasher, group: int) -> bytes | None:
    """Group 0 hashes from the hasher's root; the others from a root of their own, derived from it
    (so a single-group engine's hashes are the hasher's plain chain)."""
    if group == 0:
        return None
    return hashlib.sha256(hasher.root + b"kv-group" + group.to_bytes(4, "little")).digest()


class KVCacheCoordinator:
    """One `KVCacheManager` per KV cache group over one pool."""

    def __init__(self, num_blocks: int, block_size: int, groups: list[KVCacheGroup],
                 enable_prefix_caching: bool = True, events: EventLog | None = None,
                 hasher: BlockHasher | None = None,
                 on_evict: EvictHook | None = None) -> None:
        if not groups:
            raise ValueError("a KV core needs at least one KV cache group")
        self.block_size = block_size
        self.kv_groups = groups
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events, on_evict=on_evict)
        self.hasher = hasher if hasher is not None else BlockHasher(block_size)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, events, g.policy,
                                      pool=self.pool, hasher=self.hasher,
                                      chain_root=_group_chain_root(self.hasher, i), group=i)
                       for i, g in enumerate(groups)]
        several = len(groups) > 1
        # Window groups beside other groups take partial prefix hits and let go of what their window
        # passed right after each step; a single group keeps the plain manager's rules (whole-chain
        # hits, releases at its next `slide`), so a one-type engine behaves as it always did.
        self._window_groups = [(m, g) for m, g in zip(self.groups, groups) if several and g.window is not None]
        self._chain_groups = [m for m in self.groups if m not in [w for w, _ in self._window_groups]]
        self._queries = self._hits = self._forks = 0  # once per admission / fork, not per group
        self._events = as_event_log(events)

    # ---- the event log: one for the pool and every group ------------------------------------
    @property
    def events(self):
        return self._events

    @events.setter
    def events(self, log) -> None:
        self._events = as_event_log(log)
        for m in self.groups:
            m.events = log

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def seqs(self):
        """The first group's records (every admitted sequence has one in each group)."""
        return self.groups[0].seqs

    @property
    def tables(self) -> dict[str, list[Block | None]]:
        """The first group's tables: which sequences are admitted (per group: `group_tables`)."""
        return self.groups[0].tables

    @property
    def group_tables(self) -> list[dict[str, list[Block | None]]]:
        return [m.tables for m in self.groups]

    @property
    def namespaces(self) -> dict[str, CacheNamespace]:
        return self.groups[0].namespaces

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, sum(m.stats.cow_copies for m in self.groups), self._forks)

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        """Copies queued for the next forward pass (a snapshot; `take_pending_copies` hands them over)."""
        return [c for m in self.groups for c in m.pending_copies]

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def num_shared_blocks(self) -> int:
        return sum(1 for b in self.pool.blocks if b.ref_count > 1)

    def block_ids(self, seq_id: str, group: int = 0) -> list[int | None]:
        return self.groups[group].block_ids(seq_id)

    def num_held_blocks(self, seq_id: str, group: int | None = None) -> int:
        """Blocks the sequence holds in one group, or in all of them (None)."""
        if group is not None:
            return self.groups[group].num_held_blocks(seq_id)
        return sum(m.num_held_blocks(seq_id) for m in self.groups)

    def access_by_group(self, seq_id: str, start: int, end: int) -> list[tuple[list[int], list[int], list[int] | None]]:
        """What computing positions [start, end) writes and reads, per group: (write slots, block
        ids read, their table indices or None)."""
        return [m.access(seq_id, start, end) for m in self.groups]

    def rope_offset(self, seq_id: str) -> int:
        return max(m.rope_offset(seq_id) for m in self.groups)  # sinks are one policy over every layer

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chunk_limit(self, start: int) -> int | None:
        """Tokens a chunk from `start` may hold (None: any), e.g. sinks: RoPE positions left."""
        limits = [lim for m in self.groups if (lim := m.policy.chunk_limit(start)) is not None]
        return min(limits, default=None)

    def peak_blocks(self, decoding: bool, chunk_tokens: int, total_tokens: int) -> int | None:
        """Most blocks a sequence of up to `total_tokens` can hold from now on, over all groups,
        under bounded-KV policies (None: unbounded)."""
        total = 0
        for m in self.groups:
            policy = m.policy
            bound = policy.decode_blocks if decoding else policy.max_blocks_per_seq(chunk_tokens)
            if bound is None:
                return None
            total += min(bound, self.blocks_needed(total_tokens))
        return total

    def stats_dict(self) -> dict:
        s = self.stats
        return {
            "prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
            "blocks_shared": self.num_shared_blocks(), "cow_copies": s.cow_copies,
            "forks": s.forks, "evictions": self.pool.num_evictions,
            "allocations": self.pool.num_allocations, "blocks_in_use": self.num_used_blocks(),
            "blocks_cached_free": self.pool.num_cached_free(), "blocks_total": self.num_blocks,
            "kv_cache_groups": self.num_groups,
        }

    def assert_idle_whole(self) -> None:
        """When nothing runs: no block referenced, every block free (cached or not)."""
        held = [b.block_id for b in self.pool.blocks if b.ref_count != 0]
        tables = [s for m in self.groups for s in m.tables]
        if held or tables or self.pool.num_free != self.num_blocks:
            raise BlockPoolError(
                f"pool not whole when idle: referenced blocks {held[:10]}, tables {tables[:10]}, "
                f"free {self.pool.num_free} of {self.num_blocks}")

    # ---- prefix cache ---------------------------------------------------------------------------
    def find_cached_prefix(self, seq_id: str, token_ids: list[int], namespace: CacheNamespace) -> list[list[Block | None]]:
        """Per group, the hits of the longest prefix every group can serve: the chain groups' whole
        chain (None where no query from there on reads a block), the window groups' blocks inside
        the last window before it (None below)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        chains = [m.find_cached_prefix(seq_id, token_ids, namespace) for m in self._chain_groups]
        for m in self.groups:
            m._set_namespace(m.record(seq_id), namespace)
        limit = min((len(c) for c in chains), default=(len(token_ids) - 1) // self.block_size)
        # The longest n <= limit for which every window group holds the blocks inside the last
        # window before n. Each block is looked up at most once, nearest to n first (a miss there
        # rules out the most), so a window group never asks the KV tiers for (nor loads from disk)
        # a block behind its window.
        windows: list[tuple[KVCacheManager, dict[int, Block | None]]] = [(m, {}) for m, _ in self._window_groups]
        n = limit
        while n > 0:
            missing = next((i for m, found in windows
                            for i in range(n - 1, m.policy.released_blocks(n * self.block_size) - 1, -1)
                            if self._window_block(m, found, seq_id, token_ids, i) is None), None)
            if missing is None:
                break
            n = missing  # every n' > missing still needs block `missing`
        hits_by_manager: dict[int, list[Block | None]] = {}
        for m, chain in zip(self._chain_groups, chains):
            # Hits no query from n on reads become placeholders: neither revived nor counted.
            head, end = m.policy.keep_head, min(m.policy.released_blocks(n * self.block_size), n)
            hits_by_manager[id(m)] = [None if head <= i < end else b for i, b in enumerate(chain[:n])]
        for m, found in windows:
            first = m.policy.released_blocks(n * self.block_size)
            hits_by_manager[id(m)] = [None if i < first else found[i] for i in range(n)]
        return [hits_by_manager[id(m)] for m in self.groups]

    @staticmethod
    def _window_block(m: KVCacheManager, found: dict[int, Block | None], seq_id: str, token_ids: list[int],
                      index: int) -> Block | None:
        if index not in found:
            found[index] = m.cached_block(seq_id, token_ids, index)
        return found[index]

    def hashes_completed_by(self, seq_id: str, token_ids: list[int], start: int, end: int) -> list[bytes]:
        # The first group's chain stands for all: every group computes the same positions in a step.
        return self.groups[0].hashes_completed_by(seq_id, token_ids, start, end)

    def publish_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        for m in self.groups:
            m.publish_full_blocks(seq_id, token_ids, num_computed)

    def release_behind(self, seq_id: str, num_computed: int) -> None:
        """After the step that computed up to `num_computed` (and published what it filled): the
        window groups let go of blocks no later query reads, so a long prefill chunk's early
        blocks are back in the pool (still cached) before the next step is planned."""
        for m, _ in self._window_groups:
            m.slide(seq_id, num_computed)

    def drop_adapter(self, adapter: str) -> int:
        """Forget the unheld cached blocks of one LoRA adapter (its cache key), keeping none of
        them in a tier (evictions while the tiers are suspended forget), and the tiers' copies of
        its blocks (RAM and disk). Returns how many blocks and tier entries went."""
        tiers = self.pool.tiers
        if tiers is None:
            return self.pool.drop_adapter(adapter)
        tiers.suspended = True
        try:
            dropped = self.pool.drop_adapter(adapter)
        finally:
            tiers.suspended = False
        return dropped + tiers.drop_adapter(adapter)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks nobody holds, and the RAM tier with them (the disk tier is
        kept: `kvshare cache clear` empties it)."""
        tiers = self.pool.tiers
        if tiers is None:
            self.pool.reset_prefix_cache()
            return
        tiers.suspended = True
        try:
            self.pool.reset_prefix_cache()
        finally:
            tiers.suspended = False
        tiers.clear_ram()

    def take_tier_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[tuple[str, bytes, int]]]:
        """(stores, loads, drops) between the pool and the KV tiers the next forward performs first."""
        tiers = self.pool.tiers
        return ([], [], []) if tiers is None else tiers.take_transfers()

    # ---- admission ------------------------------------------------------------------------------
    def plan_admission(self, seq_id: str, token_ids: list[int], namespace: CacheNamespace, max_new_tokens: int,
                       use_cache: bool = True, inflight: set[bytes] | frozenset = frozenset()) -> AdmissionPlan:
        """What admitting this sequence now would reuse and allocate, or why it must wait:
        a block it would compute first is being computed by another sequence this step (it
        waits one step and hits instead), or the pool cannot supply its blocks."""
        for m in self.groups:
            m._set_namespace(m.record(seq_id), namespace)
        group_hits = self.find_cached_prefix(seq_id, token_ids, namespace) if use_cache else [[] for _ in self.groups]
        num_hit = len(group_hits[0])
        num_computed = num_hit * self.block_size
        num_new = min(len(token_ids) - num_computed, max_new_tokens)
        limit = self.chunk_limit(num_computed)
        if limit is not None:
            num_new = min(num_new, limit)
        lookup = len(token_ids) if use_cache and self.enable_prefix_caching else 0
        flat = [b for hits in group_hits for b in hits]
        plan = AdmissionPlan(seq_id, flat, num_computed, num_new, lookup, group_hits=group_hits)
        if use_cache and inflight and self._first_missing_hash(seq_id, token_ids, num_hit) in inflight:
            plan.refusal = "waits a step for a prefix block another sequence is computing"
            return plan
        loads = sum(1 for b in flat if isinstance(b, TierBlock))  # each takes a free block
        needed = len(self.groups) * self.blocks_needed(num_computed + num_new) - len(flat) + loads
        revived = sum(1 for b in flat if b is not None and b.ref_count == 0 and not isinstance(b, TierBlock))
        if needed > self.pool.num_free - revived:
            groups = f" ({self.num_groups} KV cache groups)" if self.num_groups > 1 else ""
            plan.refusal = f"needs {needed} new blocks + {revived} revived{groups}, {self.pool.num_free} free"
            plan.short_of_blocks = True
        return plan

    def _first_missing_hash(self, seq_id: str, token_ids: list[int], num_cached_blocks: int) -> bytes | None:
        """Hash (in the first group's chain, as `hashes_completed_by`) of the block an admission
        would compute first, if that block is full."""
        if not self.enable_prefix_caching or (num_cached_blocks + 1) * self.block_size > len(token_ids) - 1:
            return None
        m = self.groups[0]
        return m._block_hashes(m.record(seq_id), token_ids, num_cached_blocks + 1)[num_cached_blocks]

    def commit_admission(self, plan: AdmissionPlan) -> None:
        if plan.refusal is not None:
            raise BlockPoolError(f"admission of {plan.seq_id} committed though refused: {plan.refusal}")
        self._queries += plan.num_lookup_tokens
        self._hits += plan.num_computed if plan.num_lookup_tokens else 0
        # Every group's hits are revived before any group allocates: an allocation evicts from
        # the head of the free queue, where another group's cached hit may be waiting.
        for m, hits in zip(self.groups, self._load_tier_hits(plan.group_hits or [plan.hits])):
            m.adopt_hits(AdmissionPlan(plan.seq_id, hits, plan.num_computed, plan.num_new, plan.num_lookup_tokens))
        if not self.allocate_slots(plan.seq_id, plan.num_computed, plan.num_new):
            raise BlockPoolError(f"admission of {plan.seq_id}: the pool changed between plan and commit")

    def _load_tier_hits(self, group_hits: list[list[Block | None]]) -> list[list[Block | None]]:
        """Tier hits become pool blocks (their loads queued for the next forward), after the pool's
        own hits are pinned out of the free queue, where taking a block could evict them."""
        loaded = {i for hits in group_hits for i, b in enumerate(hits) if isinstance(b, TierBlock)}
        tiers = self.pool.tiers
        if not loaded or tiers is None:
            return group_hits
        tiers.hit_tokens += len(loaded) * self.block_size  # positions, not blocks of every group
        for hits in group_hits:
            for b in hits:
                if b is not None and not isinstance(b, TierBlock) and b.ref_count == 0:
                    self.pool.pin(b)
        return [[self.pool.take_for_load(b) if isinstance(b, TierBlock) else b for b in hits] for hits in group_hits]

    # ---- growth, forks, windows, release ----------------------------------------------------------
    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """All groups or none: False (nothing changed) if the pool cannot supply every group."""
        cost = 0
        for m in self.groups:
            needed, cow = m.slots_cost(seq_id, num_computed, num_new_tokens)
            cost += needed + (1 if cow else 0)
        if cost > self.pool.num_free:
            return False
        for m in self.groups:
            if not m.allocate_slots(seq_id, num_computed, num_new_tokens):
                raise BlockPoolError(f"{seq_id}: a KV cache group found no room after the pool was checked")
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block; the first write into a shared one copies it."""
        for m in self.groups:
            m.fork(parent_id, child_id)
        self._forks += 1

    def slide(self, seq_id: str, start: int) -> bool:
        """Before computing positions from `start`: each group releases what its policy lets go
        of. False if a group needs a private copy the pool cannot supply (see KVCacheManager.slide)."""
        ok = True
        for m in self.groups:
            ok = m.slide(seq_id, start) and ok
        return ok

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [c for m in self.groups for c in m.take_pending_copies()]

    def take_pending_rotations(self) -> list[tuple[str, list[int], int]]:
        return [r for m in self.groups for r in m.take_pending_rotations()]

    def free(self, seq_id: str) -> None:
        """The one release path (finish, abort, preemption), in every group."""
        for m in self.groups:
            m.free(seq_id)
