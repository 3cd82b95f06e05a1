"""KV tiers under the pool: which evicted prefix blocks are kept in host RAM and on disk (the
bookkeeping only: no tensors, no files; the bytes move on the runner's side,
kvshare/engine/kv_tier_store.py, as the step plan says).

A cached block the pool evicts (`BlockPool.evict`'s hook) is queued for a store: before the next
forward overwrites it, the runner copies its KV into the RAM tier and, write-through, into the
disk tier. Each tier keeps least recently used entries out first, within a budget in blocks; an
entry pushed out is queued for a drop. A prefix lookup that misses the pool asks `find`: a RAM
entry is a hit at once; a disk entry is read back and validated into RAM first (`fetch`, the
byte store's), and anything that does not match is a miss, counted by reason. A hit is a
`TierBlock`, a block whose KV is still outside the pool; admitting it takes a free pool block for
it (`BlockPool.take_for_load`) and queues the load, which the runner performs before the
forward, so no query reads a half-loaded block.

Within one step the runner applies stores, then loads, then drops: a block evicted and
re-handed-out in the same step is saved before it is overwritten, a key stored and loaded in the
same step is there for the load, and a drop never takes what this step loads. A key dropped and
stored again in the same step cancels its drop.

Every entry keeps what makes its KV valid for a request: its token ids, its parent hash and the
hash of its namespace key; `find` recomputes the chain hash from them under the requester's
namespace, so no tenant's block is a hit for another (the hash already covers the salt: this is
the proof, not the lookup).

Every entry belongs to one KV cache group (a hybrid model's groups each hash the same tokens
from their own root, kvshare/kvcache/coordinator.py): the group is kept with the entry, written
in the file's name and header, and a lookup asks for one group's block. Which groups' blocks a
prefix hit needs (a window group only those inside its window) is the coordinator's rule, the
same for the pool and the tiers.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

from kvshare.kvcache.block_pool import Block, BlockPool, TierBlock
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.hashing import BlockHasher

logger = logging.getLogger("kvshare")

RAM_TIER = "cpu"
DISK_TIER = "disk"
# vLLM's KV events carry where a block lives (`medium`); the pool itself is "CPU" in kvshare.
TIER_MEDIUM = {RAM_TIER: "CPU_TIER", DISK_TIER: "DISK"}


def namespace_key_hash(namespace: CacheNamespace) -> str:
    """What a tier entry and a disk header keep of a namespace: the hash of its block-hash key
    (never the salt itself: a file on disk must not name a tenant's salt)."""
    return hashlib.sha256(BlockHasher.extra_keys(namespace)).hexdigest()


@dataclass(frozen=True)
class TierEntry:
    token_ids: tuple[int, ...]
    parent_hash: bytes | None
    namespace_hash: str  # namespace_key_hash of the namespace the KV was computed under
    group: int = 0  # the KV cache group whose layers' KV it holds
    # The LoRA adapter's cache key the KV was computed under (None: the base model), so unloading
    # the adapter finds its entries (the namespace hash also covers the salt, so it cannot).
    adapter: str | None = None


# (hash, what the entry says) -> None when the bytes are in RAM now and valid, else why not.
FetchHook = Callable[[bytes, dict], "str | None"]
# (tier, hash, KV cache group): an entry a tier lets go of, for the byte store to forget.
TierDrop = tuple[str, bytes, int]


class KVTiers:
    def __init__(self, pool: BlockPool, hasher: BlockHasher, ram_blocks: int, disk_blocks: int,
                 fetch: FetchHook | None = None, discover: Callable[[bytes, int], dict | None] | None = None) -> None:
        self.pool = pool
        self.hasher = hasher
        self.ram_blocks = ram_blocks
        self.disk_blocks = disk_blocks
        self.fetch = fetch  # the byte store's disk -> RAM read with validation (None: no disk tier)
        self.discover = discover  # the byte store's header read of a file no index lists (None: none)
        self.ram: OrderedDict[bytes, TierEntry] = OrderedDict()  # head: least recently used
        self.disk: OrderedDict[bytes, TierEntry] = OrderedDict()
        self._stores: list[tuple[int, bytes]] = []
        self._loads: list[tuple[int, bytes]] = []
        self._drops: list[TierDrop] = []
        self.suspended = False  # reset_prefix_cache: evictions that forget, not keep
        self.hits: Counter[str] = Counter()  # blocks loaded back, by tier
        # Prompt tokens whose KV came from a tier (in some KV cache group): vLLM's external hits.
        self.hit_tokens = 0
        self.stores = 0
        self.rejected: Counter[str] = Counter()  # disk entries that failed validation, by reason
        self._logged: set[str] = set()
        pool.on_evict.append(self.on_evict)
        pool.tiers = self

    # ---- the pool's side ------------------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        if not self.suspended:
            self.keep(block_id, block_hash)

    def persist_pool(self) -> None:
        """At a clean shutdown: every block the pool still caches goes to the disk tier too (they
        were never evicted, so never written), for the next start to find."""
        if self.disk_blocks:
            for block_hash, block_id in list(self.pool.cached.items()):
                self.keep(block_id, block_hash)

    def keep(self, block_id: int, block_hash: bytes) -> None:
        """Queue a store of a cached pool block's KV into the tiers (before anything overwrites it)."""
        block = self.pool.blocks[block_id]
        if block.token_ids is None:
            return
        entry = TierEntry(block.token_ids, block.parent_hash, namespace_key_hash(block.namespace), block.group,
                          block.namespace.adapter)
        if block_hash in self.ram and (not self.disk_blocks or block_hash in self.disk):
            self._touch(block_hash)  # already kept (it was loaded from here): the same bytes
            return
        self._stores.append((block_id, block_hash))
        self.stores += 1
        self.pool.events.record("tier_store", block=block_id, hash=block_hash.hex()[:16], group=block.group)
        self._put(RAM_TIER, block_hash, entry)
        if self.disk_blocks:
            self._put(DISK_TIER, block_hash, entry)

    def find(self, block_hash: bytes, token_ids: tuple[int, ...], namespace: CacheNamespace,
             group: int = 0) -> TierBlock | None:
        """KV cache group `group`'s block for a pool miss, or None. A disk entry is fetched into RAM
        (and validated) here, so the load the admission queues reads RAM only."""
        for tier, entries in ((RAM_TIER, self.ram), (DISK_TIER, self.disk)):
            entry = entries.get(block_hash)
            if entry is None or entry.token_ids != token_ids:
                continue
            if entry.group != group:
                self._reject(tier, block_hash, f"foreign header: KV cache group {entry.group}, asked for {group}")
                continue
            if entry.namespace_hash != namespace_key_hash(namespace) or self.hasher.hash_block(
                    entry.parent_hash, token_ids, self.hasher.extra_keys(namespace)) != block_hash:
                self._reject(tier, block_hash, "entry does not hash to its name under this namespace")
                continue
            if tier == DISK_TIER and block_hash not in self.ram:
                why = self.fetch(block_hash, self._expected(block_hash, entry)) if self.fetch else "no byte store"
                if why is not None:
                    self._reject(DISK_TIER, block_hash, why)
                    return None
                self._put(RAM_TIER, block_hash, entry)
            self._touch(block_hash)
            return TierBlock(-1, block_hash=block_hash, token_ids=token_ids, parent_hash=entry.parent_hash,
                             namespace=namespace, group=group, tier=tier)
        return self._discover(block_hash, token_ids, namespace, group)

    def _discover(self, block_hash: bytes, token_ids: tuple[int, ...], namespace: CacheNamespace,
                  group: int) -> TierBlock | None:
        """A block file this engine's index does not list (another engine sharing the directory
        wrote it since the start-up scan): adopted when its header is this engine's and it hashes
        to its name under the requester's namespace, then fetched like any disk entry."""
        header = self.discover(block_hash, group) if self.discover is not None else None
        if header is None:
            return None
        parent = bytes.fromhex(header["parent"]) if header.get("parent") else None
        if tuple(header.get("tokens", ())) != token_ids:
            return None
        self.disk[block_hash] = TierEntry(token_ids, parent, str(header.get("namespace")), group, header.get("adapter"))
        found = self.find(block_hash, token_ids, namespace, group)
        if found is not None:
            self._put(DISK_TIER, block_hash, self.disk[block_hash])  # within the budget, as any entry
        return found

    def loaded(self, block: Block, hit: TierBlock) -> None:
        """An admission took pool block `block` for `hit`: the runner loads it before the forward."""
        self._loads.append((block.block_id, hit.block_hash or b""))
        self.hits[hit.tier] += 1

    # ---- the step plan's side -------------------------------------------------------------------
    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[TierDrop]]:
        """(stores, loads, drops) for the runner, in the order it applies them."""
        out = (self._stores, self._loads, self._drops)
        self._stores, self._loads, self._drops = [], [], []
        return out

    def has_transfers(self) -> bool:
        return bool(self._stores or self._loads or self._drops)

    def describe(self, block_hash: bytes) -> dict | None:
        """What a disk header records of an entry (the byte store asks when it writes the file);
        None when both tiers let it go again in the step that stored it (nothing to write)."""
        entry = self.ram.get(block_hash) or self.disk.get(block_hash)
        return None if entry is None else self._expected(block_hash, entry)

    def adopt_disk(self, found: list[tuple[bytes, TierEntry]]) -> None:
        """At start-up: the disk tier's valid files, oldest first (a restart with a hash seed)."""
        for block_hash, entry in found:
            self._put(DISK_TIER, block_hash, entry)

    def drop_adapter(self, adapter: str) -> int:
        """Forget every entry (RAM and disk) computed under this LoRA adapter (its cache key), when
        it is unloaded; the runner deletes the bytes and files with the next step's drops."""
        dropped = 0
        for tier, entries in ((RAM_TIER, self.ram), (DISK_TIER, self.disk)):
            for block_hash, entry in [(h, e) for h, e in entries.items() if e.adapter == adapter]:
                del entries[block_hash]
                self._drops.append((tier, block_hash, entry.group))
                self.pool.prefix_updates.removed(block_hash, TIER_MEDIUM[tier])
                self.pool.events.record("tier_drop", hash=block_hash.hex()[:16], tier=tier, group=entry.group)
                dropped += 1
        return dropped

    def clear_ram(self) -> None:
        for block_hash, entry in self.ram.items():
            self._drops.append((RAM_TIER, block_hash, entry.group))
            self.pool.prefix_updates.removed(block_hash, TIER_MEDIUM[RAM_TIER])
        self.ram.clear()

    # ---- counters -------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"ram_blocks": len(self.ram), "ram_capacity_blocks": self.ram_blocks,
                "disk_blocks": len(self.disk), "disk_capacity_blocks": self.disk_blocks,
                "hits_ram": self.hits[RAM_TIER], "hits_disk": self.hits[DISK_TIER], "hit_tokens": self.hit_tokens,
                "stores": self.stores,
                "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected)}

    # ---- internals -------------------------------------------------------------------------------
    def _put(self, tier: str, block_hash: bytes, entry: TierEntry) -> None:
        entries = self.ram if tier == RAM_TIER else self.disk
        cap = self.ram_blocks if tier == RAM_TIER else self.disk_blocks
        if (tier, block_hash, entry.group) in self._drops:
            self._drops.remove((tier, block_hash, entry.group))  # dropped earlier this step: it stays after all
        if block_hash not in entries:  # routers learn where it lives (vLLM's KV events' `medium`)
            self.pool.prefix_updates.stored(block_hash, entry.parent_hash, entry.token_ids, TIER_MEDIUM[tier])
        entries[block_hash] = entry
        entries.move_to_end(block_hash)
        while len(entries) > cap:
            old, gone = entries.popitem(last=False)
            self._drops.append((tier, old, gone.group))
            self.pool.prefix_updates.removed(old, TIER_MEDIUM[tier])
            self.pool.events.record("tier_drop", hash=old.hex()[:16], tier=tier, group=gone.group)

    def _touch(self, block_hash: bytes) -> None:
        for entries in (self.ram, self.disk):
            if block_hash in entries:
                entries.move_to_end(block_hash)

    def _expected(self, block_hash: bytes, entry: TierEntry) -> dict:
        return {"hash": block_hash.hex(), "parent": entry.parent_hash.hex() if entry.parent_hash else None,
                "tokens": list(entry.token_ids), "namespace": entry.namespace_hash, "group": entry.group,
                "adapter": entry.adapter}

    def _reject(self, tier: str, block_hash: bytes, why: str) -> None:
        entries = self.ram if tier == RAM_TIER else self.disk
        entry = entries.pop(block_hash, None)
        if entry is not None:
            self.pool.prefix_updates.removed(block_hash, TIER_MEDIUM[tier])
            self._drops.append((tier, block_hash, entry.group))
        self.rejected[why.split(":")[0]] += 1
        if why.split(":")[0] not in self._logged:  # once per kind: a bad directory is not a log flood
            self._logged.add(why.split(":")[0])
            logger.warning("KV tier: block %s from the %s tier is a miss: %s (further misses of this kind are "
                           "counted, not logged)", block_hash.hex()[:16], tier, why)
