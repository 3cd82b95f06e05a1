"""The FastAPI app: routes, and every error turned into OpenAI's shape (400, never FastAPI's 422)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from kvshare import __version__
from kvshare.errors import InvalidRequestError
from kvshare.server.body_deadline import BodyDeadlineMiddleware
from kvshare.server.dashboard import add_dashboard_routes
from kvshare.server.errors import APIError
from kvshare.server.kv_routes import add_kv_view_routes
from kvshare.server.lora_routes import adapter_cards, add_lora_routes
from kvshare.server.middleware import GuardMiddleware
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvshare.server.serving import OpenAIServing
from kvshare.server.state import ServerState
from kvshare.server.tokenize import LONG_BODY, TokenizeServing

logger = logging.getLogger("kvshare.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.stop()

    app = FastAPI(title="kvshare", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvshare = state
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(BodyDeadlineMiddleware, timeout=state.config.request_body_timeout)  # outside the guard
    serving = OpenAIServing(state)
    tokenizing = TokenizeServing(state)
    registry = state.metrics.registry(state.engine.metrics_snapshot)
    _add_error_handlers(app, state)

    limits = {"max_prompts": state.config.max_sequences_per_request}

    async def parse(raw: Request, model):
        body = await raw.body()
        if len(body) > LONG_BODY:  # JSON, Unicode checks and validation of a big body: off the event loop
            return await asyncio.to_thread(parse_body, body, model, limits)
        return parse_body(body, model, limits)

    probe = ["GET", "HEAD"]

    @app.api_route("/health", methods=probe)
    async def health():
        if state.engine.dead is not None:
            return JSONResponse({"status": "engine_dead", "detail": state.engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.api_route("/ready", methods=probe)
    async def ready():
        eng = state.engine
        age = eng.heartbeat_age()
        body = {"engine_step": eng.snapshot.step, "heartbeat_age_s": round(age, 3)}
        if not eng.is_alive():
            return JSONResponse({"status": "engine_dead", "detail": eng.dead, **body}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", **body}, status_code=503)
        if age > state.config.ready_stall_seconds:
            return JSONResponse({"status": "stalled", **body}, status_code=503)
        return {"status": "ready", **body}

    @app.api_route("/metrics", methods=probe)
    async def metrics():
        return PlainTextResponse(generate_latest(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.api_route("/version", methods=probe)
    async def version():
        gaps = state.transparency_gaps
        if gaps is None:
            return {"version": __version__}
        # vLLM's /version has only "version"; the rest tells `kvshare doctor --url` whether to demand
        # exact equality (bit-transparent) or judge against the measured noise floor.
        return {"version": __version__, "bit_transparent": not gaps, "transparency_gaps": list(gaps)}

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvshare",
                "root": state.model_source, "parent": None, "max_model_len": state.max_model_len}

    @app.api_route("/v1/models", methods=probe)
    async def models():
        return {"object": "list", "data": [model_card()] + adapter_cards(state)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if state.adapters.resolve(model_id, state.model_name) is None:
            return model_card()
        return next(c for c in adapter_cards(state) if c["id"] == model_id)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving.completions(await parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving.chat(await parse(raw, ChatCompletionRequest), raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await tokenizing.tokenize(await raw.body())

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await tokenizing.detokenize(await raw.body())

    add_kv_view_routes(app, state)
    add_lora_routes(app, state)
    add_dashboard_routes(app)

    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def reply(err: APIError, reason: str):
        state.metrics.on_rejected(reason)
        if state.config.log_prompts:
            logger.info("refused with %d (param=%s): %s", err.status, err.param, err.message)
        else:  # messages can quote the request, so they stay out of the log by default
            logger.info("refused with %d (param=%s, code=%s)", err.status, err.param, err.code)
        return err.response()

    @app.exception_handler(APIError)
    async def api_error(_req, exc: APIError):
        reason = {404: "not_found", 429: "queue_full", 503: "engine_dead"}.get(exc.status, "invalid_request")
        return reply(exc, reason)

    @app.exception_handler(InvalidRequestError)
    async def invalid(_req, exc: InvalidRequestError):
        return reply(APIError(400, str(exc), param=exc.param), "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def validation(_req, exc: RequestValidationError):
        # Bodies are parsed by parse_body; this covers whatever FastAPI itself validates.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return reply(APIError(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}",
                              param=".".join(loc) or None), "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(req: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (f"no route {req.method} {req.url.path}: see /v1/models, /v1/completions, /v1/chat/completions, "
                   f"/tokenize, /detokenize, /kv/snapshot, /kv/events")
        elif exc.status_code == 405:
            msg = f"method {req.method} is not allowed on {req.url.path}"
        else:
            msg = str(exc.detail)
        return reply(APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None,
                              headers=getattr(exc, "headers", None)), "not_found" if exc.status_code == 404
                     else "invalid_request")

    @app.exception_handler(Exception)
    async def internal(_req, exc: Exception):
        logger.exception("internal error")
        return APIError(500, f"internal server error ({type(exc).__name__}); the request was not completed",
                        code="internal_error").response()
