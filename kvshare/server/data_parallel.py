"""Data-parallel serving on one machine (`kvshare serve --data-parallel-size N`): N replicas, each
a full `kvshare serve` child process on an internal loopback port, behind one OpenAI front end.

The front end is an async reverse proxy. For /v1/completions and /v1/chat/completions it
tokenizes the prompt exactly as a replica would (same tokenizer, same chat template, the
request's cache_salt) and asks the router (kvshare.server.routing) for a replica: prefix-aware
by default, from what each replica's KV events say it caches (kvshare.server.kv_subscriber),
balanced against the requests in flight on each and its KV usage. Replicas and front end share
one prefix-caching hash seed, so the router's block hashes are the replicas' own.

Bodies are passed through untouched; streams chunk by chunk (whole server-sent events). A
client that disconnects closes the upstream request, so the replica aborts it. A replica's 429
reaches the client as it is; with --max-waiting the front end also refuses (429) once the live
replicas' running and waiting slots are all taken. SIGTERM drains: the front end refuses new
requests, sends SIGTERM to every replica (each drains its own requests, --shutdown-timeout),
waits for them to exit and exits 0.

A replica that dies (its process exits, or refuses connections) is marked dead: its in-flight
requests fail at once with a 502 naming it (or, mid-stream, an error event), new requests go to
the live replicas only, and /ready lists it. /ready answers 200 while at least one replica is
live ("ready", or "degraded" with the dead ones listed) and 503 once none is or while draining.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field

import httpx2
import uvicorn
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvshare import __version__
from kvshare.errors import InvalidRequestError
from kvshare.server.chat import render_chat_prompt
from kvshare.server.dp_metrics import RouterMetrics, merge_exposition, process_families
from kvshare.server.errors import APIError
from kvshare.server.kv_subscriber import KVEventSubscriber
from kvshare.server.middleware import GuardMiddleware
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvshare.server.replica import ReplicaLaunch, ReplicaProcess
from kvshare.server.routing import Router, RoutingDecision
from kvshare.server.runner import ABORT_GRACE_SECONDS
from kvshare.server.settings import ServerConfig

logger = logging.getLogger("kvshare.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_HEADER = "x-kvshare-engine"  # which replica answered: for clients and tests that want to know
STARTUP_TIMEOUT_SECONDS = 600.0
MONITOR_SECONDS = 0.1  # how often replica processes are checked for an exit
EXIT_WAIT_SECONDS = 0.5  # after a failed connection or read: how long to wait to see the process exit
POLL_SECONDS = 1.0  # how often each replica's /health and KV usage (from its /metrics) are read
# A replica that answers neither /health nor /metrics within POLL_TIMEOUT_SECONDS, STUCK_POLLS
# times in a row, is stuck (stopped, deadlocked, swapping): it is SIGKILLed, which fails its
# requests in flight at once (the upstream client has no read timeout: a generation may be long).
POLL_TIMEOUT_SECONDS = 5.0
STUCK_POLLS = 3
# A replica retired while its process lives (its engine thread stopped) gets SIGTERM, then SIGKILL
# after this long: it has nothing left to drain.
RETIRE_GRACE_SECONDS = 10.0
# Below the replicas' keep-alive (uvicorn's timeout_keep_alive, 5 s): a pooled connection is never
# reused just as the replica closes it, which would fail a request that never reached it.
KEEPALIVE_EXPIRY_SECONDS = 2.0
DRAIN_MARGIN_SECONDS = 20.0  # beyond a replica's own drain (--shutdown-timeout + its abort grace)
LONG_BODY = 16 * 1024  # bytes; tokenizing a body larger than this for routing runs off the event loop
# Never forwarded: they describe one connection, not the request (RFC 9110 7.6.1), or are recomputed.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-authorization", "proxy-authenticate", "host", "content-length"})
# The front end's own server writes these on every response; the replica's copies would be doubles.
SERVER_SET = frozenset({"date", "server"})
_KV_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+(\S+)$", re.M)


@dataclass
class DataParallelOptions:
    size: int
    policy: str
    block_size: int
    hash_seed: str  # shared by the replicas and the router
    kv_events_topic: str = ""
    kv_events_endpoint: str | None = None  # the user's base endpoint (rank r publishes on port + r)
    kv_events_replay_endpoint: str | None = None
    max_num_seqs: int = 256
    prefix_caching: bool = True  # the replicas' (--no-prefix-caching: False); prefix_aware then routes by load

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size {self.size} is invalid: must be >= 1")
        if self.kv_events_endpoint:  # checked now, before any replica starts
            offset_endpoint(self.kv_events_endpoint, 0, "--kv-events-endpoint")
        if self.kv_events_replay_endpoint:
            offset_endpoint(self.kv_events_replay_endpoint, 0, "--kv-events-replay-endpoint")


def offset_endpoint(endpoint: str, rank: int, flag: str) -> str:
    """Replica `rank`'s endpoint from a base one, as vLLM offsets it under data parallelism:
    tcp://host:PORT -> tcp://host:PORT+rank; ipc://PATH -> ipc://PATH.rank."""
    m = re.fullmatch(r"(tcp://.+):(\d+)", endpoint)
    if m and int(m.group(2)) > 0:
        return f"{m.group(1)}:{int(m.group(2)) + rank}"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return f"{endpoint}.{rank}"
    raise ValueError(f"{flag} {endpoint!r} is invalid with --data-parallel-size: give tcp://HOST:PORT with an "
                     f"explicit port (replica r publishes on PORT + r, as in vLLM) or ipc://PATH")


def bind_loopback_socket() -> socket.socket:
    """A replica's listening socket, bound here on a free loopback port and inherited by the
    replica (ReplicaLaunch.listen_fd), so no other process can take the port in between. Not
    listening yet: connections are refused until the replica serves it."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
    except OSError:
        sock.close()
        raise
    return sock


def free_loopback_port() -> int:
    """A free loopback port, released again: another process may take it before it is bound (the
    replicas get bound sockets instead, bind_loopback_socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_endpoint(bound: str) -> str:
    """Where the front end connects to reach an endpoint a replica binds (a wildcard host is loopback here)."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0)(?=:)", "tcp://127.0.0.1", bound)


def split_cpus(size: int, thread_budget: int | None) -> list[tuple[int, tuple[int, ...] | None]]:
    """(torch threads, CPU affinity) per replica: the front end's CPUs split evenly, each replica
    pinned to its share when there is at least one CPU each; `thread_budget` (OMP_NUM_THREADS
    given to the front end) caps the threads all replicas use together."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    total = min(len(cpus), thread_budget) if thread_budget else len(cpus)
    threads = max(1, total // size)
    if len(cpus) < size:
        return [(threads, None)] * size
    share = len(cpus) // size
    return [(threads, tuple(cpus[r * share:(r + 1) * share])) for r in range(size)]


@dataclass
class FrontendState:
    """What the front end's routes, middleware and shutdown path share. `config`, `metrics`,
    `draining` and `inflight` are what GuardMiddleware reads and updates."""

    config: ServerConfig
    options: DataParallelOptions
    metrics: RouterMetrics
    router: Router
    replicas: list[ReplicaProcess]
    tokenizer: object | None
    model_name: str
    draining: bool = False
    inflight: int = 0  # API requests inside the app
    started: bool = False  # every replica answered /ready
    dead_detail: dict[int, str] = field(default_factory=dict)  # replica index -> why it is dead
    client: httpx2.AsyncClient | None = None
    poll_seconds: float = POLL_SECONDS
    poll_timeout: float = POLL_TIMEOUT_SECONDS
    stuck_polls: int = STUCK_POLLS
    retire_grace: float = RETIRE_GRACE_SECONDS
    poll_timeouts: dict[int, int] = field(default_factory=dict)  # replica index -> consecutive poll timeouts
    died: int = 0  # replicas that died while serving (not drained): all of them -> the exit status is 1
    killed_after_drain: list[int] = field(default_factory=list)  # replicas SIGKILLed at the drain timeout
    background: set = field(default_factory=set)  # tasks to keep referenced until done (retirements)

    def live(self) -> list[int]:
        return [r.index for r in self.router.replicas if r.alive]

    def mark_dead(self, index: int, detail: str) -> None:
        rep = self.router.replicas[index]
        if not rep.alive:
            return
        rep.alive = False
        rep.cached.clear()  # nothing is cached on a dead replica; never route by it again
        rep.pending.clear()
        self.dead_detail[index] = detail
        if self.draining:
            logger.info("engine %d stopped: %s", index, detail)
        else:
            self.died += 1
            logger.error("engine %d is dead (%s): its requests fail, new ones go to engine(s) %s", index, detail,
                         ", ".join(map(str, self.live())) or "none")

    def retire(self, index: int) -> None:
        """Stop a replica marked dead whose process lives on: SIGTERM, then SIGKILL after
        `retire_grace`, and reap it either way (no zombie, no process serving nothing)."""
        rep = self.replicas[index]
        if rep.proc is None or rep.exit_code() is not None:
            return
        rep.signal(signal.SIGTERM)
        task = asyncio.ensure_future(self._reap(rep))
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        task.add_done_callback(log_task_failure)

    async def _reap(self, rep: ReplicaProcess) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retire_grace
        while rep.exit_code() is None and loop.time() < deadline:  # exit_code() reaps it once it exits
            await asyncio.sleep(0.1)
        if rep.exit_code() is None:
            logger.warning("engine %d did not exit %.0fs after SIGTERM; killing it", rep.index, self.retire_grace)
            rep.signal(signal.SIGKILL)
            await asyncio.to_thread(rep.kill_and_wait)

    def capacity(self) -> int | None:
        """Requests the live replicas take at once (running + waiting), with --max-waiting; else None."""
        mw = self.config.max_waiting
        if mw is None:
            return None
        return len(self.live()) * (self.options.max_num_seqs + mw)


class ClientGone(Exception):
    """The client disconnected before its response started: nothing is left to answer."""


class ReplicaFailed(Exception):
    def __init__(self, index: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.index = index
        self.reason = reason
        self.detail = detail


class Proxy:
    """Routes and forwards the API requests."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    # ---- routing input ------------------------------------------------------------------------
    def _prompt_for_routing(self, body: bytes, chat: bool) -> tuple[list[int], str | None]:
        """The first prompt's token ids as a replica computes them, and the request's cache_salt.
        Raises InvalidRequestError for a body a replica would refuse (the same check, so the same 400)."""
        st = self.state
        req = parse_body(body, ChatCompletionRequest if chat else CompletionRequest)
        if chat:
            ids = render_chat_prompt(st.tokenizer, req, st.config.chat_template).token_ids
        else:
            first = req.prompt[0]
            if isinstance(first, str):
                if st.tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
                ids = st.tokenizer.encode(first) if first else []
            else:
                ids = list(first)
        return ids, req.cache_salt

    async def routing_input(self, body: bytes, chat: bool) -> tuple[list[int], str | None]:
        try:
            if len(body) > LONG_BODY:
                return await asyncio.to_thread(self._prompt_for_routing, body, chat)
            return self._prompt_for_routing(body, chat)
        except (InvalidRequestError, APIError):
            raise
        except Exception:  # not the front end's to judge: route by load, the replica answers
            logger.exception("could not tokenize a request for routing; routing it by load")
            return [], None

    # ---- forwarding -------------------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        return await self._routed(raw, chat=False)

    async def chat(self, raw: Request) -> Response:
        return await self._routed(raw, chat=True)

    async def _routed(self, raw: Request, chat: bool) -> Response:
        st = self.state
        body = await raw.body()
        token_ids, salt = await self.routing_input(body, chat)
        cap = st.capacity()
        busy = sum(r.in_flight for r in st.router.replicas if r.alive)
        if cap is not None and busy >= cap:
            retry = st.config.retry_after_seconds
            st.metrics.on_rejected("queue_full")
            return APIError(429, f"server is at capacity: {busy} requests already run or wait on {len(st.live())} "
                                 f"engine(s) (--max-num-seqs {st.options.max_num_seqs} + --max-waiting "
                                 f"{st.config.max_waiting} each); retry after {retry}s", code="queue_full",
                            headers={"Retry-After": str(retry)}).response()
        return await self._forward(raw, body, lambda tried: st.router.route(token_ids, salt, exclude=tried))

    async def passthrough(self, raw: Request) -> Response:
        """A request any replica answers alike (/v1/models, /tokenize, ...): the least loaded one."""
        body = await raw.body()
        return await self._forward(raw, body, self._least_loaded_decision, count=False)

    def _least_loaded_decision(self, tried=()):
        live = [r for r in self.state.router.replicas if r.alive and r.index not in tried]
        if not live:
            raise RuntimeError("no replica is alive")
        r = min(live, key=lambda r: (r.in_flight, r.kv_usage, r.index))
        return RoutingDecision(r.index, 0, 0, "least_loaded")

    async def _forward(self, raw: Request, body: bytes, decide, count: bool = True) -> Response:
        st = self.state
        # No accept-encoding: replicas answer uncompressed, so bodies pass through byte for byte.
        headers = [(k, v) for k, v in raw.headers.items() if k.lower() not in HOP_BY_HOP | {"accept-encoding"}]
        path = raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
        tried: set[int] = set()  # replicas that could not be reached: the request goes to another one
        failure: ReplicaFailed | None = None
        for _attempt in range(len(st.replicas)):
            try:
                decision = decide(tried)
            except RuntimeError:
                if failure is not None:  # live replicas remain, but none could be reached
                    return APIError(502, failure.detail, code="engine_failed").response()
                st.metrics.on_rejected("no_live_replica")
                return APIError(503, "no engine is alive to serve this request: every data-parallel replica has "
                                     "died (see /ready); restart the server", code="no_live_replica").response()
            index = decision.index
            rep = st.router.replicas[index]
            # Only API requests count as load (and toward --max-waiting's capacity): a /tokenize or
            # /v1/models never waits for a sequence slot on the replica.
            if count:
                rep.in_flight += 1
                rep.hold(decision.block_hashes)

            def finished(rep=rep, hashes=decision.block_hashes, counted=count) -> None:
                if counted:
                    rep.in_flight -= 1
                    rep.release(hashes)

            release = _Once(finished)
            try:
                upstream = await self._send(raw, st.replicas[index], path, body, headers)
            except ClientGone:
                release()
                return Response(status_code=499)  # nobody reads it; closing the upstream was the point
            except ReplicaFailed as e:
                release()
                st.metrics.on_failed(index, e.reason)
                if e.reason == "connection_failed":
                    tried.add(index)
                    failure = e
                    continue  # never reached it: another replica can take the request as it is
                return APIError(502, e.detail, code="engine_failed").response()
            except BaseException:
                release()
                raise
            dead = _engine_dead_detail(upstream)
            if dead is not None:  # refused by a replica whose engine thread has stopped: never ran there
                release()
                st.metrics.on_failed(index, "engine_dead")
                st.mark_dead(index, dead)
                st.retire(index)  # a process without an engine serves nothing
                continue
            if count:
                st.metrics.on_routed(decision)
            return self._respond(upstream, index, release)
        if failure is not None and st.live():
            return APIError(502, failure.detail, code="engine_failed").response()
        st.metrics.on_rejected("no_live_replica")
        return APIError(503, "no engine is alive to serve this request: every data-parallel replica has died (see "
                             "/ready); restart the server", code="no_live_replica").response()

    async def _send(self, raw: Request, replica: ReplicaProcess, path: str, body: bytes, headers):
        """The upstream response with its headers read (the body not yet), or ReplicaFailed. A
        client disconnecting meanwhile cancels it (closing the upstream connection: the replica aborts)."""
        st = self.state
        req = st.client.build_request(raw.method, replica.url + path, content=body, headers=headers)
        sending = asyncio.ensure_future(st.client.send(req, stream=True))
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if sending not in done:
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
                raise ClientGone()
            try:
                upstream = sending.result()
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:  # never sent: another replica can take it
                raise await self._failure(replica, "connection_failed", e) from None
            except httpx2.TransportError as e:
                raise await self._failure(replica, "replica_died", e) from None
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return upstream
            # A whole body (JSON): read it here, still watching for the client leaving.
            reading = asyncio.ensure_future(upstream.aread())
            done, _ = await asyncio.wait({reading, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if reading not in done:
                reading.cancel()
                with contextlib.suppress(BaseException):
                    await reading
                await upstream.aclose()
                raise ClientGone()
            try:
                reading.result()
            except httpx2.TransportError as e:
                await upstream.aclose()
                raise await self._failure(replica, "replica_died", e) from None
            return upstream
        finally:
            watcher.cancel()

    async def _failure(self, replica: ReplicaProcess, reason: str, err: Exception) -> ReplicaFailed:
        st = self.state
        # A killed process closes its sockets a moment before it can be reaped: wait that moment,
        # so the error says why (and a request that never reached it can go elsewhere).
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        while replica.exit_code() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        code = replica.exit_code()
        if code is not None:
            st.mark_dead(replica.index, replica.describe_exit())
        # Why the front end marked it dead (e.g. stuck, then killed) says more than its exit status.
        what = (st.dead_detail.get(replica.index) or replica.describe_exit() if code is not None
                else f"{type(err).__name__}: {err}")
        if reason == "connection_failed":
            detail = f"engine {replica.index} could not be reached ({what}); the request was not sent"
        else:
            detail = (f"engine {replica.index} failed while serving this request ({what}); the request was not "
                      f"completed: retry it (the other engines keep serving)")
        return ReplicaFailed(replica.index, reason, detail)

    def _respond(self, upstream: httpx2.Response, index: int, release) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP | SERVER_SET}
        headers[ENGINE_HEADER] = str(index)
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            release()
            return Response(upstream.content, status_code=upstream.status_code, headers=headers)
        replica = self.state.replicas[index]

        async def events():
            pending = b""
            try:
                async for chunk in upstream.aiter_raw():
                    pending += chunk
                    cut = pending.rfind(b"\n\n")
                    if cut >= 0:  # whole events only, so a failure below never splits one
                        yield pending[:cut + 2]
                        pending = pending[cut + 2:]
            except httpx2.TransportError as e:
                failure = await self._failure(replica, "replica_died", e)
                self.state.metrics.on_failed(index, failure.reason)
                yield f"data: {_json(APIError(502, failure.detail, code='engine_failed').body())}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return
            if pending:
                yield pending

        async def on_close():
            try:
                await upstream.aclose()  # before its end: closes the connection, so the replica aborts the request
            finally:
                release()  # even when closing fails or is cancelled: a leaked in_flight skews routing forever

        return _ClosingStream(events(), upstream.status_code, headers, on_close)


def _engine_dead_detail(upstream: httpx2.Response) -> str | None:
    """Why a replica's engine thread stopped, when this (whole, read) response says it did: a 503
    with code engine_dead (the replica's EngineDeadError) or /health's status engine_dead."""
    if upstream.status_code != 503 or upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return None
    try:
        body = upstream.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and err.get("code") == "engine_dead":
        return f"its engine thread stopped: {err.get('message')}"
    if body.get("status") == "engine_dead":
        return f"its engine thread stopped: {body.get('detail')}"
    return None


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Once:
    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class _ClosingStream(StreamingResponse):
    """A passed-through stream whose upstream is closed however it ends (done, client gone, error),
    even when it never started."""

    def __init__(self, content, status_code: int, headers: dict, on_close) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _wait_disconnect(raw: Request) -> None:
    # The body is read, so the next ASGI message is http.disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


# ---- replica supervision ------------------------------------------------------------------------

async def wait_replicas_ready(state: FrontendState, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(len(state.replicas)))
    while pending:
        for i in sorted(pending):
            rep = state.replicas[i]
            if rep.exit_code() is not None:
                tail = "\n".join(list(rep.log_tail)[-15:])
                raise RuntimeError(f"engine {i} {rep.describe_exit()} while starting; its last output:\n{tail}")
            try:
                resp = await state.client.get(rep.url + "/ready", timeout=5)
                if resp.status_code == 200:
                    pending.discard(i)
                    logger.info("engine %d is ready", i)
            except httpx2.TransportError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine(s) {sorted(pending)} not ready after {timeout:.0f}s")
        if pending:
            await asyncio.sleep(0.25)


async def _wait_started(state: FrontendState) -> None:
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(10.0)) as client:
        state.client = client
        try:
            await wait_replicas_ready(state)
        finally:
            state.client = None
    state.started = True


def log_task_failure(task: asyncio.Task) -> None:
    """Done-callback of the front end's background tasks: one that ends with an exception says so
    (asyncio would only mention it when the task is garbage-collected, if ever)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("data-parallel background task %s failed: %s", task.get_name(), exc,
                     exc_info=(type(exc), exc, exc.__traceback__))


def start_background(state: FrontendState, subscribers: list[KVEventSubscriber]) -> list[asyncio.Task]:
    """The KV event subscribers, the process monitor and the poller, each logging how it failed."""
    named = [(s.run(), f"kv-events-engine-{s.replica.index}") for s in subscribers]
    named += [(monitor_replicas(state), "monitor-replicas"), (poll_replicas(state), "poll-replicas")]
    tasks = []
    for coro, name in named:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(log_task_failure)
        tasks.append(task)
    return tasks


async def monitor_replicas(state: FrontendState) -> None:
    """Notice a replica process exiting (SIGKILL, crash, OOM) within MONITOR_SECONDS."""
    while True:
        for rep in state.replicas:
            try:
                if state.router.replicas[rep.index].alive and rep.exit_code() is not None:
                    state.mark_dead(rep.index, rep.describe_exit())
            except Exception:  # one replica's trouble must not stop watching the others
                logger.exception("checking engine %d's process failed", rep.index)
        await asyncio.sleep(MONITOR_SECONDS)


async def poll_replicas(state: FrontendState) -> None:
    """Each live replica's /health (a replica whose engine thread stopped is dead, though its
    process lives) and KV usage (for the router's tie-breaks and /ready), all replicas at once (a
    stuck one must not delay the others' readings)."""
    while True:
        polled = [rep for rep in state.replicas if state.router.replicas[rep.index].alive and not state.draining]
        for rep, result in zip(polled, await asyncio.gather(*(poll_replica(state, r) for r in polled),
                                                            return_exceptions=True)):
            if isinstance(result, Exception):
                logger.error("polling engine %d failed: %s", rep.index, result,
                             exc_info=(type(result), result, result.__traceback__))
        await asyncio.sleep(state.poll_seconds)


async def poll_replica(state: FrontendState, rep: ReplicaProcess) -> None:
    view = state.router.replicas[rep.index]
    try:
        health = await state.client.get(rep.url + "/health", timeout=state.poll_timeout)
        dead = _engine_dead_detail(health)
        if dead is not None:
            state.mark_dead(rep.index, dead)
            state.retire(rep.index)
            return
        resp = await state.client.get(rep.url + "/metrics", timeout=state.poll_timeout)
    except httpx2.TimeoutException as e:
        # Connect or read: a process that accepts nothing or answers nothing serves nothing either.
        n = state.poll_timeouts[rep.index] = state.poll_timeouts.get(rep.index, 0) + 1
        if not view.alive or state.draining:
            return
        if n < state.stuck_polls:
            logger.warning("engine %d did not answer a poll within %.1fs (%s; %d of %d before it is killed)",
                           rep.index, state.poll_timeout, type(e).__name__, n, state.stuck_polls)
            return
        state.mark_dead(rep.index, f"stuck: no answer to /health or /metrics within {state.poll_timeout:g}s, "
                                   f"{n} times in a row; killed by SIGKILL")
        rep.signal(signal.SIGKILL)  # its connections close: its requests in flight fail now, not never
        return
    except httpx2.TransportError:
        return  # refused or reset: an exited process is the monitor's to notice
    state.poll_timeouts[rep.index] = 0
    m = _KV_USAGE.search(resp.content)
    if m:
        with contextlib.suppress(ValueError):
            view.kv_usage = float(m.group(1))


# ---- the app ------------------------------------------------------------------------------------

def new_upstream_client() -> httpx2.AsyncClient:
    """The front end's client to the replicas. No read timeout (a generation may take minutes; a
    stuck replica is found by the poller instead); pooled connections expire before the replicas'
    keep-alive does (KEEPALIVE_EXPIRY_SECONDS)."""
    return httpx2.AsyncClient(timeout=httpx2.Timeout(None, connect=5.0),
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64,
                                                   keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS))


def build_frontend_app(state: FrontendState, subscribers: list[KVEventSubscriber]) -> Starlette:
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
        Route("/detokenize", proxy.passthrough, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_allowed, APIError: api_error,
                                        InvalidRequestError: invalid, Exception: internal})
    app.add_middleware(GuardMiddleware, state=state)
    return app


class DrainingFrontend(uvicorn.Server):
    """SIGTERM / Ctrl+C: refuse new requests, SIGTERM every replica, wait for them to drain and
    exit, then stop. A second signal kills the replicas and exits at once."""

    def __init__(self, config: uvicorn.Config, state: FrontendState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving (exit -15, not 0).
        if self.state.draining or self._loop is None or not self.state.started:
            for rep in self.state.replicas:
                rep.signal(signal.SIGKILL)
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        st = self.state
        loop = asyncio.get_running_loop()
        logger.info("shutting down: draining %d engine(s) with %d request(s) in flight", len(st.live()), st.inflight)
        for rep in st.replicas:
            rep.signal(signal.SIGTERM)
        deadline = loop.time() + st.config.shutdown_timeout + ABORT_GRACE_SECONDS + DRAIN_MARGIN_SECONDS
        while any(rep.exit_code() is None for rep in st.replicas) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rep in st.replicas:
            if rep.exit_code() is None:
                logger.warning("engine %d did not exit after draining; killing it", rep.index)
                st.killed_after_drain.append(rep.index)
                rep.signal(signal.SIGKILL)
        grace = loop.time() + 5.0  # for the last bytes of passed-through responses
        while st.inflight > 0 and loop.time() < grace:
            await asyncio.sleep(0.05)
        self.should_exit = True


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
    """Run the front end until drained; `replica_argv(index, port, events, replay)` gives one
    replica's `kvshare serve` arguments. Returns the exit status."""
    from kvshare.model.loader import load_tokenizer
    from kvshare.server.state import default_model_name

    # Each proxied request would be logged twice (httpx2's line and the access log's).
    logging.getLogger("httpx2").setLevel(logging.WARNING)
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
                events = offset_endpoint(options.kv_events_endpoint, r, "--kv-events-endpoint")
                replay = (offset_endpoint(options.kv_events_replay_endpoint, r, "--kv-events-replay-endpoint")
                          if options.kv_events_replay_endpoint else f"ipc://{socket_dir}/engine-{r}.replay")
            else:
                events = f"ipc://{socket_dir}/engine-{r}.events"
                replay = f"ipc://{socket_dir}/engine-{r}.replay"
            sock = bind_loopback_socket()
            port = sock.getsockname()[1]
            threads, cpus = shares[r]
            launch = ReplicaLaunch(index=r, port=port,
                                   argv=replica_argv(r, port, events, replay) + ["--listen-fd", str(sock.fileno())],
                                   kv_events_endpoint=events, kv_events_replay_endpoint=replay,
                                   omp_threads=threads, cpus=cpus, api_key=config.api_key, listen_fd=sock.fileno())
            replicas.append(ReplicaProcess(launch, listen_socket=sock))
        state = FrontendState(config=config, options=options, metrics=RouterMetrics(name, options.size, options.policy),
                              router=router, replicas=replicas, tokenizer=tokenizer, model_name=name)
        for rep, view in zip(replicas, router.replicas):
            subscribers.append(KVEventSubscriber(ctx, view, connect_endpoint(rep.launch.kv_events_endpoint),
                                                 connect_endpoint(rep.launch.kv_events_replay_endpoint),
                                                 options.kv_events_topic))
        app = build_frontend_app(state, subscribers)
        uv = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, log_level=config.log_level,
                            access_log=config.access_log, timeout_graceful_shutdown=5, lifespan="on")
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


def exit_status(state: FrontendState) -> int:
    """0 after a clean drain; 1 when replicas had to be killed at the drain timeout or every
    replica died while serving (a supervisor should see that this run went wrong)."""
    if state.killed_after_drain:
        logger.error("exiting with status 1: engine(s) %s had to be killed after the drain timeout",
                     ", ".join(map(str, state.killed_after_drain)))
        return 1
    if state.died == len(state.replicas):
        logger.error("exiting with status 1: every engine died while serving")
        return 1
    return 0


def new_hash_seed() -> str:
    """A seed private to this front end and its replicas (block hashes are not comparable with
    any other process's, as without a seed)."""
    return secrets.token_hex(16)
