"""The replica router's policies (kvshare.server.routing), fed with KV events as replicas send them."""
from __future__ import annotations

import pytest

from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.hashing import BlockHasher
from kvshare.server.routing import Router

SEED = "router-test"
BS = 16


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stored(token_ids, salt=None, seed=SEED):
    hashes = BlockHasher.seeded(BS, seed).prefix_hashes(token_ids, CacheNamespace(salt=salt))
    return [["BlockStored", [h], p, token_ids[i * BS:(i + 1) * BS], BS, None, "CPU"]
            for i, (h, p) in enumerate(zip(hashes, [None] + hashes))]


def test_prefix_aware_sends_a_request_where_its_prefix_is_cached():
    r = Router(3, block_size=BS, hash_seed=SEED)
    system_a, system_b = tokens(1000, 160), tokens(5000, 160)
    r.replicas[1].apply(stored(system_a))
    r.replicas[2].apply(stored(system_b))
    assert r.choose(system_a + tokens(9, 30)) == 1
    assert r.choose(system_b + tokens(9, 30)) == 2
    # Nothing cached anywhere: the least-loaded replica (lowest index on a tie).
    r.replicas[0].in_flight = 2
    assert r.choose(tokens(7000, 100)) == 1
    r.replicas[1].in_flight = 1
    assert r.choose(tokens(7000, 100)) == 2


def test_a_removed_block_cuts_the_match_and_salts_keep_tenants_apart():
    r = Router(2, block_size=BS, hash_seed=SEED)
    prefix = tokens(100, 160)
    events = stored(prefix)
    r.replicas[1].apply(events)
    hashes = BlockHasher.seeded(BS, SEED).prefix_hashes(prefix)
    assert r.matched_blocks(r.replicas[1], hashes) == 10
    r.replicas[1].apply([["BlockRemoved", [hashes[3]], "CPU"]])
    assert r.matched_blocks(r.replicas[1], hashes) == 3
    # Another tenant's salt hashes differently: no match, so no affinity to that cache.
    salted = BlockHasher.seeded(BS, SEED).prefix_hashes(prefix, CacheNamespace(salt="tenant-b"))
    assert r.matched_blocks(r.replicas[1], salted) == 0
    r.replicas[1].apply([["AllBlocksCleared"]])
    assert r.replicas[1].cached == set()


def test_load_imbalance_overrides_the_cache():
    r = Router(2, block_size=BS, hash_seed=SEED, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prefix = tokens(100, 160)
    r.replicas[0].apply(stored(prefix))
    r.replicas[0].in_flight = 5
    r.replicas[1].in_flight = 2
    assert r.choose(prefix + [1, 2, 3]) == 0  # 3 apart: within the threshold, the cache wins
    r.replicas[0].in_flight = 10
    assert r.choose(prefix + [1, 2, 3]) == 1  # 8 apart and 5x: the idle replica


def test_a_small_match_does_not_pull_the_request():
    r = Router(2, block_size=BS, hash_seed=SEED, cache_threshold=0.5)
    prefix = tokens(100, 32)  # 2 of the request's 10 blocks
    r.replicas[0].apply(stored(prefix))
    r.replicas[0].in_flight = 1
    assert r.choose(prefix + tokens(900, 128)) == 1


def test_round_robin_least_loaded_and_dead_replicas():
    rr = Router(3, policy="round_robin")
    assert [rr.choose([1] * 40) for _ in range(4)] == [0, 1, 2, 0]
    rr.replicas[1].alive = False
    assert [rr.choose([1] * 40) for _ in range(3)] == [2, 0, 2]
    ll = Router(3, policy="least_loaded")
    ll.replicas[0].in_flight, ll.replicas[1].in_flight, ll.replicas[2].in_flight = 3, 1, 2
    assert ll.choose([1]) == 1
    ll.replicas[1].alive = False
    assert ll.choose([1]) == 2
    for rep in ll.replicas:
        rep.alive = False
    with pytest.raises(RuntimeError, match="no replica is alive"):
        ll.choose([1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="random"), "routing policy 'random' is invalid: allowed are prefix_aware, round_robin, least_loaded"),
    (dict(policy="prefix_aware"), "needs the replicas' prefix_caching_hash_seed"),
])
def test_bad_router_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Router(2, **kwargs)


def test_blocks_of_requests_in_flight_count_until_they_finish():
    """A tenant's requests arriving together stay together before any event comes back."""
    r = Router(2, block_size=BS, hash_seed=SEED)
    prefix = tokens(100, 160)
    first = r.route(prefix + [1, 2])
    assert first.index == 0 and first.reason == "load" and first.matched_blocks == 0
    r.replicas[0].in_flight += 1
    r.replicas[0].hold(first.block_hashes)
    second = r.route(prefix + [3, 4])
    assert second.index == 0 and second.reason == "prefix" and second.matched_blocks == 10
    r.replicas[0].release(first.block_hashes)
    r.replicas[0].in_flight -= 1
    assert r.replicas[0].pending == {}
    assert r.route(prefix + [5, 6]).matched_blocks == 0  # finished, and no event said it is cached


def test_a_full_replica_is_passed_over_whatever_it_caches():
    """--max-num-seqs 2 --max-waiting 1: a replica with 3 requests in flight would answer 429, so a
    tenant whose prefix it caches goes to a replica with room (even with the imbalance rule off)."""
    r = Router(2, block_size=BS, hash_seed=SEED, balance_abs_threshold=1000, max_num_seqs=2, max_waiting=1)
    prefix = tokens(100, 160)
    r.replicas[0].apply(stored(prefix))
    r.replicas[0].in_flight = 2
    assert r.route(prefix + [1]).index == 0  # room for one more: the cache wins
    r.replicas[0].in_flight = 3
    decision = r.route(prefix + [1])
    assert decision.index == 1 and decision.reason == "load" and decision.matched_blocks == 0
    r.replicas[1].in_flight = 3  # every replica full: the prefix decides (the front end refuses first)
    assert r.route(prefix + [1]).index == 0
    rr = Router(3, policy="round_robin", max_num_seqs=1, max_waiting=0)
    rr.replicas[1].in_flight = 1
    assert [rr.choose([1]) for _ in range(3)] == [0, 2, 0]
    ll = Router(2, policy="least_loaded", max_num_seqs=1, max_waiting=0)
    ll.replicas[0].in_flight, ll.replicas[0].kv_usage, ll.replicas[1].kv_usage = 0, 0.0, 0.5
    assert ll.choose([1]) == 0


def test_the_balance_threshold_scales_with_the_replicas_batch():
    assert Router(2, block_size=BS, hash_seed=SEED).balance_abs_threshold == 32  # SGLang's, for 256 seqs
    assert Router(2, block_size=BS, hash_seed=SEED, max_num_seqs=256).balance_abs_threshold == 32
    assert Router(2, block_size=BS, hash_seed=SEED, max_num_seqs=16).balance_abs_threshold == 2
    assert Router(2, block_size=BS, hash_seed=SEED, max_num_seqs=2).balance_abs_threshold == 1
    assert Router(2, block_size=BS, hash_seed=SEED, max_num_seqs=16, balance_abs_threshold=5).balance_abs_threshold == 5
    # max_num_seqs 16: 6 vs 1 in flight is far apart (more than 2 and 1.5x), whatever replica 0 caches.
    r = Router(2, block_size=BS, hash_seed=SEED, max_num_seqs=16)
    prefix = tokens(100, 160)
    r.replicas[0].apply(stored(prefix))
    r.replicas[0].in_flight, r.replicas[1].in_flight = 6, 1
    assert r.route(prefix).reason == "imbalance" and r.choose(prefix) == 1
    with pytest.raises(ValueError, match="max_num_seqs=0 is invalid"):
        Router(2, max_num_seqs=0, policy="least_loaded")
