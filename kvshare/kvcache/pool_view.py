"""A read of the block pool for the live KV view: each block's state, holders, place in a chain.

States (every block is in exactly one, so the counts add up to the pool size). This is the one
place the rule is written: the view's snapshot rows and its block events (kvshare.kvcache.view_tap)
carry the state, and the dashboard shows what it receives.
  free     in the free queue without a prefix hash: the next allocation takes it as is
  cached   in the free queue with a prefix hash: a later request can revive it (evictable)
  in_use   held by one sequence (reference count 1)
  shared   held by two or more (prefix hits, forks)

Only reads; the caller runs it where nothing else changes the pool (the engine thread, between
steps).
"""
from __future__ import annotations

from typing import Callable

STATES = ("free", "cached", "in_use", "shared")
HASH_HEX = 12  # hex digits of a block hash shown: enough to tell chains apart on a screen


def block_state(ref_count: int, has_hash: bool) -> str:
    if ref_count >= 2:
        return "shared"
    if ref_count == 1:
        return "in_use"
    return "cached" if has_hash else "free"


def state_of(block) -> str:
    """A pool block's state now (a kvshare.kvcache.block_pool.Block)."""
    return block_state(block.ref_count, block.block_hash is not None)


def _placements(manager) -> dict[int, tuple[int, int]]:
    """Block id -> (KV cache group, table index) for every block some table holds. A shared block
    sits at the same index in each holder's table (a prefix hit or a fork), so one is enough."""
    out: dict[int, tuple[int, int]] = {}
    for group, tables in enumerate(manager.group_tables):
        for table in tables.values():
            for index, block in enumerate(table):
                if block is not None:
                    out.setdefault(block.block_id, (group, index))
    return out


def read_pool(manager, request_of: Callable[[str], str],
              last_event: dict[int, tuple[str, int]] | None = None) -> tuple[list[dict], dict[str, int]]:
    """(one row per block, counts per state). `request_of` maps a sequence id to its request id
    (a request with n > 1 has several sequences); `last_event`: block id -> (kind, step), what the
    view's recorder saw last (None or missing: not recorded)."""
    placed = _placements(manager)
    last_event = last_event or {}
    counts = dict.fromkeys(STATES, 0)
    rows = []
    for b in manager.pool.blocks:
        state = state_of(b)
        counts[state] += 1
        group, position = placed.get(b.block_id, (None, None))
        last = last_event.get(b.block_id)
        rows.append({
            "id": b.block_id, "state": state, "ref_count": b.ref_count,
            "owners": sorted({request_of(s) for s in b.owners}),
            "group": group, "position": position,
            "hash": b.block_hash.hex()[:HASH_HEX] if b.block_hash is not None else None,
            # The block before it in its chain (None: the first block, or not cached), so a view
            # can draw the prefix tree; the register event carries the same pair.
            "parent": b.parent_hash.hex()[:HASH_HEX] if b.block_hash is not None and b.parent_hash else None,
            "last_event": None if last is None else {"ev": last[0], "step": last[1]},
        })
    return rows, counts


def manager_counts(manager) -> dict[str, int]:
    """The same four numbers as the manager itself keeps them, to check a view against."""
    pool = manager.pool
    cached = pool.num_cached_free()
    shared = manager.num_shared_blocks()
    return {"free": pool.num_free - cached, "cached": cached, "in_use": manager.num_used_blocks() - shared,
            "shared": shared}
