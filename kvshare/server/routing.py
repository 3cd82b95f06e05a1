"""Choosing a replica for a request (data-parallel serving): prefix-aware, balanced against load,
or round-robin / least-loaded.

Prefix-aware routing learns what each replica caches from that replica's KV events (BlockStored
/ BlockRemoved, kvshare.kvcache.kv_events), never by guessing: with a shared hash seed the router
hashes a request's full blocks as the replicas do (BlockHasher.prefix_hashes) and counts how
many leading blocks each replica holds. The blocks of requests in flight on a replica count as
held there too (ReplicaState.hold / release): they are in its cache as soon as it prefills them,
and without this a tenant's first requests arriving together would scatter over the replicas
before the first event comes back. The balance rule follows SGLang's cache-aware policy:
when the loads are far apart (by more than `balance_abs_threshold` requests and by a factor of
`balance_rel_threshold`) the least-loaded replica gets the request whatever it caches; otherwise
the best match wins if it covers at least `cache_threshold` of the request's blocks, else the
least-loaded replica does. "Least loaded" means fewest requests in flight (routed by the front
end and not finished: running or queued on the replica), then the lowest KV cache usage (what the
replica last reported), then the lowest index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.kv_events import apply_kv_events

ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass
class ReplicaState:
    index: int
    cached: set[bytes] = field(default_factory=set)  # block hashes, from the replica's KV events
    pending: dict[bytes, int] = field(default_factory=dict)  # block hashes of requests in flight there -> count
    in_flight: int = 0  # requests routed to it and not finished
    kv_usage: float = 0.0  # fraction of its KV blocks in use, as the replica last reported it
    alive: bool = True

    def apply(self, events) -> None:
        """Decoded wire events ([tag, fields...]) of one batch, in order."""
        apply_kv_events(self.cached, events)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.cached or block_hash in self.pending

    def hold(self, hashes) -> None:
        """A request with these block hashes was sent here."""
        for h in hashes:
            self.pending[h] = self.pending.get(h, 0) + 1

    def release(self, hashes) -> None:
        """That request finished (or failed): from now on only the events say what is cached."""
        for h in hashes:
            left = self.pending.get(h, 0) - 1
            if left > 0:
                self.pending[h] = left
            else:
                self.pending.pop(h, None)


@dataclass(frozen=True)
class RoutingDecision:
    index: int  # the replica chosen
    matched_blocks: int  # leading blocks of the prompt the chosen replica holds (router's view)
    prompt_blocks: int  # full blocks of the prompt (0 when the router has no hasher)
    reason: str  # prefix (a cache match won), load (no usable match), imbalance, round_robin, least_loaded
    block_hashes: tuple[bytes, ...] = ()  # the prompt's, for ReplicaState.hold / release


class Router:
    def __init__(self, num_replicas: int, policy: str = "prefix_aware", block_size: int = 16,
                 hash_seed: str | None = None, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, cache_threshold: float = 0.5) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is invalid: allowed are {', '.join(ROUTING_POLICIES)}")
        if policy == "prefix_aware" and hash_seed is None:
            raise ValueError("prefix_aware routing needs the replicas' prefix_caching_hash_seed: without it their "
                             "block hashes cannot be computed from token ids")
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} is invalid: must be >= 1")
        self.policy = policy
        self.replicas = [ReplicaState(i) for i in range(num_replicas)]
        self.hasher = BlockHasher.seeded(block_size, hash_seed) if hash_seed is not None else None
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self._next = 0

    def matched_blocks(self, replica: ReplicaState, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if not replica.holds(h):
                break
            n += 1
        return n

    def _least_loaded(self, live: list[ReplicaState]) -> ReplicaState:
        return min(live, key=lambda r: (r.in_flight, r.kv_usage, r.index))

    def choose(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica index for a request; raises RuntimeError when no replica is alive."""
        return self.route(token_ids, cache_salt).index

    def route(self, token_ids: list[int], cache_salt: str | None = None) -> RoutingDecision:
        """The replica for a request and why; raises RuntimeError when no replica is alive. The
        match is computed whatever the policy (when the router has a hasher), so prefix hits can
        be counted for round-robin and least-loaded routing too."""
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise RuntimeError("no replica is alive")
        hashes = self.hasher.prefix_hashes(token_ids, cache_salt) if self.hasher is not None else []

        def decided(r: ReplicaState, reason: str) -> RoutingDecision:
            return RoutingDecision(r.index, self.matched_blocks(r, hashes), len(hashes), reason, tuple(hashes))

        if self.policy == "round_robin":
            for _ in range(len(self.replicas)):
                r = self.replicas[self._next % len(self.replicas)]
                self._next += 1
                if r.alive:
                    return decided(r, "round_robin")
        if self.policy == "least_loaded":
            return decided(self._least_loaded(live), "least_loaded")
        loads = [r.in_flight for r in live]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return decided(self._least_loaded(live), "imbalance")
        if hashes:
            best = max(live, key=lambda r: (self.matched_blocks(r, hashes), -r.in_flight, -r.kv_usage, -r.index))
            matched = self.matched_blocks(best, hashes)
            if matched >= self.cache_threshold * len(hashes) and matched > 0:
                return RoutingDecision(best.index, matched, len(hashes), "prefix", tuple(hashes))
        return decided(self._least_loaded(live), "load")
