"""Data-parallel serving on one machine (`kvshare serve --data-parallel-size N`): N replicas, each
a full `kvshare serve` child process on an internal loopback port, behind one OpenAI front end.

The front end is an async reverse proxy. For /v1/completions and /v1/chat/completions it
tokenizes the prompt exactly as a replica would (same tokenizer, same chat template, the
request's cache_salt) and asks the router (kvshare.server.routing) for a replica: prefix-aware
by default, from what each replica's KV events say it caches (kvshare.server.prefix_update_subscriber),
balanced against the requests in flight on each and its KV usage. Replicas and front end share
one prefix-caching hash seed, so the router's block hashes are the replicas' own.

A replica's 429 reaches the client as it is; with --max-waiting the front end also refuses (429)
once the live replicas' running and waiting slots are all taken. SIGTERM drains: the front end
refuses new requests, sends SIGTERM to every replica (each drains its own requests,
--shutdown-timeout), waits for them to exit and exits 0 (1 if one had to be killed, or all died).

A replica that dies (its process exits, it refuses connections, its engine thread stops, or it
stops answering its polls: stuck, then SIGKILLed) is marked dead: its in-flight requests fail at
once with a 502 naming it (or, mid-stream, an error event), new requests go to the live replicas
only, and /ready lists it. /ready answers 200 while at least one replica is live ("ready", or
"degraded" with the dead ones listed) and 503 once none is or while draining.

This module builds the app and runs it (serve_data_parallel); the proxy is kvshare.server.dp_proxy,
the supervision (readiness, monitoring, polling, drain) kvshare.server.dp_supervisor, and the
launch planning (endpoints, ports, CPUs) kvshare.server.replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tempfile

import httpx2
import uvicorn
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvshare import __version__
from kvshare.errors import InvalidRequestError
from kvshare.server.body_deadline import BodyDeadlineMiddleware
from kvshare.server.dp_metrics import RouterMetrics, merge_exposition, process_families
# The proxy and the supervision live in their own modules; their names stay importable from here.
from kvshare.server.dp_proxy import (  # noqa: F401
    ENGINE_HEADER, EXIT_WAIT_SECONDS, HOP_BY_HOP, KEEPALIVE_EXPIRY_SECONDS, LONG_BODY, SERVER_SET, ClientGone, Proxy,
    ReplicaFailed, new_upstream_client, prompt_for_routing)
from kvshare.server.dp_supervisor import (  # noqa: F401
    DRAIN_MARGIN_SECONDS, MONITOR_SECONDS, POLL_SECONDS, POLL_TIMEOUT_SECONDS, RETIRE_GRACE_SECONDS,
    STARTUP_TIMEOUT_SECONDS, STUCK_POLLS, DrainingFrontend, FrontendState, _wait_started, exit_status,
    log_task_failure, monitor_replicas, poll_replica, poll_replicas, start_background, wait_replicas_ready)
from kvshare.server.dp_state import DataParallelOptions
from kvshare.server.errors import APIError
from kvshare.server.middleware import GuardMiddleware
from kvshare.server.prefix_update_subscriber import PrefixUpdateSubscriber
from kvshare.server.replica import (  # noqa: F401
    ReplicaLaunch, ReplicaProcess, bind_loopback_socket, connect_endpoint, free_loopback_port, offset_endpoint,
    split_cpus)
from kvshare.server.routing import Router
from kvshare.server.settings import ServerConfig

logger = logging.getLogger("kvshare.server")


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_frontend_app(state: FrontendState, subscribers: list[PrefixUpdateSubscriber]) -> Starlette:
    proxy = Proxy(state)
    tasks: list[asyncio.Task] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state.client = new_upstream_client()
        try:
            tasks.extend(start_background(state, subscribers))
            logger.info("data-parallel front end: %d engines, routing %s", len(state.replicas),
                        state.options.policy)
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.client.aclose()

    probe = ["GET", "HEAD"]

    def replica_rows() -> list[dict]:
        rows = []
        for rep, view in zip(state.replicas, state.router.replicas):
            status = "ready" if view.alive else "dead"
            if view.alive and state.draining:
                status = "draining"
            row = {"engine": rep.index, "status": status, "pid": rep.pid, "url": rep.url,
                   "in_flight": view.in_flight, "kv_cache_usage": round(view.kv_usage, 4),
                   "cached_blocks": len(view.cached)}
            if not view.alive:
                row["detail"] = state.dead_detail.get(rep.index, rep.describe_exit())
            rows.append(row)
        return rows

    async def health(_req):
        live = state.live()
        dead = [i for i in range(len(state.replicas)) if i not in live]
        if not live:
            return JSONResponse({"status": "engine_dead", "dead_engines": dead}, status_code=503)
        return JSONResponse({"status": "ok", "dead_engines": dead})

    async def ready(_req):
        live = state.live()
        dead = [i for i in range(len(state.replicas)) if i not in live]
        body = {"data_parallel_size": len(state.replicas), "routing_policy": state.options.policy,
                "live_engines": live, "dead_engines": dead, "engines": replica_rows()}
        if state.draining:
            return JSONResponse({"status": "draining", **body}, status_code=503)
        if not live:
            return JSONResponse({"status": "engine_dead", **body}, status_code=503)
        return JSONResponse({"status": "degraded" if dead else "ready", **body})

    async def metrics(_req):
        async def scrape(rep: ReplicaProcess):
            try:
                resp = await state.client.get(rep.url + "/metrics", timeout=5)
                return rep.index, resp.text if resp.status_code == 200 else None
            except httpx2.TransportError:
                return rep.index, None

        alive = [rep for rep in state.replicas if state.router.replicas[rep.index].alive]
        texts = {i: t for i, t in await asyncio.gather(*(scrape(r) for r in alive)) if t is not None}
        own = state.metrics.families(state.router.replicas) + process_families()
        return Response(merge_exposition(own, texts), media_type=PROMETHEUS_CONTENT_TYPE)

    async def version(_req):
        return JSONResponse({"version": __version__})

    async def not_found(req: Request, _exc=None):
        return APIError(404, f"no route {req.method} {req.url.path} on the data-parallel front end: see /v1/models, "
                             f"/v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health, /ready, "
                             f"/metrics (each engine's /kv/ view is on the engine itself: its url is in /ready)",
                        code="not_found").response()

    async def runtime_lora(req: Request):
        # vLLM's runtime adapter routes: refused here (cmd_serve refuses the flag too), saying why.
        state.metrics.on_rejected("not_found")
        return APIError(404, f"{req.url.path} is not offered with --data-parallel-size > 1: an adapter loaded or "
                             f"unloaded at run time would reach one replica only; give the adapters with "
                             f"--lora-modules (each replica loads them at start)", code="not_found").response()

    async def api_error(_req, exc: APIError):
        if exc.status in (400, 404):
            state.metrics.on_rejected("invalid_request" if exc.status == 400 else "not_found")
        return exc.response()

    async def invalid(_req, exc: InvalidRequestError):
        state.metrics.on_rejected("invalid_request")
        return APIError(400, str(exc), param=exc.param).response()

    async def not_allowed(req: Request, _exc=None):
        state.metrics.on_rejected("invalid_request")
        return APIError(405, f"method {req.method} is not allowed on {req.url.path}").response()

    async def internal(_req, exc: Exception):
        logger.exception("internal error in the data-parallel front end")
        return APIError(500, f"internal server error ({type(exc).__name__}); the request was not completed",
                        code="internal_error").response()

    routes = [
        Route("/health", health, methods=probe),
        Route("/ready", ready, methods=probe),
        Route("/metrics", metrics, methods=probe),
        Route("/version", version, methods=probe),
        Route("/v1/completions", proxy.completions, methods=["POST"]),
        Route("/v1/chat/completions", proxy.chat, methods=["POST"]),
        Route("/v1/models", proxy.passthrough, methods=probe),
        Route("/v1/models/{model_id:path}", proxy.passthrough, methods=["GET"]),
        Route("/tokenize", proxy.passthrough, methods=["POST"]),
        Route("/v1/load_lora_adapter", runtime_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", runtime_lora, methods=["POST"]),
        Route("/detokenize", proxy.passthrough, methods=["POST"]),
        Route("/openapi.json", proxy.passthrough, methods=probe),  # behind the key, as a single server's
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_allowed, APIError: api_error,
                                        InvalidRequestError: invalid, Exception: internal})
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(BodyDeadlineMiddleware, timeout=state.config.request_body_timeout)  # outside the guard
    return app



def build_router(options: DataParallelOptions, max_waiting: int | None) -> Router:
    """The front end's router: each replica's --max-num-seqs + --max-waiting bound its share."""
    policy = options.policy
    if policy == "prefix_aware" and not options.prefix_caching:
        # Replicas that cache no prefix publish no BlockStored: every match would be the blocks of
        # requests in flight, which would pile a tenant onto one replica for nothing.
        logger.info("prefix caching is off (--no-prefix-caching): prefix_aware routing sends each request to the "
                    "least loaded engine")
        policy = "least_loaded"
    return Router(options.size, policy, block_size=options.block_size, hash_seed=options.hash_seed,
                  max_num_seqs=options.max_num_seqs, max_waiting=max_waiting)



def serve_data_parallel(config: ServerConfig, options: DataParallelOptions, replica_argv, model_arg: str | None) -> int:
    """Run the front end until drained; `replica_argv(index, port, publish, replay)` gives one
    replica's `kvshare serve` arguments. Returns the exit status."""
    from kvshare.model.loader import load_tokenizer
    from kvshare.server.state import default_model_name

    # Each proxied request would be logged twice (httpx2's line and the access log's).
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logger.info("%s", config.describe_auth())
    tokenizer = load_tokenizer(model_arg)
    name = config.served_model_name or default_model_name(model_arg)
    router = build_router(options, config.max_waiting)
    socket_dir = tempfile.mkdtemp(prefix="kvshare-dp-")
    ctx = zmq.asyncio.Context()
    try:
        thread_budget = None  # the threads all replicas share: KVSHARE_NUM_THREADS or OMP_NUM_THREADS, if set
        for var in ("KVSHARE_NUM_THREADS", "OMP_NUM_THREADS"):
            if os.environ.get(var, "").strip().isdigit() and int(os.environ[var]) > 0:
                thread_budget = int(os.environ[var])
                break
        shares = split_cpus(options.size, thread_budget)
        replicas, subscribers = [], []
        for r in range(options.size):
            if options.kv_events_endpoint:
                publish = offset_endpoint(options.kv_events_endpoint, r, "--kv-events-endpoint")
                replay = (offset_endpoint(options.kv_events_replay_endpoint, r, "--kv-events-replay-endpoint")
                          if options.kv_events_replay_endpoint else f"ipc://{socket_dir}/engine-{r}.replay")
            else:
                publish = f"ipc://{socket_dir}/engine-{r}.events"
                replay = f"ipc://{socket_dir}/engine-{r}.replay"
            sock = bind_loopback_socket()
            port = sock.getsockname()[1]
            threads, cpus = shares[r]
            launch = ReplicaLaunch(index=r, port=port,
                                   argv=replica_argv(r, port, publish, replay) + ["--listen-fd", str(sock.fileno())],
                                   kv_events_endpoint=publish, kv_events_replay_endpoint=replay,
                                   omp_threads=threads, cpus=cpus, auth=replica_auth(config), listen_fd=sock.fileno(),
                                   hash_seed=options.hash_seed)
            replicas.append(ReplicaProcess(launch, listen_socket=sock))
        state = FrontendState(config=config, options=options, metrics=RouterMetrics(name, options.size, options.policy),
                              router=router, replicas=replicas, tokenizer=tokenizer, model_name=name)
        for rep, view in zip(replicas, router.replicas):
            subscribers.append(PrefixUpdateSubscriber(ctx, view, connect_endpoint(rep.launch.kv_events_endpoint),
                                                 connect_endpoint(rep.launch.kv_events_replay_endpoint),
                                                 options.kv_events_topic))
        app = build_frontend_app(state, subscribers)
        uv = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, log_level=config.log_level,
                            access_log=config.access_log, timeout_graceful_shutdown=5, lifespan="on",
                            limit_concurrency=config.limit_concurrency, timeout_keep_alive=config.timeout_keep_alive)
        server = DrainingFrontend(uv, state)
        try:
            for rep in replicas:
                rep.start()
            # Before uvicorn: --port is bound only once every replica serves, and a replica that
            # fails to start is one error line, not a lifespan traceback. The SUB sockets are
            # connected already; ZMQ queues what the replicas publish meanwhile.
            try:
                asyncio.run(_wait_started(state))
            except RuntimeError as e:
                logger.error("the data-parallel front end did not start: %s", e)
                return 1
            server.run()
        finally:
            for rep in replicas:
                rep.kill_and_wait()
        return exit_status(state)
    finally:
        ctx.destroy(linger=0)  # closes the SUB sockets of subscribers that never ran
        shutil.rmtree(socket_dir, ignore_errors=True)



def replica_auth(config: ServerConfig) -> dict | None:
    """The keys a replica checks: the front end's own, so it finds the same tenant for a request
    (and with --cache-salt-from-api-key the same cache salt the front end routed by)."""
    if not config.api_keys and config.admin_key is None:
        return None
    return {"api_keys": config.api_keys, "admin_key": config.admin_key}


def new_hash_seed() -> str:
    """A seed private to this front end and its replicas (block hashes are not comparable with
    any other process's, as without a seed)."""
    return secrets.token_hex(16)

