"""Chained block hashes for prefix caching.

hash(block i) = SHA-256(hash(block i-1) | extra keys | token ids). The chain makes a block's
identity depend on everything before it, so an edit anywhere in a history changes every hash
from the edited block on. The per-process random root means hashes are never comparable across
processes (no cross-process timing oracle), and lookups still confirm token ids on a hit.
"""
from __future__ import annotations

import hashlib
import os
import struct


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

    def prefix_hashes(self, token_ids, cache_salt: str | None = None) -> list[bytes]:
        """The chain of hashes of every full block of ``token_ids``, as the manager computes them
        (group 0's chain in a hybrid model): what a router matches against a replica's events."""
        extra = self.extra_keys(cache_salt)
        out: list[bytes] = []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            out.append(self.hash_block(out[-1] if out else None, token_ids[i * bs:(i + 1) * bs], extra))
        return out

    @staticmethod
    def extra_keys(cache_salt: str | None) -> bytes:
        return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")
