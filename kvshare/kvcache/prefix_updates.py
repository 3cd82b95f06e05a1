"""Prefix updates for routers: which block hashes this pool holds for reuse, as changes in vLLM's
shape (vLLM calls them "KV cache events"; "events" here means only the block log,
kvshare.kvcache.events): a block published for prefix reuse (BlockStored), a cached block losing
its hash (BlockRemoved), the whole cache dropped (AllBlocksCleared).

The pool records them as they happen (no tensors, no sockets here); the engine drains them once
per step and hands them to a publisher (kvshare.engine.prefix_update_publisher). Hashes are the
pool's own block hashes (32-byte SHA-256 digests): with a configured hash seed
(`EngineConfig.prefix_caching_hash_seed`) a router computes the same ones from token ids
(kvshare.kvcache.hashing), so it knows which replica holds which prefix.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "CPU"

    def wire(self, include_token_ids: bool = True) -> list:
        """vLLM's msgspec encoding of a tagged array-like struct: [tag, fields...]. Without token
        ids the field is an empty list (still valid for vLLM's decoder): the block's text stays on
        the replica, and a router, which needs only the hashes, routes the same."""
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash,
                list(self.token_ids) if include_token_ids else [], self.block_size, self.lora_id, self.medium]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str | None = "CPU"

    def wire(self, include_token_ids: bool = True) -> list:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self, include_token_ids: bool = True) -> list:
        return ["AllBlocksCleared"]


PrefixUpdate = BlockStored | BlockRemoved | AllBlocksCleared


class PrefixUpdateQueue:
    """Updates since the last drain, in the order they happened."""

    enabled = True

    def __init__(self, block_size: int, medium: str = "CPU") -> None:
        self.block_size = block_size
        self.medium = medium
        self._updates: list[PrefixUpdate] = []

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...],
               medium: str | None = None) -> None:
        """medium: where the block now lives when not in the pool (a KV tier: kvcache/kv_tiers.py)."""
        self._updates.append(BlockStored((block_hash,), parent_hash, tuple(token_ids), self.block_size,
                                        None, medium or self.medium))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        self._updates.append(BlockRemoved((block_hash,), medium or self.medium))

    def cleared(self) -> None:
        self._updates.append(AllBlocksCleared())

    def drain(self) -> list[PrefixUpdate]:
        out, self._updates = self._updates, []
        return out


class NullPrefixUpdateQueue:
    """No publisher configured: the pool calls these unconditionally; they do nothing."""

    enabled = False

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...],
               medium: str | None = None) -> None:
        pass

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        pass

    def cleared(self) -> None:
        pass

    def drain(self) -> list:
        return []


def apply_prefix_updates(held: set[bytes], updates, media: dict[bytes, set] | None = None) -> None:
    """Update a subscriber's set of cached block hashes with decoded wire updates, in order. With
    `media` (hash -> where it lives: the pool, a KV tier), a block stays held until it has left every
    medium; without, the last update about a hash decides."""
    for ev in updates:
        tag = ev[0]
        if tag == "BlockStored":
            held.update(ev[1])
            if media is not None:
                for h in ev[1]:
                    media.setdefault(h, set()).add(ev[6] if len(ev) > 6 else None)
        elif tag == "BlockRemoved":
            if media is None:
                held.difference_update(ev[1])
                continue
            for h in ev[1]:
                where = media.get(h, set())
                where.discard(ev[2] if len(ev) > 2 else None)
                if not where:
                    media.pop(h, None)
                    held.discard(h)
        elif tag == "AllBlocksCleared":
            held.clear()
            if media is not None:
                media.clear()
        else:
            raise ValueError(f"unknown KV event tag {tag!r}: allowed are BlockStored, BlockRemoved, AllBlocksCleared")


def cached_hashes_from_updates(updates) -> set[bytes]:
    """The set of cached block hashes a subscriber rebuilds from decoded wire updates."""
    held: set[bytes] = set()
    apply_prefix_updates(held, updates)
    return held
