"""The manager's records: one sequence's KV state, an admission plan, prefix-cache counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.kvcache.block_pool import Block
from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens served from cache
    cow_copies: int = 0
    forks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SeqKV:
    """Everything the manager knows about one sequence's KV."""

    namespace: CacheNamespace = DEFAULT_NAMESPACE  # blocks it allocates carry it, hits must match it
    blocks: list[Block | None] = field(default_factory=list)  # the table; None: released
    # Released entries always form one run [policy.keep_head, released): windows only move
    # forward. Kept so that per-step work does not grow with the sequence's length.
    released: int = 0
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks, so far
    registered: int = 0  # leading blocks already published to the prefix cache
    rope_offset: int = 0  # text position minus cache position of new tokens (sinks)
    admitted: bool = False

    def held(self, index: int) -> Block:
        """Table entry `index`, which the caller knows is held (not released)."""
        block = self.blocks[index]
        assert block is not None, f"table entry {index} was released"
        return block

    def copy(self) -> "SeqKV":
        return SeqKV(self.namespace, list(self.blocks), self.released, list(self.hashes), self.registered,
                     self.rope_offset, self.admitted)


@dataclass
class AdmissionPlan:
    """What admitting a waiting sequence would do (`KVCacheManager.plan_admission`); commit it
    with `commit_admission` in the same step, before anything else changes the pool."""

    seq_id: str
    hits: list[Block | None]  # prefix-cache blocks to share (None: a hit no query reads)
    num_computed: int  # tokens the hits cover
    num_new: int  # tokens to compute this step
    num_lookup_tokens: int  # tokens looked up in the prefix cache (0: the cache is not used)
    refusal: str | None = None  # why not now (None: it fits)
    short_of_blocks: bool = False  # refused for want of free blocks (freeing some could help)
    # KV cache groups (kv_groups.py): each group's hits; `hits` is then all of them together.
    group_hits: list[list[Block | None]] | None = None
