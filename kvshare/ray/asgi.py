"""Calling an ASGI app in-process, one request at a time, as an async generator of its response:
the response head ({"status", "headers"}) first, then the body chunks as the app sends them.

Each Ray Serve engine replica runs the same FastAPI app as `kvshare serve` (kvshare.server.app)
this way, so validation, errors, streaming and the API key behave exactly as on one server. The
request body is handed over whole; once the caller stops reading (the client left, and Serve
cancelled the call), the app is told the client disconnected (so the engine aborts the request
and frees its blocks), and is cancelled if it does not finish soon after.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

DISCONNECT_GRACE_SECONDS = 5.0  # for the app to notice the disconnect and abort before it is cancelled


def http_scope(method: str, path: str, query: str, headers: list[tuple[str, str]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode("latin-1"),
            "query_string": query.encode("latin-1"), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def call_asgi(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[dict | bytes]:
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    finished = object()
    task = asyncio.ensure_future(app(http_scope(method, path, query, headers), receive, send))
    task.add_done_callback(lambda _t: messages.put_nowait(finished))
    complete = False
    try:
        while True:
            message = await messages.get()
            if message is finished:
                task.result()  # the app's own exception, if it raised before answering
                raise RuntimeError(f"the app ended {method} {path} without a complete response")
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    return
    finally:
        if not complete:
            disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_SECONDS if not complete else 1.0)
            if not task.done():
                task.cancel()
