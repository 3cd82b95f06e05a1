"""One engine replica of the Ray Serve application: an engine behind the same FastAPI app as
`kvshare serve` (called in-process, kvshare.ray.asgi), publishing its KV cache events on TCP
ports of its own node so routers on any machine of the cluster can follow them. The events carry
block hashes only (BlockStored's token_ids are empty): those sockets are unauthenticated, so a
tenant's prompt must not be readable from them.

What routers need to know about a replica reaches them through Serve's hooks:
- record_replica_metadata (once, when the replica is ready): its rank and KV event endpoints;
- record_routing_stats (every routing_stats_period_s): its KV cache usage, for tie-breaks.
A router (kvshare.ray.request_router) subscribes to those endpoints and learns what the replica
caches from its BlockStored / BlockRemoved events, as the data-parallel front end does.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import AsyncIterator

from kvshare.ray.asgi import call_asgi

logger = logging.getLogger("kvshare.ray")

ENGINE_HEADER = "x-kvshare-engine"  # the replica's rank, as the data-parallel front end's header
REPLICA_HEADER = "x-kvshare-replica"  # Serve's replica id
ROUTING_HEADER = "x-kvshare-routing"  # the router's reason and prefix match: "prefix 12/14"


def cached_digest(hashes) -> str:
    """One short value for a set of block hashes, so a router's view and a replica's own can be
    compared without sending thousands of hashes."""
    h = hashlib.sha256()
    for block_hash in sorted(hashes):
        h.update(block_hash)
    return h.hexdigest()[:16]


class EngineReplica:
    """The Serve deployment class (kvshare.ray.build_app wraps it with serve.deployment)."""

    async def __init__(self, engine_options: dict, server_options: dict, hash_seed: str,
                       kv_events_host: str | None, num_threads: int) -> None:
        import ray
        from ray import serve

        from kvshare.config import EngineConfig
        from kvshare.server.app import build_app
        from kvshare.server.async_engine import AsyncEngine
        from kvshare.server.metrics import ServerMetrics
        from kvshare.server.settings import ServerConfig
        from kvshare.server.state import ServerState, default_model_name

        context = serve.get_replica_context()
        rank = context.rank
        self.rank = int(getattr(rank, "rank", rank))
        self.replica_id = context.replica_id.unique_id
        host = kv_events_host or ray.util.get_node_ip_address()
        options = {"num_threads": num_threads, **engine_options,
                   # Port 0: the OS picks free ports; the publisher reports what it bound.
                   "kv_events_endpoint": f"tcp://{host}:0", "kv_events_replay_endpoint": f"tcp://{host}:0",
                   "prefix_caching_hash_seed": hash_seed, "data_parallel_rank": self.rank,
                   # The sockets have no authentication and listen on the node's network (the
                   # routers run elsewhere): a block's token ids (a tenant's prompt) stay here;
                   # routers need only the hashes.
                   "kv_events_token_ids": False, "kv_events_allow_remote": True}
        config = EngineConfig.from_kwargs(**options)
        # Loading takes seconds: off the replica's event loop, in a worker thread that then ends
        # the OpenMP workers its load made (the engine thread steps from here on; see
        # openmp.release_openmp_workers).
        engine = await asyncio.to_thread(_build_engine, config)
        server = ServerConfig(**{**server_options, "access_log": False})
        name = server.served_model_name or default_model_name(config.model)
        metrics = ServerMetrics(name)
        self.state = ServerState(
            config=server, engine=AsyncEngine(engine, metrics, server.max_waiting, server.retry_after_seconds),
            metrics=metrics, model_name=name, model_source=str(engine.model_source), tokenizer=engine.tokenizer,
            max_model_len=engine.layout.max_model_len, max_num_seqs=engine.config.max_num_seqs)
        self.app = build_app(self.state)
        self.kv_events_endpoint, self.kv_events_replay_endpoint = engine.kv_events_endpoints
        # The app's lifespan starts the engine thread on this (the replica's user-code) event
        # loop, the one every request handler below runs on.
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.startup()
        logger.info("kvshare replica rank %d (%s): KV events on %s, replay on %s", self.rank, self.replica_id,
                    self.kv_events_endpoint, self.kv_events_replay_endpoint)

    # ---- Serve's hooks ----------------------------------------------------------------------------
    def record_replica_metadata(self) -> dict:
        return {"rank": self.rank, "kv_events_endpoint": self.kv_events_endpoint,
                "kv_events_replay_endpoint": self.kv_events_replay_endpoint}

    def record_routing_stats(self) -> dict:
        return {"kv_cache_usage": self.state.engine.snapshot.kv_cache_usage}

    def check_health(self) -> None:
        """Serve replaces a replica whose engine thread stopped (it would refuse every request)."""
        engine = self.state.engine
        if not engine.is_alive():
            raise RuntimeError(f"the engine of replica rank {self.rank} stopped: {engine.dead or 'not running'}")

    async def __del__(self) -> None:
        # Serve calls this when it stops the replica: the engine thread stops, the KV event sockets close.
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            self.state.draining = True
            await lifespan.shutdown()

    # ---- requests ---------------------------------------------------------------------------------
    async def handle_http(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                          route: dict | None = None, routed: dict | None = None) -> AsyncIterator[dict | bytes]:
        """One HTTP request through the replica's app: the head (with which replica answered and,
        when a router chose it, why) then the body chunks. `route` is what the ingress gave the
        router; `routed` is what the router added (kvshare.ray.request_router)."""
        async for item in call_asgi(self.app, method, path, query, headers, body):
            if isinstance(item, dict):
                item["headers"].append((ENGINE_HEADER, str(self.rank)))
                item["headers"].append((REPLICA_HEADER, self.replica_id))
                if routed and routed.get("replica_id") == self.replica_id and routed.get("reason"):
                    item["headers"].append((ROUTING_HEADER, f"{routed['reason']} {routed['matched_blocks']}/"
                                                            f"{routed['prompt_blocks']}"))
            yield item

    async def kv_state(self, route: dict | None = None, routed: dict | None = None, detail: bool = True) -> dict:
        """This replica's own view of its prefix cache (read on the engine thread, between steps),
        beside the router's view of it as the router sent it along (`routed`). Without `detail`
        only whether it answers: no copy of the cached hashes (an unauthenticated /ready)."""
        if not detail:
            return {"rank": self.rank, "engine_alive": self.state.engine.is_alive()}
        engine = self.state.engine.engine
        own = await self.state.engine.call(engine.cached_block_hashes)
        snap = self.state.engine.metrics_snapshot()
        return {"rank": self.rank, "replica_id": self.replica_id, "kv_events_endpoint": self.kv_events_endpoint,
                "kv_events_replay_endpoint": self.kv_events_replay_endpoint,
                "cached_blocks": len(own), "cached_digest": cached_digest(own),
                "running": snap.running, "waiting": snap.waiting, "aborted": dict(self.state.metrics.aborted),
                "prefix_cache_queries": snap.prefix_cache_queries, "prefix_cache_hits": snap.prefix_cache_hits,
                "kv_cache_usage": round(snap.kv_cache_usage, 4), "engine_alive": self.state.engine.is_alive(),
                "router": (routed or {}).get("view")}


class _Lifespan:
    """Runs an ASGI app's lifespan protocol (startup, later shutdown) as a server would."""

    def __init__(self, app) -> None:
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, wanted: str) -> None:
        message = await self._outbox.get()
        if message["type"] != wanted:
            raise RuntimeError(f"the app's lifespan answered {message['type']}: {message.get('message', '')}")

    async def startup(self) -> None:
        self._task = asyncio.ensure_future(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown.complete")
        self._task = None


def _build_engine(config):
    """An LLMEngine for config, built in the calling thread, which then ends its OpenMP workers."""
    from kvshare.engine.llm_engine import LLMEngine  # (imported late, as the rest of this module's engine code)
    from kvshare.model.kernels import openmp

    engine = LLMEngine(config)
    openmp.release_openmp_workers()
    return engine
