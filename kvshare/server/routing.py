"""Choosing a replica for a request (data-parallel serving): prefix-aware, balanced against load,
or round-robin / least-loaded.

Prefix-aware routing learns what each replica caches from that replica's KV events (BlockStored
/ BlockRemoved, kvshare.kvcache.prefix_updates), never by guessing: with a shared hash seed the router
hashes a request's full blocks as the replicas do (BlockHasher.prefix_hashes) and counts how
many leading blocks each replica holds. The blocks of requests in flight on a replica count as
held there too (ReplicaState.hold / release): they are in its cache as soon as it prefills them,
and without this a tenant's first requests arriving together would scatter over the replicas
before the first event comes back. The balance rule follows SGLang's cache-aware policy:
when the loads are far apart (by more than `balance_abs_threshold` requests and by a factor of
`balance_rel_threshold`) the least-loaded replica gets the request whatever it caches; otherwise
the best match wins if it covers at least `cache_threshold` of the request's blocks, else the
least-loaded replica does. With a per-replica limit (`max_num_seqs` running + `max_waiting`
queued: the replicas' own --max-num-seqs and --max-waiting) a replica with that many requests in
flight is skipped whatever it caches: it would only answer 429 while another has room. The
balance threshold then scales with max_num_seqs (an eighth of it: 32 for vLLM's default 256), so
"far apart" means the same share of a replica's batch whatever its size. "Least loaded" means fewest requests in flight (routed by the front
end and not finished: running or queued on the replica), then the lowest KV cache usage (what the
replica last reported), then the lowest index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.prefix_updates import apply_prefix_updates

ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass
class ReplicaState:
    index: int
    cached: set[bytes] = field(default_factory=set)  # block hashes, from the replica's KV events
    media: dict[bytes, set] = field(default_factory=dict)  # where each lives there: the pool, a KV tier
    pending: dict[bytes, int] = field(default_factory=dict)  # block hashes of requests in flight there -> count
    in_flight: int = 0  # requests routed to it and not finished
    kv_usage: float = 0.0  # fraction of its KV blocks in use, as the replica last reported it
    alive: bool = True

    def apply(self, events) -> None:
        """Decoded wire events ([tag, fields...]) of one batch, in order."""
        apply_prefix_updates(self.cached, events, self.media)

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
                 hash_seed: str | None = None, balance_abs_threshold: int | None = None,
                 balance_rel_threshold: float = 1.5, cache_threshold: float = 0.5,
                 max_num_seqs: int | None = None, max_waiting: int | None = None) -> None:
        """`balance_abs_threshold` defaults to 32, or max_num_seqs / 8 when max_num_seqs is given.
        `max_num_seqs` and `max_waiting` are each replica's own; with both set, a replica with
        max_num_seqs + max_waiting requests in flight is full and passed over."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is invalid: allowed are {', '.join(ROUTING_POLICIES)}")
        if policy == "prefix_aware" and hash_seed is None:
            raise ValueError("prefix_aware routing needs the replicas' prefix_caching_hash_seed: without it their "
                             "block hashes cannot be computed from token ids")
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} is invalid: must be >= 1")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} is invalid: must be >= 1")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} is invalid: must be >= 0")
        if balance_abs_threshold is None:
            balance_abs_threshold = 32 if max_num_seqs is None else max(1, round(max_num_seqs / 8))
        self.policy = policy
        self.replicas = [ReplicaState(i) for i in range(num_replicas)]
        self.hasher = BlockHasher.seeded(block_size, hash_seed) if hash_seed is not None else None
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._next = 0

    @property
    def replica_limit(self) -> int | None:
        """Requests one replica takes at once (running + waiting); None when unbounded."""
        if self.max_num_seqs is None or self.max_waiting is None:
            return None
        return self.max_num_seqs + self.max_waiting

    def has_room(self, replica: ReplicaState) -> bool:
        limit = self.replica_limit
        return limit is None or replica.in_flight < limit

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None, adapter: str | None = None) -> list[bytes]:
        """The prompt's block hashes as a replica keys them: under the namespace its engine gives
        the request (kvshare.engine.request.Sequence.namespace), from the request's cache_salt.
        A request naming a LoRA adapter (`adapter`, its name) hashes under the adapter's name: a
        replica keys its blocks by the adapter's weights too (a key the front end does not have),
        so these never match a replica's cached blocks, only requests of the same adapter in
        flight, and never the base model's blocks of the same prompt."""
        if self.hasher is None:
            return []
        return self.hasher.prefix_hashes(token_ids, CacheNamespace(salt=cache_salt, adapter=adapter))

    def matched_blocks(self, replica: ReplicaState, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if not replica.holds(h):
                break
            n += 1
        return n

    def _least_loaded(self, live: list[ReplicaState]) -> ReplicaState:
        return min(live, key=lambda r: (r.in_flight, r.kv_usage, r.index))

    def choose(self, token_ids: list[int], cache_salt: str | None = None, exclude=()) -> int:
        """The replica index for a request; raises RuntimeError when no replica is alive."""
        return self.route(token_ids, cache_salt, exclude).index

    def route(self, token_ids: list[int], cache_salt: str | None = None, exclude=(),
              hashes: list[bytes] | None = None) -> RoutingDecision:
        """The replica for a request and why; raises RuntimeError when no replica is alive (or
        none outside `exclude`: indices already tried for this request). The match is computed
        whatever the policy (when the router has a hasher), so prefix hits can be counted for
        round-robin and least-loaded routing too. `hashes`: the prompt's block hashes when the
        caller already has them (routing the same request again), else computed here."""
        live = [r for r in self.replicas if r.alive and r.index not in exclude]
        if not live:
            raise RuntimeError("no replica is alive")
        # Full replicas are passed over; when all are full the front end refuses (429) before asking.
        live = [r for r in live if self.has_room(r)] or live
        if hashes is None:
            hashes = self.prompt_hashes(token_ids, cache_salt)

        def decided(r: ReplicaState, reason: str) -> RoutingDecision:
            return RoutingDecision(r.index, self.matched_blocks(r, hashes), len(hashes), reason, tuple(hashes))

        if self.policy == "round_robin":
            open_ = {r.index for r in live}
            for _ in range(len(self.replicas)):
                r = self.replicas[self._next % len(self.replicas)]
                self._next += 1
                if r.index in open_:
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
