"""Hybrid KV cache groups: a model whose layers mix attention types (global layers and sliding
windows, e.g. Gemma 3's 5 local : 1 global) keeps one block table per sequence per group of
layers, all over one pool.

Layers are split by attention type (full, window W), then each type's layers into groups of
`group_size` layers, the gcd of the per-type layer counts, so every group has the same number
of layers and every block (page) the same bytes: a block holds block_size tokens of KV for the
group_size layers of whichever group owns it. Layer L is (group g, slot j): it reads and
writes storage slot j at the block ids of group g's table. A window group releases the blocks
its window has passed, so a long sequence holds ceil(W / block_size) + 1 blocks there instead
of all of them; the global groups hold everything, as before.

Prefix caching: each group hashes the same token chain from its own root, so one pool-wide
hash index serves all groups without a cross-group hit. A hit of n blocks needs the global
groups' whole chain [0, n) and, in each window group, only the blocks covering the last window
before position n * block_size (the earlier ones may have been evicted; they are placeholders).

`GroupedKVCacheManager` has the manager's interface (what the scheduler, the engine and the
audit use); each group is a plain `KVCacheManager` over the shared pool. With one attention
type there is one group and the engine uses a `KVCacheManager` directly: nothing changes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import gcd

from kvshare.kvcache.block_pool import Block, BlockPool, BlockPoolError
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.events import EventLog, as_event_log
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_policy import FullAttention, SlidingWindow
from kvshare.kvcache.manager import KVCacheManager
from kvshare.kvcache.seq_kv import AdmissionPlan, PrefixCacheStats


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layers whose KV this group's blocks hold; layer layers[j] is slot j
    window: int | None  # None: global attention
    policy: FullAttention | SlidingWindow

    @property
    def size(self) -> int:
        return len(self.layers)


def plan_kv_groups(windows: list[int | None], block_size: int) -> list[KVCacheGroup] | None:
    """The groups for a model's per-layer windows (None: global), global groups first; None when
    every layer attends alike (one group: the plain manager)."""
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_type.setdefault(w, []).append(layer)
    if len(by_type) < 2:
        return None
    size = 0
    for layers in by_type.values():
        size = gcd(size, len(layers))
    groups = []
    for w in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[w]
        policy = FullAttention(block_size, size) if w is None else SlidingWindow((w,) * size, block_size)
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroup(tuple(layers[i:i + size]), w, policy))
    return groups


def layer_slots(groups: list[KVCacheGroup], num_layers: int) -> tuple[list[int], list[int]]:
    """(group of each layer, storage slot of each layer)."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of


def blocks_per_seq(groups: list[KVCacheGroup], block_size: int, num_tokens: int, chunk_tokens: int = 1) -> int:
    """Most blocks one sequence of `num_tokens` holds across all groups, computing chunks of up to
    `chunk_tokens` (1: decoding)."""
    full = -(-num_tokens // block_size)
    total = 0
    for g in groups:
        bound = g.policy.max_blocks_per_seq(chunk_tokens)
        total += full if bound is None else min(bound, full)
    return total


def _group_chain_root(hasher: BlockHasher, group: int) -> bytes | None:
    """Group 0 hashes from the hasher's root (as an ungrouped manager does); the others from a
    root of their own, derived from it."""
    if group == 0:
        return None
    return hashlib.sha256(hasher.root + b"kv-group" + group.to_bytes(4, "little")).digest()


class GroupedKVCacheManager:
    """One `KVCacheManager` per KV cache group over one pool; every operation on a sequence is
    applied to each group's table, and checks that span groups (room in the pool, prefix hits)
    are decided here, once, before any group changes."""

    def __init__(self, num_blocks: int, block_size: int, groups: list[KVCacheGroup],
                 enable_prefix_caching: bool = True, events: EventLog | None = None,
                 hasher: BlockHasher | None = None) -> None:
        self.block_size = block_size
        self.kv_groups = groups
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)
        self.hasher = hasher if hasher is not None else BlockHasher(block_size)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, events, g.policy,
                                      pool=self.pool, hasher=self.hasher,
                                      chain_root=_group_chain_root(self.hasher, i))
                       for i, g in enumerate(groups)]
        self._window_groups = [(m, g) for m, g in zip(self.groups, groups) if g.window is not None]
        self._global_groups = [m for m, g in zip(self.groups, groups) if g.window is None]
        self.stats = PrefixCacheStats()  # lookups and hits once per admission, not per group
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
        """Group 0's records (every admitted sequence has one in each group)."""
        return self.groups[0].seqs

    @property
    def tables(self) -> dict[str, list[Block | None]]:
        """Group 0's tables: which sequences are admitted (per group: `group_tables`)."""
        return self.groups[0].tables

    @property
    def group_tables(self) -> list[dict[str, list[Block | None]]]:
        return [m.tables for m in self.groups]

    @property
    def namespaces(self) -> dict[str, CacheNamespace]:
        return self.groups[0].namespaces

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

    def blocks_read(self, seq_id: str, upto: int) -> tuple[list[int], list[int] | None]:
        return self.groups[0].blocks_read(seq_id, upto)

    def access_by_group(self, seq_id: str, start: int, end: int) -> list[tuple[list[int], list[int], list[int] | None]]:
        return [m.access_by_group(seq_id, start, end)[0] for m in self.groups]

    def rope_offset(self, seq_id: str) -> int:
        return 0  # sinks are one policy over every layer: never grouped

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chunk_limit(self, start: int) -> int | None:
        return None

    def peak_blocks(self, decoding: bool, chunk_tokens: int, total_tokens: int) -> int | None:
        peaks = [m.peak_blocks(decoding, chunk_tokens, total_tokens) for m in self.groups]
        return None if any(p is None for p in peaks) else sum(peaks)

    def stats_dict(self) -> dict:
        s = self.stats
        return {
            "prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
            "blocks_shared": self.num_shared_blocks(), "cow_copies": sum(m.stats.cow_copies for m in self.groups),
            "forks": self.groups[0].stats.forks, "evictions": self.pool.num_evictions,
            "allocations": self.pool.num_allocations, "blocks_in_use": self.num_used_blocks(),
            "blocks_cached_free": self.pool.num_cached_free(), "blocks_total": self.num_blocks,
            "kv_cache_groups": self.num_groups,
        }

    def assert_idle_whole(self) -> None:
        held = [b.block_id for b in self.pool.blocks if b.ref_count != 0]
        tables = [s for m in self.groups for s in m.tables]
        if held or tables or self.pool.num_free != self.num_blocks:
            raise BlockPoolError(
                f"pool not whole when idle: referenced blocks {held[:10]}, tables {tables[:10]}, "
                f"free {self.pool.num_free} of {self.num_blocks}")

    # ---- prefix cache ---------------------------------------------------------------------------
    def find_cached_prefix(self, seq_id: str, token_ids: list[int],
                           namespace: CacheNamespace) -> list[list[Block | None]]:
        """Per group, the hits of the longest prefix every group can serve: the global groups'
        whole chain, the window groups' blocks inside the last window before it (None below)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        chains = [m.find_cached_prefix(seq_id, token_ids, namespace) for m in self._global_groups]
        for m in self.groups:
            m._set_namespace(m.record(seq_id), namespace)
        limit = min((len(c) for c in chains), default=(len(token_ids) - 1) // self.block_size)
        # Per window group: which of the first `limit` blocks are cached, and for each n the run
        # of cached blocks ending just before n.
        windows = []
        for m, g in self._window_groups:
            cached = m.cached_blocks(seq_id, token_ids, limit)
            run = [0] * (limit + 1)
            for i, b in enumerate(cached):
                run[i + 1] = run[i] + 1 if b is not None else 0
            windows.append((m, cached, run))
        n = limit
        while n > 0 and any(run[n] < n - m.policy.released_blocks(n * self.block_size) for m, _, run in windows):
            n -= 1
        hits_by_manager = {id(m): c[:n] for m, c in zip(self._global_groups, chains)}
        for m, cached, _ in windows:
            first = m.policy.released_blocks(n * self.block_size)
            hits_by_manager[id(m)] = [None] * first + cached[first:n]
        return [hits_by_manager[id(m)] for m in self.groups]

    def hashes_completed_by(self, seq_id: str, token_ids: list[int], start: int, end: int) -> list[bytes]:
        # Group 0's chain stands for all: every group computes the same positions in a step.
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

    # ---- admission ------------------------------------------------------------------------------
    def plan_admission(self, seq_id: str, token_ids: list[int], namespace: CacheNamespace, max_new_tokens: int,
                       use_cache: bool = True, inflight: set[bytes] | frozenset = frozenset()) -> AdmissionPlan:
        for m in self.groups:
            m._set_namespace(m.record(seq_id), namespace)
        group_hits = self.find_cached_prefix(seq_id, token_ids, namespace) if use_cache else [[] for _ in self.groups]
        num_hit = len(group_hits[0])
        num_computed = num_hit * self.block_size
        num_new = min(len(token_ids) - num_computed, max_new_tokens)
        lookup = len(token_ids) if use_cache and self.enable_prefix_caching else 0
        flat = [b for hits in group_hits for b in hits]
        plan = AdmissionPlan(seq_id, flat, num_computed, num_new, lookup, group_hits=group_hits)
        if use_cache and inflight and self.groups[0]._first_missing_hash(seq_id, token_ids, num_hit) in inflight:
            plan.refusal = "waits a step for a prefix block another sequence is computing"
            return plan
        needed = len(self.groups) * self.blocks_needed(num_computed + num_new) - len(flat)
        revived = sum(1 for b in flat if b is not None and b.ref_count == 0)
        if needed > self.pool.num_free - revived:
            plan.refusal = f"needs {needed} new blocks + {revived} revived ({self.num_groups} KV cache groups), " \
                           f"{self.pool.num_free} free"
        return plan

    def commit_admission(self, plan: AdmissionPlan) -> None:
        if plan.refusal is not None:
            raise BlockPoolError(f"admission of {plan.seq_id} committed though refused: {plan.refusal}")
        self.stats.queries += plan.num_lookup_tokens
        self.stats.hits += plan.num_computed if plan.num_lookup_tokens else 0
        # Every group's hits are revived before any group allocates: an allocation evicts from
        # the head of the free queue, where another group's cached hit may be waiting.
        for m, hits in zip(self.groups, plan.group_hits):
            m.adopt_hits(AdmissionPlan(plan.seq_id, hits, plan.num_computed, plan.num_new, plan.num_lookup_tokens))
        if not self.allocate_slots(plan.seq_id, plan.num_computed, plan.num_new):
            raise BlockPoolError(f"admission of {plan.seq_id}: the pool changed between plan and commit")

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
        for m in self.groups:
            m.fork(parent_id, child_id)

    def slide(self, seq_id: str, start: int) -> bool:
        ok = True
        for m in self.groups:
            ok = m.slide(seq_id, start) and ok
        return ok

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [c for m in self.groups for c in m.take_pending_copies()]

    def take_pending_rotations(self) -> list[tuple[str, list[int], int]]:
        return [r for m in self.groups for r in m.take_pending_rotations()]

    def free(self, seq_id: str) -> None:
        """The one release path, in every group."""
        for m in self.groups:
            m.free(seq_id)
