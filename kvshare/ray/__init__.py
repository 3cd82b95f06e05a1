"""kvshare on Ray Serve: N engine replicas anywhere on a Ray cluster behind one OpenAI endpoint,
routed prefix-aware from the replicas' own KV cache events (docs/ray.md).

    serve run kvshare.ray:build_app num_replicas=2 max_num_seqs=8 kv_cache_memory=256MiB
    KVSHARE_RAY_NUM_REPLICAS=2 serve run kvshare.ray:app

`build_app(args)` returns the Serve application: an ingress deployment (kvshare.ray.ingress)
and an engine deployment (kvshare.ray.replica) whose request router is kvshare's
(kvshare.ray.request_router). `app` is the same built from KVSHARE_RAY_<OPTION> variables, made
when it is first looked up (so importing this module deploys and builds nothing). Ray is
imported here and not by `import kvshare`: it is the optional `ray` extra.
"""
from __future__ import annotations

import logging

from kvshare.ray.options import RayAppOptions, args_from_env, max_ongoing, parse_app_args

ENGINE_DEPLOYMENT = "KVShareEngine"
INGRESS_DEPLOYMENT = "KVShareIngress"
INGRESS_MAX_ONGOING_REQUESTS = 10_000  # the ingress only tokenizes and waits: the engines' limits apply

logger = logging.getLogger("kvshare.ray")

__all__ = ["build_app", "parse_app_args", "RayAppOptions"]


def build_app(args: dict | None = None):
    """The Serve application from `serve run` arguments (KEY=VALUE, all strings) or a dict.
    Options: num_replicas, routing_policy, num_cpus_per_replica, max_ongoing_requests,
    kv_events_host, routing_stats_period_s, any engine option (EngineConfig: model,
    max_num_seqs, kv_cache_memory, block_size, ...) and the server options listed in
    kvshare.ray.options.SERVER_OPTIONS. Raises ValueError naming a bad option."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvshare.config import EngineConfig
    from kvshare.ray.ingress import OpenAIIngress
    from kvshare.ray.replica import EngineReplica
    from kvshare.ray.request_router import KVSharePrefixRouter
    from kvshare.server.data_parallel import new_hash_seed
    from kvshare.server.settings import ServerConfig
    from kvshare.server.state import default_model_name

    opts = parse_app_args(dict(args or {}))
    engine_options = dict(opts.engine)
    # One seed for every replica and router, so routers compute the replicas' block hashes.
    hash_seed = engine_options.pop("prefix_caching_hash_seed", None)
    if hash_seed is None:
        # Drawn for this build only: building the application again (a `serve deploy` of the same
        # config, another lookup of kvshare.ray:app) draws another, which changes every replica's
        # arguments, so Serve restarts them all and their caches start empty. Not derived from the
        # options: with the events carrying hashes only, a seed others can compute would let anyone
        # on the network test guessed prompts against them.
        hash_seed = new_hash_seed()
        logger.warning("kvshare.ray: no prefix_caching_hash_seed given, a new one was drawn for this build; "
                       "set prefix_caching_hash_seed (or KVSHARE_RAY_PREFIX_CACHING_HASH_SEED for kvshare.ray:app), "
                       "kept secret, so that redeploying does not restart every replica")
    # As under `kvshare serve`: unseeded sampling draws a new root in each replica at each start,
    # so it does not repeat across restarts (EngineConfig's default 0 is the offline LLM's).
    engine_options.setdefault("seed", None)
    engine_cfg = EngineConfig.from_kwargs(**engine_options)
    threads = engine_options.pop("num_threads", None) or max(1, int(opts.num_cpus_per_replica))
    router_config = RequestRouterConfig(
        request_router_class=KVSharePrefixRouter,
        request_router_kwargs={"policy": opts.routing_policy, "block_size": engine_cfg.block_size,
                               "hash_seed": hash_seed, "kv_events_topic": engine_cfg.kv_events_topic},
        request_routing_stats_period_s=opts.routing_stats_period_s)
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=opts.num_replicas, max_ongoing_requests=max_ongoing(opts),
        ray_actor_options={"num_cpus": opts.num_cpus_per_replica}, request_router_config=router_config,
    )(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )(serve.ingress()(OpenAIIngress))
    model_name = opts.server.get("served_model_name") or default_model_name(engine_cfg.model)
    server_cfg = ServerConfig(**opts.server)  # as each replica parses them: the same key and body limit
    return ingress.bind(
        engine.bind(engine_options, opts.server, hash_seed, opts.kv_events_host, threads),
        model=engine_cfg.model, model_name=model_name, chat_template=opts.server.get("chat_template"),
        api_key=server_cfg.api_key, num_replicas=opts.num_replicas, max_body_bytes=server_cfg.max_body_bytes,
        server_config=server_cfg)


def __getattr__(name: str):
    # `serve run kvshare.ray:app`: built on first lookup, from the environment.
    if name == "app":
        return build_app(args_from_env())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
