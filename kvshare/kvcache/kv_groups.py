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

A model whose layers all attend alike is one group over every layer (its policy: full attention,
its own window, or the opt-in sinks): the KV core (kvshare/kvcache/coordinator.py) always runs
over a list of groups, one or more.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvshare.kvcache.kv_policy import FullAttention, SinkWindow, SlidingWindow


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layers whose KV this group's blocks hold; layer layers[j] is slot j
    window: int | None  # None: global attention (or layers of mixed windows sharing one table)
    policy: FullAttention | SlidingWindow | SinkWindow

    @property
    def size(self) -> int:
        return len(self.layers)


def plan_kv_groups(windows: list[int | None], block_size: int) -> list[KVCacheGroup]:
    """The groups for a model's per-layer windows (None: global), global groups first; one group
    over every layer when every layer attends alike."""
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_type.setdefault(w, []).append(layer)
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


def one_group(policy: FullAttention | SlidingWindow | SinkWindow) -> list[KVCacheGroup]:
    """Every layer of the policy in one group (attention sinks, or groups turned off)."""
    windows = set(getattr(policy, "windows", (None,)))
    layers = tuple(range(len(policy.layer_variants)))
    return [KVCacheGroup(layers, windows.pop() if len(windows) == 1 else None, policy)]


def layers_per_block(groups: list[KVCacheGroup]) -> int:
    """How many layers' KV one block holds: every group has the same number of layers."""
    return groups[0].size


def grouped_blocks_per_seq(groups: list[KVCacheGroup], block_size: int, num_tokens: int,
                           chunk_tokens: int = 1) -> int | None:
    """`blocks_per_seq` where a sequence holds several tables (None with one group: its blocks are
    its slots, bounded by its policy, as for any single table)."""
    return blocks_per_seq(groups, block_size, num_tokens, chunk_tokens) if len(groups) > 1 else None


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
