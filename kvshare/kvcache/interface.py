"""What the scheduler and the engine may ask of the KV core: exactly the members they use, so a
second implementation (a tiered pool, a remote core) knows what it must provide. The one
implementation is `KVCacheCoordinator` (kvshare/kvcache/coordinator.py), over N >= 1 groups.

Outside this interface the coordinator also offers reads for the audit, the live view and tests
(`group_tables`, `namespaces`, `hasher`, `block_size`, `num_blocks`, `stats`, `stats_dict`,
`num_shared_blocks`, `assert_idle_whole`, `block_ids`, `groups`, `num_groups`)."""
from __future__ import annotations

from typing import Protocol

from kvshare.kvcache.block_pool import Block, BlockPool
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.events import EventLog, NullEventLog
from kvshare.kvcache.seq_kv import AdmissionPlan

# Per KV cache group: (write slots, block ids read, their table indices or None: 0 .. n - 1).
GroupAccessTuple = tuple[list[int], list[int], list[int] | None]


class KVCore(Protocol):
    # ---- admission (the scheduler) -----------------------------------------------------------
    def plan_admission(self, seq_id: str, token_ids: list[int], namespace: CacheNamespace, max_new_tokens: int,
                       use_cache: bool = True, inflight: set[bytes] | frozenset = frozenset()) -> AdmissionPlan:
        """What admitting the sequence now would reuse and allocate, or why it must wait (`refusal`)."""
        ...

    def commit_admission(self, plan: AdmissionPlan) -> None:
        """Carry out a plan from `plan_admission` of this same step."""
        ...

    def hashes_completed_by(self, seq_id: str, token_ids: list[int], start: int, end: int) -> list[bytes]:
        """Hashes of the full blocks computing [start, end) completes (in flight this step)."""
        ...

    # ---- growth and release (the scheduler) -------------------------------------------------
    def slide(self, seq_id: str, start: int) -> bool:
        """Before computing from `start`: release what no later query reads; False: no room."""
        ...

    def allocate_slots(self, seq_id: str, num_computed: int, num_new_tokens: int) -> bool:
        """Room for [num_computed, num_computed + num_new_tokens) in every group, or False (no change)."""
        ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def free(self, seq_id: str) -> None:
        """The one release path: finish, abort and preemption."""
        ...

    def publish_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """After a step: blocks whose KV is now written become prefix-cache hits."""
        ...

    def release_behind(self, seq_id: str, num_computed: int) -> None:
        """After a step (and its publishing): let go of blocks no later query reads, where due."""
        ...

    # ---- what a step does (the scheduler builds the step plan from these) --------------------
    def access_by_group(self, seq_id: str, start: int, end: int) -> list[GroupAccessTuple]: ...

    def rope_offset(self, seq_id: str) -> int: ...

    def take_pending_copies(self) -> list[tuple[int, int]]: ...

    def take_pending_rotations(self) -> list[tuple[str, list[int], int]]: ...

    def take_tier_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[tuple[str, bytes, int]]]:
        """(stores, loads, drops) between the pool and the KV tiers, for the next forward."""
        ...

    # ---- limits (the scheduler's admission and chunking) ------------------------------------
    def chunk_limit(self, start: int) -> int | None: ...

    def peak_blocks(self, decoding: bool, chunk_tokens: int, total_tokens: int) -> int | None: ...

    def num_held_blocks(self, seq_id: str, group: int | None = None) -> int: ...

    def num_free_blocks(self) -> int: ...

    def num_used_blocks(self) -> int: ...

    # ---- the engine ------------------------------------------------------------------------
    @property
    def events(self) -> EventLog | NullEventLog:
        """The block event log (a NullEventLog records nothing); the engine installs its own."""
        ...

    @events.setter
    def events(self, log: EventLog | NullEventLog | None) -> None: ...

    @property
    def tables(self) -> dict[str, list[Block | None]]:
        """Admitted sequences' tables (the engine checks it is idle: none)."""
        ...

    @property
    def pool(self) -> BlockPool:
        """The engine installs the KV event queue and the event log on it and resets the prefix cache."""
        ...
