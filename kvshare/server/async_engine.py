"""AsyncEngine: one thread owns the LLMEngine; the event loop talks to it through a command queue.

LLMEngine is not thread-safe, so nothing but the engine thread touches it after start(). The
event loop appends "add" and "abort" commands under a condition variable; the engine thread
applies them between steps, steps while there is work, sleeps on the condition when there is
none (bounded waits keep the heartbeat fresh for /ready), and hands each step's outputs back to
the loop with one call_soon_threadsafe. Validation errors raised by add_request travel back
through a concurrent Future, so a bad prompt is still a 400 for the handler that sent it. Reads
of engine state (the live KV view's snapshot, switching its recorder) are "call" commands, run
the same way between steps; while the view listens, each step's block events follow its outputs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from kvshare.engine.kv_view import start_view, stop_view
from kvshare.errors import InvalidRequestError
from kvshare.kvcache.audit import AuditError
from kvshare.lora_request import LoRARequest
from kvshare.model.kernels import openmp
from kvshare.outputs import RequestOutput
from kvshare.sampling_params import SamplingParams
from kvshare.server.errors import EngineDeadError, QueueFullError
from kvshare.server.metrics import EngineSnapshot, ServerMetrics

logger = logging.getLogger("kvshare.server")

IDLE_WAIT_SECONDS = 1.0


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None


@dataclass
class _Add:
    requests: list[EngineRequest]
    arrival: float
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_ids: list[str]
    reason: str
    asked_at_step: int


@dataclass
class _Call:
    """A function to run on the engine thread between steps: reads of engine state (the live KV
    view) that must never overlap a step."""

    fn: Callable[[], object]
    future: concurrent.futures.Future | None  # None: nobody waits for the result


@dataclass
class _Track:
    """Engine-thread bookkeeping for metrics, one per live engine request."""

    prompt_tokens: int
    tokens_seen: int = 0
    last_token_time: float = 0.0


class RequestStream:
    """The outputs of the engine requests behind one HTTP request, in step order."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = set(request_ids)  # engine requests whose final output has not arrived yet
        self.abort_requested = False

    @property
    def engine_done(self) -> bool:
        return not self._open

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.finished:
            self._open.discard(item.request_id)
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Shared:
    """State both threads touch; guarded by AsyncEngine._cond."""

    commands: list = field(default_factory=list)
    pending: int = 0  # engine requests submitted but not yet added to the engine
    stopping: bool = False


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics, max_waiting: int | None = None,
                 retry_after: int = 1) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self._cond = threading.Condition()
        self._shared = _Shared()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._tracks: dict[str, _Track] = {}  # engine thread only
        self._busy = False  # engine thread only
        self._in_hand: list = []  # commands being applied (engine thread), failed too if the loop dies
        # Where each step's block events go while a live KV view listens (engine thread only; the
        # callable itself runs on the event loop).
        self._view_sink: Callable[[int, list[dict]], None] | None = None
        self.snapshot = EngineSnapshot(blocks_total=engine.layout.num_blocks)
        self.heartbeat = time.monotonic()
        # Bumped by the engine thread whenever an add, an abort, a step or the view's recorder may
        # have changed the pool, the requests or what a snapshot shows: a reader of engine state
        # (the KV view's shared snapshot) whose copy has this number still has the current state.
        self.state_version = 0
        self.dead: str | None = None
        # The broken invariant when an audit stopped the engine: {"invariant", "block", "step"},
        # kept so a view opened after the stop can still show it (only these three: the audit's
        # detail can quote a salt, its owners and events name requests).
        self.audit_failure: dict | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Under `kvshare serve` this thread built the engine (and ran its kernels while loading);
        # from here on it only serves the event loop. Its idle OpenMP workers would make libgomp
        # put the engine thread's workers to sleep between parallel regions
        # (openmp.release_openmp_workers; a Ray replica releases where it built the engine).
        openmp.release_openmp_workers()
        self.snapshot = self._take_snapshot()  # before any step: what it started with (a disk tier a restart found)
        self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._shared.stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # the engine thread is done with it: KV event sockets, event log

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat

    def metrics_snapshot(self) -> EngineSnapshot:
        """The latest snapshot with the engine requests submitted but not added yet counted as
        waiting: behind a long step they wait as much as those in the scheduler's queue, and
        /metrics would otherwise show an idle server with a queue."""
        with self._cond:
            return replace(self.snapshot, waiting=self.snapshot.waiting + self._shared.pending)

    # ---- event-loop side ------------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest], arrival: float) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        stream = RequestStream([r.request_id for r in requests])
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._shared.stopping:
                raise EngineDeadError("the server is shutting down")
            queued = self._shared.pending + self.snapshot.waiting
            # Checked and counted under the same lock the engine thread publishes under, so
            # simultaneous arrivals cannot all see room for one. Every prompt of the request
            # counts; one request larger than the limit alone (bounded by
            # --max-sequences-per-request) is taken only into an empty queue, else it could never run.
            adding = len(requests)
            if self.max_waiting is not None and (
                    queued >= self.max_waiting or (queued and queued + adding > self.max_waiting)):
                raise QueueFullError(queued, self.max_waiting, self.retry_after, adding)
            self._shared.pending += len(requests)
            self._shared.commands.append(_Add(requests, arrival, future))
            self._cond.notify()
        for r in requests:
            self._streams[r.request_id] = stream
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The client left while the add was queued: the abort is queued behind it.
            self._abort_ids(stream.request_ids, "client_disconnect")
            self._forget(stream)
            raise
        except BaseException:
            self._forget(stream)
            raise
        return stream

    def abort(self, stream: RequestStream, reason: str) -> None:
        """Abort whatever of the stream is still running; the engine applies it before its next step."""
        if stream.engine_done or stream.abort_requested:
            return
        stream.abort_requested = True
        self._abort_ids(stream.request_ids, reason)

    def abort_all(self, reason: str) -> int:
        streams = {id(s): s for s in self._streams.values()}.values()
        for s in streams:
            self.abort(s, reason)
        return len(streams)

    def _abort_ids(self, request_ids: list[str], reason: str) -> None:
        with self._cond:
            self._shared.commands.append(_Abort(list(request_ids), reason, self.snapshot.step))
            self._cond.notify()

    async def call(self, fn: Callable[[], object]):
        """fn() on the engine thread between two steps, its result (or exception) back here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def read_stopped(self, fn: Callable[[], object], timeout: float = 5.0):
        """fn() on the calling thread, for a dead engine only: once its thread has exited nothing
        else touches the engine, so its last state (where an audit stopped it) can be read."""
        if self.dead is None:
            raise RuntimeError("read_stopped() is for a dead engine; use call()")
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)  # _die is setting the last things
            if self._thread.is_alive():
                raise EngineDeadError(self.dead)
        return fn()

    def post(self, fn: Callable[[], object]) -> None:
        """fn() on the engine thread between two steps, nobody waiting; dropped when the engine
        is gone (then there is nothing left to undo)."""
        try:
            self._queue(_Call(fn, None))
        except EngineDeadError:
            pass

    def _queue(self, cmd: _Call) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        with self._cond:
            if self._shared.stopping:
                raise EngineDeadError("the server is shutting down")
            self._shared.commands.append(cmd)
            self._cond.notify()

    async def watch_kv(self, sink: Callable[[int, list[dict]], None]) -> None:
        """Switch the KV view's recorder on: from the next step on, each step's block events go to
        sink(step, events), called on the event loop. Returns once it is on."""
        def start() -> None:
            start_view(self.engine)
            self._view_sink = sink
            self.state_version += 1  # snapshots show each block's last event from now on

        await self.call(start)

    def unwatch_kv(self) -> None:
        """Switch it off again (queued behind any earlier watch_kv, so the last call wins)."""
        def stop() -> None:
            stop_view(self.engine)
            self._view_sink = None
            self.state_version += 1

        self.post(stop)

    def _forget(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # its handler is gone (disconnect, failed validation)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, reason: str) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.put(EngineDeadError(reason))
        self._streams.clear()

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the server is exiting and nobody is listening

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self.heartbeat = time.monotonic()
                    sh = self._shared
                    if not sh.commands and not self._busy and not sh.stopping:
                        self._cond.wait(IDLE_WAIT_SECONDS)
                        self.heartbeat = time.monotonic()
                    if sh.stopping:
                        return
                    commands, sh.commands = sh.commands, []
                if commands:
                    self._in_hand = commands
                    self._apply(commands)
                    self._in_hand = []
                stepping = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if stepping else []
                if stepping:
                    self.state_version += 1
                self._busy = self.engine.has_unfinished_requests()
                self._publish(outputs)
                if self._view_sink is not None:
                    self._flush_view(stepping)
                with self._cond:
                    self.snapshot = self._take_snapshot()
        except BaseException as e:  # a bug in a step: fail loudly, never hang the clients
            logger.exception("engine loop failed")  # the whole report, audit detail included: the log only
            # The reason reaches clients (/health, /ready, every 503): never the exception's text,
            # which can quote a salt, a prompt or a request id (a BlockPoolError's does).
            reason = f"{type(e).__name__}; the engine failed, details are in the server log"
            if isinstance(e, AuditError):
                self.audit_failure = self._audit_verdict(e)
                # The redacted verdict only.
                f = self.audit_failure
                reason = (f"AuditError: invariant '{f['invariant']}' violated at step {f['step']}"
                          + (f" on block {f['block']}" if f["block"] is not None else "") + " (details in the server log)")
            self._flush_view_on_failure(e)
            self._die(reason)

    def _apply(self, commands: list) -> None:
        added = 0
        for cmd in commands:
            if isinstance(cmd, _Add):
                added += len(cmd.requests)
                self._add(cmd)
            elif isinstance(cmd, _Call):
                self._call(cmd)
            else:
                self._abort(cmd)
        if added or any(isinstance(cmd, _Abort) for cmd in commands):
            self.state_version += 1
        with self._cond:
            self._shared.pending -= added
            self.snapshot = self._take_snapshot()

    def _add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        added: list[str] = []
        try:
            for r in cmd.requests:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, arrival_time=cmd.arrival,
                                        lora_request=r.lora_request)
                added.append(r.request_id)
        except BaseException as e:
            if added:
                self.engine.abort_request(added)  # all of the HTTP request's prompts, or none
            if isinstance(e, InvalidRequestError):
                e.prompt_index = len(added)  # which of several prompts was refused, for the message
            cmd.future.set_exception(e)
            return
        for r in cmd.requests:
            self._tracks[r.request_id] = _Track(prompt_tokens=len(r.prompt_token_ids))
        cmd.future.set_result(None)

    @staticmethod
    def _call(cmd: _Call) -> None:
        if cmd.future is None:
            cmd.fn()
            return
        if not cmd.future.set_running_or_notify_cancel():
            return  # the caller left
        try:
            result = cmd.fn()
        except Exception as e:
            cmd.future.set_exception(e)
        else:
            cmd.future.set_result(result)

    def _flush_view(self, stepped: bool) -> None:
        """One batch per loop turn: the step's block events, with what happened between steps
        (aborts) in front of them; the audit's verdict when auditing (a step whose audit failed
        raised instead of getting here)."""
        engine = self.engine
        events = engine.take_view_events() or []
        if stepped and engine.audit_checks is not None:
            events.append({"ev": "audit", "step": engine.step_count, "ok": True, "checks": engine.audit_checks})
        if stepped or events:
            self._call_in_loop(self._view_sink, engine.step_count, events)

    def _audit_verdict(self, error: AuditError) -> dict:
        """What a view may know of a failed audit: the invariant, the block, the step."""
        step = error.step if error.step is not None else self.engine.step_count
        return {"invariant": error.invariant, "block": error.block, "step": step}

    def _flush_view_on_failure(self, error: BaseException) -> None:
        """The events up to a failure, and the broken invariant when the audit failed, so a view
        shows why the engine stopped (only the invariant's name and block: a detail can quote
        a salt)."""
        events = self.engine.take_view_events() if self._view_sink is not None else None
        if events is None:
            return
        if isinstance(error, AuditError):
            events.append({"ev": "audit", "ok": False, **self._audit_verdict(error)})
        self._call_in_loop(self._view_sink, self.engine.step_count, events)

    def _abort(self, cmd: _Abort) -> None:
        live = self.engine.unfinished(cmd.request_ids)
        if live:
            self.engine.abort_request(live)  # the engine's one release path
            self.metrics.on_abort(cmd.reason, self.engine.step_count - cmd.asked_at_step)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            tr = self._tracks.get(out.request_id)
            if tr is None:
                continue
            n_tokens = sum(len(c.token_ids) for c in out.outputs)
            if n_tokens > tr.tokens_seen:
                first = tr.tokens_seen == 0
                ttft = out.metrics.time_to_first_token if first and out.metrics is not None else None
                itl = None if first else now - tr.last_token_time
                self.metrics.on_tokens(tr.prompt_tokens if first else 0, n_tokens - tr.tokens_seen, ttft, itl)
                tr.tokens_seen, tr.last_token_time = n_tokens, now
            if out.finished:
                m = out.metrics
                e2e = m.finished_time - m.arrival_time if m is not None and m.finished_time is not None else None
                self.metrics.on_finished(request_finish_reason(out), e2e)
                del self._tracks[out.request_id]
        if outputs:
            self._call_in_loop(self._deliver, outputs)

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(**asdict(self.engine.status()))

    def _die(self, reason: str) -> None:
        self.dead = reason
        with self._cond:
            commands, self._shared.commands = self._shared.commands, []
        for cmd in self._in_hand + commands:
            fut = getattr(cmd, "future", None)
            if fut is None or fut.done():
                continue
            if fut.running() or fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(reason))
        self._call_in_loop(self._fail_all, reason)


def request_finish_reason(out: RequestOutput) -> str:
    """One reason per request (vLLM's label): abort if any choice aborted, else timeout, else
    length, else stop."""
    reasons = {c.finish_reason for c in out.outputs}
    for r in ("abort", "timeout", "length"):
        if r in reasons:
            return r
    return "stop"
