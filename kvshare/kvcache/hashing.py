"""Chained block hashes for prefix caching.

hash(block i) = SHA-256(hash(block i-1) | extra keys | token ids), the extra keys being the
request's CacheNamespace (kvshare/kvcache/cache_key.py). The chain makes a block's identity
depend on everything before it, so an edit anywhere in a history changes every hash
from the edited block on. The per-process random root means hashes are never comparable across
processes (no cross-process timing oracle), and lookups still confirm token ids on a hit.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace


class BlockHasher:
    def __init__(self, block_size: int, root: bytes | None = None) -> None:
        self.block_size = block_size
        self.root = root if root is not None else os.urandom(16)

    def hash_block(self, parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
        h = hashlib.sha256()
        h.update(parent if parent is not None else self.root)
        h.update(struct.pack("<I", len(extra)))
        h.update(extra)
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        return h.digest()

    @classmethod
    def seeded(cls, block_size: int, seed: str | None) -> "BlockHasher":
        """A hasher whose root is SHA-256("kvshare-hash-seed:" + seed)[:16], so processes with the
        same seed hash alike; None: a random root, private to this process."""
        if seed is None:
            return cls(block_size)
        return cls(block_size, hashlib.sha256(b"kvshare-hash-seed:" + seed.encode("utf-8")).digest()[:16])

    def prefix_hashes(self, token_ids, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> list[bytes]:
        """The chain of hashes of every full block of ``token_ids``, as the manager computes them
        (group 0's chain in a hybrid model): what a router matches against a replica's events."""
        extra = self.extra_keys(namespace)
        out: list[bytes] = []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            out.append(self.hash_block(out[-1] if out else None, token_ids[i * bs:(i + 1) * bs], extra))
        return out

    @staticmethod
    def extra_keys(namespace: CacheNamespace) -> bytes:
        """A namespace without an adapter keys as the bare salt always did (nothing, or
        "salt:" + salt), so hashes, KV events and the caches routers learn stay what they were.
        With an adapter the pair is JSON under its own prefix, which no salt-only key starts with
        (and the hash takes the key's length first, so no key is a prefix of another)."""
        if namespace.adapter is None:
            return _salt_key(namespace.salt)
        pair = json.dumps([namespace.salt, namespace.adapter], ensure_ascii=False, separators=(",", ":"))
        return b"ns:" + pair.encode("utf-8")


def _salt_key(salt: str | None) -> bytes:
    return b"" if salt is None else b"salt:" + salt.encode("utf-8")
