"""The data-parallel front end's reverse proxy (kvshare.server.data_parallel): routes each API
request to a replica and passes its answer through, streams event by event.

Bodies are passed through untouched; streams chunk by chunk (whole server-sent events). A client
that disconnects closes the upstream request, so the replica aborts it. A request that could not
be sent (connection refused or timed out) goes to another replica; one whose replica dies while it
runs fails with 502 engine_failed naming the replica (mid-stream: an error event, then [DONE]).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse

import httpx2
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvshare.errors import InvalidRequestError
from kvshare.server.chat import render_chat_prompt
from kvshare.server.dp_state import FrontendState
from kvshare.server.errors import APIError
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvshare.server.replica import ReplicaProcess
from kvshare.server.routing import RoutingDecision
from kvshare.server.tenants import effective_cache_salt

logger = logging.getLogger("kvshare.server")

ENGINE_HEADER = "x-kvshare-engine"  # which replica answered: for clients and tests that want to know

EXIT_WAIT_SECONDS = 0.5  # after a failed connection or read: how long to wait to see the process exit

# Below the replicas' keep-alive (uvicorn's timeout_keep_alive, 5 s): a pooled connection is never
# reused just as the replica closes it, which would fail a request that never reached it.
KEEPALIVE_EXPIRY_SECONDS = 2.0

LONG_BODY = 16 * 1024  # bytes; tokenizing a body larger than this for routing runs off the event loop

# Never forwarded: they describe one connection, not the request (RFC 9110 7.6.1), or are recomputed.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-authorization", "proxy-authenticate", "host", "content-length"})

# The front end's own server writes these on every response; the replica's copies would be doubles.
SERVER_SET = frozenset({"date", "server"})


def new_upstream_client() -> httpx2.AsyncClient:
    """The front end's client to the replicas. No read timeout (a generation may take minutes; a
    stuck replica is found by the poller instead); pooled connections expire before the replicas'
    keep-alive does (KEEPALIVE_EXPIRY_SECONDS)."""
    return httpx2.AsyncClient(timeout=httpx2.Timeout(None, connect=5.0),
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64,
                                                   keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS))



class ClientGone(Exception):
    """The client disconnected before its response started: nothing is left to answer."""



class ReplicaFailed(Exception):
    def __init__(self, index: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.index = index
        self.reason = reason
        self.detail = detail



def prompt_for_routing(tokenizer, chat_template: str | None, body: bytes, chat: bool,
                       config=None) -> tuple[list[int], str | None]:
    """The first prompt's token ids as a replica computes them, and the request's cache_salt.
    Raises InvalidRequestError for a body a replica would refuse (the same check, so the same 400).
    Shared with the Ray Serve ingress (kvshare.ray), which routes the same way."""
    limits = {"max_prompts": config.max_sequences_per_request} if config is not None else None
    req = parse_body(body, ChatCompletionRequest if chat else CompletionRequest, limits)
    if chat:
        ids = render_chat_prompt(tokenizer, req, chat_template, config).token_ids
    else:
        first = req.prompt[0]
        if isinstance(first, str):
            if tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = tokenizer.encode(first) if first else []
        else:
            ids = list(first)
    return ids, req.cache_salt


class Proxy:
    """Routes and forwards the API requests."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    # ---- routing input ------------------------------------------------------------------------
    def _prompt_for_routing(self, body: bytes, chat: bool) -> tuple[list[int], str | None]:
        return prompt_for_routing(self.state.tokenizer, self.state.config.chat_template, body, chat,
                                  self.state.config)

    async def routing_input(self, body: bytes, chat: bool) -> tuple[list[int], str | None]:
        try:
            if len(body) > LONG_BODY or chat:  # chat_template_kwargs can make a small body slow to render
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
        salt = effective_cache_salt(st.config, raw.scope, salt)  # what the replica will cache under
        cap = st.capacity()
        busy = sum(r.in_flight for r in st.router.replicas if r.alive)
        if cap is not None and busy >= cap:
            retry = st.config.retry_after_seconds
            st.metrics.on_rejected("queue_full")
            return APIError(429, f"server is at capacity: {busy} requests already run or wait on {len(st.live())} "
                                 f"engine(s) (--max-num-seqs {st.options.max_num_seqs} + --max-waiting "
                                 f"{st.config.max_waiting} each); retry after {retry}s", code="queue_full",
                            headers={"Retry-After": str(retry)}).response()
        adapter = self._adapter_named(body)
        hashes = st.router.prompt_hashes(token_ids, salt, adapter) if adapter is not None else None
        return await self._forward(raw, body, lambda tried: st.router.route(token_ids, salt, exclude=tried,
                                                                             hashes=hashes))

    def _adapter_named(self, body: bytes) -> str | None:
        """The --lora-modules adapter the (already validated) body's `model` names, or None."""
        if not self.state.options.lora_modules:
            return None
        model = json.loads(body).get("model")
        return model if model in self.state.options.lora_modules else None

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
        path = upstream_path(raw)
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



def upstream_path(raw: Request) -> str:
    """The path (and query) to send a replica: the request's own, percent-encoded again, and
    never one with '.' or '..' segments (also sent as %2e): the upstream client resolves those,
    so /v1/models/../../kv/snapshot would reach a replica-only route."""
    path = raw.scope["path"]  # decoded: %2e%2e is '..' here
    if any(segment in (".", "..") for segment in path.split("/")):
        raise APIError(404, f"no route {raw.method} {path[:200]}: the data-parallel front end forwards no path with "
                            f"'.' or '..' segments", code="not_found")
    query = raw.scope.get("query_string", b"").decode("latin-1")
    return urllib.parse.quote(path, safe="/") + (f"?{query}" if query else "")


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

