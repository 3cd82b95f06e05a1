"""Supervising the data-parallel replicas (kvshare.server.data_parallel): waiting for them to be
ready, noticing one that exits, stops its engine thread or gets stuck, retiring it (SIGTERM, then
SIGKILL, reaped), and draining them all on SIGTERM. FrontendState (kvshare.server.dp_state) is what
the front end's routes, middleware, supervision and shutdown share.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import time

import httpx2

from kvshare.server.dp_proxy import _engine_dead_detail
# The shared state lives in its own module; its names stay importable from here.
from kvshare.server.dp_state import (  # noqa: F401
    POLL_SECONDS, POLL_TIMEOUT_SECONDS, RETIRE_GRACE_SECONDS, STUCK_POLLS, FrontendState, log_task_failure)
from kvshare.server.prefix_update_subscriber import PrefixUpdateSubscriber
from kvshare.server.replica import ReplicaProcess
from kvshare.server.runner import ABORT_GRACE_SECONDS, LoopKeepingServer

logger = logging.getLogger("kvshare.server")

STARTUP_TIMEOUT_SECONDS = 600.0

MONITOR_SECONDS = 0.1  # how often replica processes are checked for an exit

DRAIN_MARGIN_SECONDS = 20.0  # beyond a replica's own drain (--shutdown-timeout + its abort grace)

_KV_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+(\S+)$", re.M)


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



def start_background(state: FrontendState, subscribers: list[PrefixUpdateSubscriber]) -> list[asyncio.Task]:
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
        state.retire(rep.index, signal.SIGKILL)  # its connections close: its requests in flight fail now, not never
        return
    except httpx2.TransportError:
        return  # refused or reset: an exited process is the monitor's to notice
    state.poll_timeouts[rep.index] = 0
    m = _KV_USAGE.search(resp.content)
    if m:
        with contextlib.suppress(ValueError):
            view.kv_usage = float(m.group(1))



class DrainingFrontend(LoopKeepingServer):
    """SIGTERM / Ctrl+C: refuse new requests, SIGTERM every replica, wait for them to drain and
    exit, then stop. A second signal kills the replicas and exits at once."""

    state: FrontendState

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
        self._drain_task.set_name("drain")
        self._drain_task.add_done_callback(log_task_failure)
        # However the drain ends (an error included), the server stops: never a front end that
        # refuses everything forever. Replicas still running are killed on the way out.
        self._drain_task.add_done_callback(lambda _task: setattr(self, "should_exit", True))

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

