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

    @staticmethod
    def extra_keys(cache_salt: str | None) -> bytes:
        return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")
