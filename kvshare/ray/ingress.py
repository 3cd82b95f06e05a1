"""The OpenAI front of the Ray Serve application: a Serve ingress deployment that tokenizes each
completion and chat request exactly as a replica does (as the data-parallel front end does,
kvshare.server.dp_proxy.prompt_for_routing) and hands the token ids to the engine
deployment's request router (kvshare.ray.request_router) with the call, which picks the replica.

Bodies go to the replica as they came and its answer comes back as it sent it: the replica runs
the same app as `kvshare serve`, so statuses, errors, headers and streams are a single server's,
plus x-kvshare-engine (the replica's rank), x-kvshare-replica (its Serve id) and
x-kvshare-routing (the router's reason and prefix match). A client that disconnects cancels the
call, so the replica aborts the request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvshare.errors import InvalidRequestError
from kvshare.server.dp_proxy import HOP_BY_HOP, LONG_BODY, prompt_for_routing
from kvshare.server.errors import APIError
from kvshare.server.middleware import bearer_key_matches, unauthorized
from kvshare.server.settings import DEFAULT_MAX_BODY_BYTES, ServerConfig

logger = logging.getLogger("kvshare.ray")

PROBE_TIMEOUT_SECONDS = 10.0  # a replica that does not answer /ready's probe in this long is listed as not answering
# The replica's copies would be doubles of what Serve's proxy writes, or wrong once re-framed.
DROPPED_HEADERS = HOP_BY_HOP | {"date", "server"}


class OpenAIIngress:
    """The Serve ingress class (kvshare.ray.build_app wraps it with serve.ingress and serve.deployment)."""

    def __init__(self, engine, model: str | None, model_name: str, chat_template: str | None,
                 api_key: str | None, num_replicas: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 server_config: ServerConfig | None = None) -> None:
        from kvshare.model.loader import load_tokenizer

        self.engine = engine  # the engine deployment's handle; its router is kvshare's
        self.tokenizer = load_tokenizer(model)
        self.model_name = model_name
        self.chat_template = chat_template
        self.api_key = api_key
        self.num_replicas = num_replicas
        self.max_body_bytes = max_body_bytes  # the replicas' own limit, enforced before tokenizing
        # The replicas' request limits (prompts x n, tools, template kwargs and render time), so
        # the ingress's routing parse and render stop where a replica's would.
        self.server_config = server_config

    def __serve_build_asgi_app__(self) -> Starlette:
        probe = ["GET", "HEAD"]
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.passthrough, methods=probe),
            Route("/v1/models/{model_id:path}", self.passthrough, methods=["GET"]),
            Route("/tokenize", self.passthrough, methods=["POST"]),
            Route("/detokenize", self.passthrough, methods=["POST"]),
            Route("/health", self.passthrough, methods=probe),
            Route("/ready", self.ready, methods=probe),
        ]

        async def not_found(req: Request, _exc=None):
            return APIError(404, f"no route {req.method} {req.url.path}: see /v1/models, /v1/completions, "
                                 f"/v1/chat/completions, /tokenize, /detokenize, /health, /ready",
                            code="not_found").response()

        async def not_allowed(req: Request, _exc=None):
            return APIError(405, f"method {req.method} is not allowed on {req.url.path}").response()

        async def api_error(_req, exc: APIError):
            return exc.response()

        async def invalid(_req, exc: InvalidRequestError):
            return APIError(400, str(exc), param=exc.param).response()

        async def internal(_req, exc: Exception):
            logger.exception("internal error in the kvshare Ray ingress")
            return APIError(500, f"internal server error ({type(exc).__name__}); the request was not completed",
                            code="internal_error").response()

        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, APIError: api_error,
                                                            InvalidRequestError: invalid, Exception: internal})

    # ---- routes -----------------------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        return await self._routed(raw, chat=False)

    async def chat(self, raw: Request) -> Response:
        return await self._routed(raw, chat=True)

    async def _routed(self, raw: Request, chat: bool) -> Response:
        self._check_key(raw)  # before tokenizing: an unauthorized body is not read for routing
        body = await self._body(raw)
        try:
            if len(body) > LONG_BODY or chat:  # chat_template_kwargs can make a small body slow to render
                token_ids, salt = await asyncio.to_thread(prompt_for_routing, self.tokenizer, self.chat_template,
                                                          body, chat, self.server_config)
            else:
                token_ids, salt = prompt_for_routing(self.tokenizer, self.chat_template, body, chat,
                                                     self.server_config)
        except (InvalidRequestError, APIError):
            raise
        except Exception:  # not the ingress's to judge: route by load, the replica answers
            logger.exception("could not tokenize a request for routing; routing it by load")
            return await self._forward(raw, body, None)
        return await self._forward(raw, body, {"token_ids": token_ids, "cache_salt": salt})

    async def passthrough(self, raw: Request) -> Response:
        """A request any replica answers alike: the least loaded one. The key is checked here as
        the replica would (all but /health), so an unauthorized call costs no replica a request."""
        if raw.url.path != "/health":
            self._check_key(raw)
        return await self._forward(raw, await self._body(raw), None)

    async def _body(self, raw: Request) -> bytes:
        """The body, refused with 413 past max_body_bytes (as `kvshare serve` does): by its
        Content-Length before reading, else as soon as what arrived is over the limit, so an
        oversized body is neither held whole nor tokenized."""
        limit = self.max_body_bytes
        declared = raw.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise APIError(400, f"Content-Length {declared[:40]!r} is not a number", code="invalid_header") from None
            if size > limit:
                raise _too_large(f"{size} bytes", limit)
        chunks, total = [], 0
        async for chunk in raw.stream():
            total += len(chunk)
            if total > limit:
                raise _too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def ready(self, raw: Request) -> Response:
        """Every replica by rank: its own view of its prefix cache beside the router's view of it
        (from its KV events); they agree once the replica's last events have arrived.

        Without the API key (when one is set) only the statuses: a load balancer's probe needs
        nothing more, and the details (counters, endpoints, cache digests, which cost the replica
        and the router a pass over every cached hash) are the operator's."""
        detail = self.api_key is None or self._authorized(raw)

        def not_answering(rank: int, why: str) -> dict:
            return {"rank": rank, "status": "not_answering", **({"detail": why} if detail else {})}

        async def one(rank: int) -> dict:
            call = self.engine.kv_state.remote(route={"engine_rank": rank, "detail": detail}, detail=detail)
            try:
                row = await asyncio.wait_for(_result(call), PROBE_TIMEOUT_SECONDS)
            except Exception as e:  # noqa: BLE001 - every failure is reported in the body
                call.cancel()
                return not_answering(rank, f"{type(e).__name__}: {e}")
            if row["rank"] != rank:  # the router pins by rank: another replica answering is a bug to see
                return not_answering(rank, f"rank {row['rank']} answered instead")
            return {"status": "ready", **row} if detail else {"rank": rank, "status": "ready"}

        # One after another: calls made while serving one request share Serve's internal request
        # id, and Serve hands a routed replica to the pending call with that id, which concurrent
        # probes would mix up.
        rows = [await one(r) for r in range(self.num_replicas)]
        answering = [r for r in rows if r.get("status") != "not_answering"]
        status = "ready" if len(answering) == len(rows) else ("degraded" if answering else "engine_dead")
        return JSONResponse({"status": status, "replicas": self.num_replicas, "engines": rows},
                            status_code=200 if answering else 503)

    # ---- forwarding -------------------------------------------------------------------------------
    def _authorized(self, raw: Request) -> bool:
        return bearer_key_matches(raw.headers.get("authorization", ""), self.api_key)

    def _check_key(self, raw: Request) -> None:
        if self.api_key is not None and not self._authorized(raw):
            raise unauthorized()  # the same 401 as `kvshare serve`

    async def _forward(self, raw: Request, body: bytes, route: dict | None) -> Response:
        # No accept-encoding: the replica answers uncompressed, so bodies pass through byte for byte.
        headers = [(k, v) for k, v in raw.headers.items() if k.lower() not in HOP_BY_HOP | {"accept-encoding"}]
        call = self.engine.options(stream=True).handle_http.remote(raw.method, raw.url.path, raw.url.query,
                                                                   headers, body, route=route)
        try:
            head = await call.__anext__()
        except asyncio.CancelledError:  # the client left (Serve cancels this handler): so does the call
            call.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            call.cancel()
            return _engine_failed(e, started=False).response()
        out_headers = {k: v for k, v in head["headers"] if k.lower() not in DROPPED_HEADERS}
        if not out_headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = b"".join([chunk async for chunk in call])
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as e:  # noqa: BLE001
                call.cancel()
                return _engine_failed(e, started=True).response()
            return Response(content, status_code=head["status"], headers=out_headers)

        async def events():
            finished = False
            try:
                async for chunk in call:
                    yield chunk
                finished = True
            except Exception as e:  # noqa: BLE001 - mid-stream: an error event, then the end
                finished = True
                err = _engine_failed(e, started=True)
                yield f"data: {json.dumps(err.body(), separators=(',', ':'))}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                if not finished:  # the client left: the replica aborts the request
                    call.cancel()

        return StreamingResponse(events(), status_code=head["status"], headers=out_headers)


async def _result(call):
    return await call


def _too_large(got: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {got}; the limit is {limit} bytes (max_body_bytes)",
                    code="request_too_large")


def _engine_failed(err: Exception, started: bool) -> APIError:
    logger.error("a kvshare replica failed a request: %s: %s", type(err).__name__, err)
    what = "failed while serving this request" if started else "could not take this request"
    return APIError(502, f"the engine replica {what} ({type(err).__name__}); the request was not completed: retry "
                         f"it (Serve replaces a dead replica)", code="engine_failed")
