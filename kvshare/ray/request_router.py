"""The engine deployment's request router: Ray Serve's custom RequestRouter API with kvshare's
routing policy (kvshare.server.routing.Router: prefix-aware, balanced against load).

Serve builds one router per deployment handle, in the process holding the handle (here: each
ingress replica), and asks it for a replica for every request. This router:
- follows every replica's KV events (a ZMQ SUB on the TCP endpoints the replica reported in its
  replica metadata, kvshare.server.prefix_update_subscriber, with the replay socket filling gaps), so it
  knows which block hashes each replica caches, whichever machine the replica runs on;
- hashes the request's prompt with the replicas' shared seed (the ingress tokenized it and passes
  the token ids and cache_salt as the `route` keyword argument) and lets Router.route choose;
- counts the requests it sent each replica and has not seen finish (on_request_routed /
  on_request_completed), holding their blocks as cached there meanwhile, as the data-parallel
  front end does;
- adds what it decided as the `routed` keyword argument, so the replica can say so in its headers.

A request without `route` (/v1/models, /tokenize, ...) goes to the least loaded replica; one whose
route pins an engine rank (the ingress's /ready probes) goes to that replica only, and carries the
router's view of it (block count and digest) so it can be compared with the replica's own.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

import zmq.asyncio
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvshare.server.prefix_update_subscriber import PrefixUpdateSubscriber
from kvshare.server.routing import ReplicaState, Router, RoutingDecision

logger = logging.getLogger("kvshare.ray")

ROUTE_KWARG = "route"  # the ingress's routing input: {"token_ids", "cache_salt", "engine_rank"}
ROUTED_KWARG = "routed"
UNKNOWN_RANK = -1  # a replica whose metadata has not reached this router yet
# Decisions wait here for Serve's on_request_routed; a call cancelled before it was sent never
# gets one, so the oldest are dropped beyond this many (far more than can be in routing at once).
MAX_PENDING_DECISIONS = 10_000  # the router's decision and, for pinned probes, its view of the replica
# A subscription that ended with an error is made again after this long, not at once: one whose
# endpoint keeps failing would otherwise be remade (and logged) on every request routed.
RESUBSCRIBE_DELAY_S = 2.0


@dataclass
class _Followed:
    state: ReplicaState
    replica_id: str
    kv_events_endpoint: str | None = None  # from the replica's metadata
    kv_events_replay_endpoint: str | None = None
    subscriber: PrefixUpdateSubscriber | None = None
    task: asyncio.Task | None = None
    resubscribe_at: float = 0.0  # loop time before which a failed subscription is not remade
    routed: int = 0  # requests this router sent it
    prefix_hit_blocks: int = 0  # of their prompt blocks, those it held (this router's view)
    prompt_blocks: int = 0


class KVSharePrefixRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix_aware", block_size: int = 16, hash_seed: str | None = None,
                         kv_events_topic: str = "", balance_abs_threshold: int = 32,
                         balance_rel_threshold: float = 1.5, cache_threshold: float = 0.5) -> None:
        self._router = Router(1, policy, block_size=block_size, hash_seed=hash_seed,
                              balance_abs_threshold=balance_abs_threshold,
                              balance_rel_threshold=balance_rel_threshold, cache_threshold=cache_threshold)
        self._router.replicas = []  # set per decision to the candidates' states
        self._topic = kv_events_topic
        self._followed: dict[ReplicaID, _Followed] = {}
        # (internal request id, replica) -> the blocks it holds there. Keyed by both: a replica that
        # refuses a request (at max_ongoing_requests) gets on_request_completed for it, possibly
        # after the retry was routed to another replica under the same request id; that late
        # completion must not end the other replica's count.
        self._in_flight: dict[tuple[str, ReplicaID], tuple[bytes, ...]] = {}
        self._decisions: dict[str, RoutingDecision] = {}  # internal request id -> the last decision
        # internal request id -> (its token ids, their block hashes): Serve asks again for a request
        # no replica could take (after a backoff); its prompt is hashed once, not at every retry.
        # The token ids list itself is kept and compared by identity, so a new request reusing an
        # id (calls made while serving one ingress request share it) is never given stale hashes.
        self._prompt_hashes: dict[str, tuple[list[int], list[bytes]]] = {}
        self._reasons: dict[str, int] = {}
        self._zmq: zmq.asyncio.Context | None = None

    # ---- replicas and their events ----------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id: r for r in replicas}
        for rid in list(self._followed):
            if rid not in current:  # stopped or dead: forget what it cached, stop following it
                gone = self._followed.pop(rid)
                if gone.task is not None:
                    gone.task.cancel()
                # Its requests' completions may never come now: their entries would stay forever.
                for key in [k for k in self._in_flight if k[1] == rid]:
                    del self._in_flight[key]
        for rid, replica in current.items():
            meta = replica.replica_metadata
            followed = self._followed.get(rid)
            if followed is None:
                followed = self._followed[rid] = _Followed(ReplicaState(UNKNOWN_RANK), rid.unique_id)
            if meta.get("rank") is not None:  # the metadata can come with a later update than the replica
                followed.state.index = int(meta["rank"])
                followed.kv_events_endpoint = meta.get("kv_events_endpoint")
                followed.kv_events_replay_endpoint = meta.get("kv_events_replay_endpoint")
        self._follow_events()

    def _follow_events(self) -> None:
        """Subscribe to every known replica's KV events; on the router's event loop (the SUB
        sockets and their tasks live there), so a call outside it waits for the next routing."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        now = asyncio.get_running_loop().time()
        for followed in self._followed.values():
            if followed.subscriber is not None or not followed.kv_events_endpoint or now < followed.resubscribe_at:
                continue
            followed.subscriber = PrefixUpdateSubscriber(self._zmq, followed.state, followed.kv_events_endpoint,
                                                    followed.kv_events_replay_endpoint, self._topic)
            followed.task = asyncio.ensure_future(followed.subscriber.run())
            followed.task.add_done_callback(functools.partial(self._subscription_ended, followed))
            logger.info("following KV events of replica rank %d (%s) on %s", followed.state.index,
                        followed.replica_id, followed.kv_events_endpoint)

    def _subscription_ended(self, followed: _Followed, task: asyncio.Task) -> None:
        """A subscription that stopped by itself (the subscriber cleared the replica's view and
        raised): logged, and made again after RESUBSCRIBE_DELAY_S (by the next routing), whose
        replay rebuilds the view. Without this the replica would be routed to by load only, for
        good, with the error never retrieved."""
        if task.cancelled() or followed.task is not task:
            return  # the replica is gone (update_replicas cancelled it)
        err = task.exception()
        logger.error("KV event subscription of replica rank %d (%s) on %s ended (%s); subscribing again in %.0f s",
                     followed.state.index, followed.replica_id, followed.kv_events_endpoint,
                     f"{type(err).__name__}: {err}" if err else "no error", RESUBSCRIBE_DELAY_S)
        followed.subscriber = None
        followed.task = None
        followed.resubscribe_at = asyncio.get_running_loop().time() + RESUBSCRIBE_DELAY_S

    # ---- choosing ---------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._follow_events()
        if pending_request is not None:
            # Every candidate is in what this returns: when none can take the request, Serve
            # should back off before asking again, not ask again at once (a busy loop).
            pending_request.routing_context.should_backoff = True
        # Router decides by rank: a replica whose rank is not known yet is left to Serve's own
        # choice below until its metadata arrives.
        candidates = [r for r in candidate_replicas if r.replica_id in self._followed
                      and self._followed[r.replica_id].state.index != UNKNOWN_RANK]
        if not candidates:
            return [candidate_replicas] if candidate_replicas else []
        route = (pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None) or {}
        by_state = {id(self._followed[r.replica_id].state): r for r in candidates}
        states = []
        for r in candidates:
            state = self._followed[r.replica_id].state
            state.kv_usage = float((r.routing_stats or {}).get("kv_cache_usage", 0.0))
            states.append(state)
        pinned = route.get("engine_rank")
        if pinned is not None:
            chosen = [r for r in candidates if self._followed[r.replica_id].state.index == pinned]
            if chosen and pending_request is not None and route.get("detail", True):
                # The view sorts every hash the replica caches: only for a probe that shows it.
                followed = self._followed[chosen[0].replica_id]
                pending_request.kwargs[ROUTED_KWARG] = {"replica_id": followed.replica_id, "view": self._view(followed)}
            return [chosen]
        self._router.replicas = states
        if "token_ids" in route:
            decision = self._router.route(route["token_ids"], route.get("cache_salt"),
                                          hashes=self._hashes(pending_request, route))
        else:  # nothing to match: the least loaded
            least = min(states, key=lambda s: (s.in_flight, s.kv_usage, s.index))
            decision = RoutingDecision(least.index, 0, 0, "least_loaded")
        chosen_state = next(s for s in states if s.index == decision.index)
        chosen = by_state[id(chosen_state)]
        if pending_request is not None:
            while len(self._decisions) >= MAX_PENDING_DECISIONS:  # calls cancelled before Serve sent them
                self._decisions.pop(next(iter(self._decisions)))
            self._decisions[pending_request.metadata.internal_request_id] = decision
            pending_request.kwargs[ROUTED_KWARG] = {
                "replica_id": chosen.replica_id.unique_id, "reason": decision.reason,
                "matched_blocks": decision.matched_blocks, "prompt_blocks": decision.prompt_blocks}
        # The others after it: Serve takes one of them if the chosen replica is at max_ongoing_requests.
        rest = sorted((r for r in candidates if r is not chosen),
                      key=lambda r: (self._followed[r.replica_id].state.in_flight,
                                     self._followed[r.replica_id].state.kv_usage))
        return [[chosen], rest] if rest else [[chosen]]

    def _hashes(self, pending_request: PendingRequest | None, route: dict) -> list[bytes] | None:
        """The prompt's block hashes, computed once per request (None: no hasher, or no request)."""
        if pending_request is None or self._router.hasher is None:
            return None
        request_id = pending_request.metadata.internal_request_id
        token_ids = route["token_ids"]
        known = self._prompt_hashes.get(request_id)
        if known is not None and known[0] is token_ids:
            return known[1]
        hashes = self._router.prompt_hashes(token_ids, route.get("cache_salt"))
        while len(self._prompt_hashes) >= MAX_PENDING_DECISIONS:  # requests cancelled before they were sent
            self._prompt_hashes.pop(next(iter(self._prompt_hashes)))
        self._prompt_hashes[request_id] = (token_ids, hashes)
        return hashes

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._prompt_hashes.pop(request_id, None)  # sent: no retry will hash it again
        decision = self._decisions.pop(request_id, None)
        followed = self._followed.get(replica_id)
        if decision is None or followed is None or (request_id, replica_id) in self._in_flight:
            return  # a pinned probe, a replica not followed, or already counted there: nothing to count
        hashes = decision.block_hashes
        state = followed.state
        # Counted on the replica that took it (Serve may take the next rank if the first was full).
        followed.prefix_hit_blocks += self._router.matched_blocks(state, list(hashes))
        followed.prompt_blocks += decision.prompt_blocks
        followed.routed += 1
        state.in_flight += 1
        state.hold(hashes)
        self._in_flight[(request_id, replica_id)] = hashes
        self._reasons[decision.reason] = self._reasons.get(decision.reason, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # The decision stays: a completion from a replica that refused the request can come after
        # the retry was chosen (a new decision under the same id) and before it was routed.
        # MAX_PENDING_DECISIONS bounds decisions never consumed.
        hashes = self._in_flight.pop((internal_request_id, replica_id), None)
        if hashes is None:
            return  # refused there (never counted), or a pinned probe
        followed = self._followed.get(replica_id)
        if followed is not None:
            followed.state.in_flight -= 1
            followed.state.release(hashes)

    def _view(self, followed: _Followed) -> dict:
        from kvshare.ray.replica import cached_digest

        sub = followed.subscriber
        return {"cached_blocks": len(followed.state.cached), "cached_digest": cached_digest(followed.state.cached),
                "in_flight": followed.state.in_flight, "routed_requests": followed.routed,
                "prefix_hit_blocks": followed.prefix_hit_blocks, "prompt_blocks": followed.prompt_blocks,
                "decisions": dict(self._reasons),
                "event_batches": sub.batches if sub else 0, "replayed_batches": sub.replayed if sub else 0,
                "lost_batches": sub.lost if sub else 0, "following": sub.endpoint if sub else None}
