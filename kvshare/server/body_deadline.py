"""A deadline on request bodies (--request-body-timeout), as plain ASGI in front of everything else.

A client that sends its headers and then trickles, or stops sending, its body would otherwise hold
a connection and a task for as long as it likes (slowloris). Once a request's body has not fully
arrived `timeout` seconds after its headers, the app behind is told the client left (so whatever
waits for the body gives up the way it does on a disconnect) and the client gets a 408 with
`Connection: close`. Reads after the body (waiting for a streaming client's disconnect) have no
deadline.
"""
from __future__ import annotations

import asyncio
import logging

from kvshare.server.errors import APIError

logger = logging.getLogger("kvshare.server")


class BodyDeadlineMiddleware:
    def __init__(self, app, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = timed_out = started = False

        async def bounded_receive():
            nonlocal body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracked_send(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception:
            if not timed_out:
                raise  # (a route that read the "disconnect" may raise; that one is answered below)
        if timed_out and not started:
            logger.info("408: the body of %s %s did not arrive within %gs (--request-body-timeout)",
                        scope["method"], scope["path"], self.timeout)
            err = APIError(408, f"the request body did not arrive within {self.timeout:g}s "
                                f"(--request-body-timeout)", code="request_timeout",
                           headers={"Connection": "close"})
            await err.response()(scope, receive, send)
