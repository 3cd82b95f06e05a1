"""Running the app under uvicorn, with a shutdown that drains instead of dropping requests.

SIGTERM (or Ctrl+C) flips the server to draining: /v1/ answers 503 and /ready fails, requests
already inside run to completion for up to --shutdown-timeout seconds, whatever is left is then
aborted (its clients get finish_reason "abort"), and the process exits 0. A second signal exits
at once.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from kvshare.server.app import build_app
from kvshare.server.state import ServerState

logger = logging.getLogger("kvshare.server")

ABORT_GRACE_SECONDS = 10.0  # for aborted requests to send their last bytes


class LoopKeepingServer(uvicorn.Server):
    """A uvicorn server that keeps its event loop, so that a signal handler (which runs outside
    it) can schedule a drain on it. `state` is what the drain reads; shared by `kvshare serve`
    and the data-parallel front end."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


class DrainingServer(LoopKeepingServer):
    state: ServerState

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and a
        # re-raised SIGTERM would end the process with -15 instead of a clean 0.
        if self.state.draining or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        st = self.state
        timeout = st.config.shutdown_timeout
        logger.info("shutting down: %d request(s) in flight, waiting up to %.0fs", st.inflight, timeout)
        deadline = loop.time() + timeout
        while st.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if st.inflight > 0:
            aborted = st.engine.abort_all("shutdown")
            logger.warning("shutdown timeout: aborted %d request(s)", aborted)
            grace = loop.time() + ABORT_GRACE_SECONDS
            while st.inflight > 0 and loop.time() < grace:
                await asyncio.sleep(0.05)
        self.should_exit = True


def serve(state: ServerState) -> None:
    cfg = state.config
    logger.info("%s", cfg.describe_auth())
    config = uvicorn.Config(
        build_app(state), host=cfg.host, port=cfg.port, log_config=None, log_level=cfg.log_level,
        access_log=cfg.access_log, timeout_graceful_shutdown=5, lifespan="on",
        limit_concurrency=cfg.limit_concurrency, timeout_keep_alive=cfg.timeout_keep_alive,
    )
    # An inherited socket (data-parallel replica) is bound already; uvicorn listens on it.
    sockets = None
    if cfg.listen_fd is not None:
        sockets = [socket.socket(fileno=cfg.listen_fd)]
        host, port = sockets[0].getsockname()[:2]
        # uvicorn says where it runs only for sockets it binds itself.
        logger.info("serving http://%s:%d (socket fd %d from the data-parallel front end)", host, port, cfg.listen_fd)
    DrainingServer(config, state).run(sockets=sockets)
