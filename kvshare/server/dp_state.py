"""What the data-parallel front end's parts share (kvshare.server.data_parallel): its options and
FrontendState, the state its routes, proxy, middleware, supervision and shutdown read and update.
Its own module, so that the proxy (kvshare.server.dp_proxy) and the supervision
(kvshare.server.dp_supervisor) import it and neither imports the other's importer.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

import httpx2

from kvshare.server.dp_metrics import RouterMetrics
from kvshare.server.replica import ReplicaProcess, offset_endpoint
from kvshare.server.routing import Router
from kvshare.server.settings import ServerConfig

logger = logging.getLogger("kvshare.server")

POLL_SECONDS = 1.0  # how often each replica's /health and KV usage (from its /metrics) are read

# A replica that answers neither /health nor /metrics within POLL_TIMEOUT_SECONDS, STUCK_POLLS
# times in a row, is stuck (stopped, deadlocked, swapping): it is SIGKILLed, which fails its
# requests in flight at once (the upstream client has no read timeout: a generation may be long).
POLL_TIMEOUT_SECONDS = 5.0

STUCK_POLLS = 3

# A replica retired while its process lives (its engine thread stopped) gets SIGTERM, then SIGKILL
# after this long: it has nothing left to drain.
RETIRE_GRACE_SECONDS = 10.0


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
    lora_modules: tuple[str, ...] = ()  # the adapters' names (--lora-modules), which every replica loads

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size {self.size} is invalid: must be >= 1")
        if self.kv_events_endpoint:  # checked now, before any replica starts
            offset_endpoint(self.kv_events_endpoint, 0, "--kv-events-endpoint")
        if self.kv_events_replay_endpoint:
            offset_endpoint(self.kv_events_replay_endpoint, 0, "--kv-events-replay-endpoint")


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

    def retire(self, index: int, sig: int = signal.SIGTERM) -> None:
        """Stop a replica marked dead whose process lives on: `sig` (SIGTERM, or SIGKILL for one
        that is stuck), then SIGKILL after `retire_grace`, and reap it either way (no zombie, no
        process serving nothing)."""
        rep = self.replicas[index]
        if rep.proc is None or rep.exit_code() is not None:
            return
        rep.signal(sig)
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


def log_task_failure(task: asyncio.Task) -> None:
    """Done-callback of the front end's background tasks: one that ends with an exception says so
    (asyncio would only mention it when the task is garbage-collected, if ever)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("data-parallel background task %s failed: %s", task.get_name(), exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
