"""The live KV view's data endpoints: GET /kv/snapshot (the pool block by block, JSON) and
GET /kv/events (block events, one server-sent event per engine step). Both sit behind --api-key
when one is set (GuardMiddleware). The snapshot is taken on the engine thread between steps,
never beside a running one (or, once the engine has stopped, from the state it stopped in), and
shared by every viewer until the engine's state changes (SharedSnapshot); the events are
serialized once per step for every viewer (kv_stream.KVEventHub)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvshare.engine.kv_view import select_blocks
from kvshare.server.errors import APIError, EngineDeadError
from kvshare.server.kv_stream import (DEFAULT_QUEUE_BATCHES, EventRedactor, KVEventHub, sse_message,
                                      step_message)
from kvshare.server.serving import ClosingSSEResponse
from kvshare.server.state import ServerState

logger = logging.getLogger("kvshare.server")

POLL_SECONDS = 1.0  # how soon an idle stream notices a shutdown
KEEPALIVE_SECONDS = 15.0  # a comment line on an idle stream, so proxies and clients keep it open
MAX_QUEUE_BATCHES = 4096


def choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, value: str) -> str:
        if value not in allowed:
            raise APIError(400, f"{name}={value!r} is invalid: choose from {', '.join(allowed)}", param=name)
        return value
    return parse


def int_in(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or not low <= n <= high:
            raise APIError(400, f"{name}={value!r} is invalid: must be an integer in [{low}, {high}]", param=name)
        return n
    return parse


def read_query(raw: Request, accepted: dict[str, Callable[[str, str], object]]) -> dict:
    """The query parameters, each checked; an unknown one is a 400 naming it (a typo must not
    silently give the default)."""
    out: dict = {}
    for name, value in raw.query_params.multi_items():
        parse = accepted.get(name)
        if parse is None:
            known = ", ".join(accepted) if accepted else "none"
            raise APIError(400, f"unknown query parameter '{name}' on {raw.url.path} (accepted: {known})",
                           param=name, code="unknown_parameter")
        out[name] = parse(name, value)
    return out


class SharedSnapshot:
    """One pass over the pool for every /kv/snapshot viewer: the requests that arrive while one is
    being taken wait for it, and until the engine next adds, aborts or steps (its state_version)
    everyone gets that one, each `blocks` choice serialized once. N viewers polling cost the
    engine thread one O(blocks) pass per step at most, never N."""

    def __init__(self, engine) -> None:
        self.engine = engine  # the AsyncEngine
        self._taking: asyncio.Future | None = None
        self._version: int | None = None  # the engine's state_version the snapshot was taken at
        self._snapshot: dict = {}
        self._bodies: dict[str, bytes] = {}  # blocks choice -> JSON of the current snapshot

    async def body(self, blocks: str) -> bytes:
        if self._version != self.engine.state_version:
            if self._taking is None:
                self._taking = asyncio.ensure_future(self._take())
            # Shielded: one viewer leaving must not cancel the pass the others wait for.
            await asyncio.shield(self._taking)
        if blocks not in self._bodies:
            self._bodies[blocks] = JSONResponse(select_blocks(self._snapshot, blocks)).body
        return self._bodies[blocks]

    async def _take(self) -> None:
        def read() -> tuple[int, dict]:
            return self.engine.state_version, self.engine.engine.kv_snapshot()

        try:
            self._version, self._snapshot = await self.engine.call(read)
            self._bodies = {}
        finally:
            self._taking = None


async def dead_engine_reply(engine, read: Callable[[], dict]) -> JSONResponse:
    """/kv/snapshot once the engine has stopped: still a 503 (engine_dead) for scripts, but with
    the pool as the engine left it and the failed audit's verdict, so a page opened or reloaded
    after an audit stopped the engine still shows which invariant broke on which block."""
    err = EngineDeadError(engine.dead or "stopped")
    try:
        snap = await engine.read_stopped(read)
    except Exception:  # noqa: BLE001 - a pool too broken to read: the verdict alone
        logger.exception("the stopped engine's pool could not be read for /kv/snapshot")
        snap = None
    return JSONResponse({**err.body(), "audit_failure": engine.audit_failure, "snapshot": snap},
                        status_code=err.status)


def add_kv_view_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine
    hub = KVEventHub(engine, EventRedactor(show_tokens=state.config.log_prompts))
    shared = SharedSnapshot(engine)
    snapshot_query = {"blocks": choice("all", "held", "none")}
    events_query = {"queue": int_in(1, MAX_QUEUE_BATCHES)}

    @app.get("/kv/snapshot")
    async def snapshot(raw: Request):
        blocks = read_query(raw, snapshot_query).get("blocks", "all")
        if engine.dead is None:
            try:
                return Response(await shared.body(blocks), media_type="application/json")
            except EngineDeadError:
                pass  # it stopped while this waited: answered as below
        return await dead_engine_reply(engine, lambda: engine.engine.kv_snapshot(blocks))

    @app.get("/kv/events")
    async def events(raw: Request):
        max_batches = read_query(raw, events_query).get("queue", DEFAULT_QUEUE_BATCHES)
        sub = await hub.subscribe(max_batches)
        layout = engine.engine.layout  # fixed sizes only: safe to read off the engine thread
        hello = json.dumps({"step": engine.snapshot.step, "num_blocks": layout.num_blocks,
                            "block_size": layout.block_size, "queue": max_batches})

        async def messages():
            yield sse_message("hello", hello)
            idle = 0.0
            while not state.draining and engine.dead is None:
                got = await sub.get(POLL_SECONDS)
                if got is not None:
                    idle = 0.0
                    yield step_message(*got)
                    continue
                idle += POLL_SECONDS
                if idle >= KEEPALIVE_SECONDS:
                    idle = 0.0
                    yield ": keepalive\n\n"
            # Whatever the engine handed over before it stopped (a failed audit's verdict): its
            # hand-over was queued on this loop before `dead` was set, so one turn delivers it.
            await asyncio.sleep(0)
            while sub.queue:
                yield step_message(*(await sub.get(0)))

        return ClosingSSEResponse(messages(), on_close=lambda: hub.unsubscribe(sub))
