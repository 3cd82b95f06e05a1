"""The cache key's namespace (kvshare/kvcache/cache_key.py): one frozen value for the salt and
the adapter, hashed so that everything keyed before adapters existed keys the same. Model-free."""
from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.isolation import IsolationChecker, Violation
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import plan_kv_groups

BS = 4
TOKENS = list(range(100, 100 + 3 * BS))


def salt_chain(hasher: BlockHasher, token_ids: list[int], salt: str | None) -> list[bytes]:
    """The chain as the bare salt keyed it before the namespace: SHA-256(parent | len(extra) |
    extra | tokens), extra = "salt:" + salt, or nothing without a salt (hashing.py's formula)."""
    extra = b"" if salt is None else b"salt:" + salt.encode("utf-8")
    out: list[bytes] = []
    for i in range(len(token_ids) // BS):
        h = hashlib.sha256(out[-1] if out else hasher.root)
        h.update(struct.pack("<I", len(extra)) + extra)
        h.update(struct.pack(f"<{BS}q", *token_ids[i * BS:(i + 1) * BS]))
        out.append(h.digest())
    return out


@pytest.mark.parametrize("salt", [None, "tenant-b", "a:b", "ünïcode"])
def test_a_salt_only_namespace_hashes_as_the_bare_salt_did(salt):
    hasher = BlockHasher.seeded(BS, "seed")
    assert hasher.prefix_hashes(TOKENS, CacheNamespace(salt=salt)) == salt_chain(hasher, TOKENS, salt)
    assert hasher.prefix_hashes(TOKENS) == salt_chain(hasher, TOKENS, None)  # the default: no salt


def test_adapters_and_salts_each_change_the_key_and_equal_namespaces_hash_alike():
    hasher = BlockHasher.seeded(BS, "seed")
    spaces = [CacheNamespace(), CacheNamespace(salt="t"), CacheNamespace(adapter="a1"), CacheNamespace(adapter="a2"),
              CacheNamespace("t", "a1"), CacheNamespace("t", "a2"), CacheNamespace(salt="a1"),
              # No pair spells another, nor a salt alone: the pair is encoded, not concatenated.
              CacheNamespace('t",null', "a1"), CacheNamespace("t", 'a1"'), CacheNamespace(salt='["t","a1"]')]
    keys = [BlockHasher.extra_keys(ns) for ns in spaces]
    assert len(set(keys)) == len(spaces)
    firsts = {hasher.prefix_hashes(TOKENS, ns)[0] for ns in spaces}  # the first block already differs
    assert len(firsts) == len(spaces)
    assert hasher.prefix_hashes(TOKENS, CacheNamespace("t", "a1")) == hasher.prefix_hashes(TOKENS, CacheNamespace("t", "a1"))


def test_the_namespace_is_a_frozen_hashable_value():
    ns = CacheNamespace(salt="t", adapter="a")
    assert ns == CacheNamespace("t", "a") and hash(ns) == hash(CacheNamespace("t", "a"))
    assert ns != CacheNamespace("t") and CacheNamespace() == DEFAULT_NAMESPACE
    assert len({ns, CacheNamespace("t", "a"), DEFAULT_NAMESPACE}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.salt = "other"


def test_event_fields_round_trip_and_say_nothing_new_without_an_adapter():
    assert CacheNamespace(salt="t").event_fields() == {"salt": "t"}  # what the log always wrote
    assert DEFAULT_NAMESPACE.event_fields() == {"salt": None}
    for ns in (DEFAULT_NAMESPACE, CacheNamespace(salt="t"), CacheNamespace("t", "a"), CacheNamespace(adapter="a")):
        assert CacheNamespace.from_event({"ev": "admit", "seq": "x", **ns.event_fields()}) == ns


def _admit(mgr: KVCacheCoordinator, seq_id: str, ns: CacheNamespace) -> int:
    plan = mgr.plan_admission(seq_id, TOKENS + [7], ns, max_new_tokens=len(TOKENS) + 1)
    mgr.commit_admission(plan)
    return plan.num_computed


def test_only_the_same_namespace_hits_and_blocks_carry_it():
    mgr = KVCacheCoordinator(32, BS, plan_kv_groups([None], BS))
    owner = CacheNamespace("t", "a1")
    assert _admit(mgr, "first", owner) == 0
    mgr.publish_full_blocks("first", TOKENS + [7], len(TOKENS) + 1)
    assert {mgr.pool.blocks[b].namespace for b in mgr.block_ids("first")} == {owner}
    assert mgr.namespaces["first"] == owner
    # Another adapter of the same tenant, the tenant without an adapter: no hit. The same pair: hits.
    assert _admit(mgr, "other-adapter", CacheNamespace("t", "a2")) == 0
    assert _admit(mgr, "no-adapter", CacheNamespace(salt="t")) == 0
    assert _admit(mgr, "same", CacheNamespace("t", "a1")) == len(TOKENS)


def test_the_checker_tells_namespaces_apart_by_adapter_too():
    ck = IsolationChecker(block_size=BS)
    ck.feed({"ev": "admit", "step": 1, "seq": "a", "salt": "t", "adapter": "a1"})
    ck.feed({"ev": "alloc", "step": 1, "block": 0, "seq": "a"})
    ck.feed({"ev": "admit", "step": 1, "seq": "b", "salt": "t"})  # same salt, no adapter
    ck.feed({"ev": "cache_hit", "step": 1, "block": 0, "seq": "b"})
    ck.feed({"ev": "incref", "step": 1, "block": 0, "seq": "b", "ref": 2})
    with pytest.raises(Violation) as e:
        ck.checkpoint()
    # Another adapter (here the base model) under the same salt: named apart from a salt breach.
    assert e.value.invariant == "adapter_isolation" and e.value.block == 0 and "b" in e.value.owners
