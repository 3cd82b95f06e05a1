"""Structured outputs as clients ask for them: OpenAI's `response_format` and vLLM's
`structured_outputs` extra, turned into one StructuredOutputsParams and compiled off the event
loop and off the engine thread, on a bounded pool, within a time limit."""
from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import StructuredOutputsParams
from kvshare.server.errors import APIError


def structured_params(req) -> StructuredOutputsParams | None:
    """The request's constraint, or None; a 400 naming the field when it is malformed."""
    so, rf = req.structured_outputs, req.response_format
    if so is not None and rf is not None and rf.type != "text":
        raise InvalidRequestError("give either response_format or structured_outputs, not both", "structured_outputs")
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise InvalidRequestError("response_format.json_schema is only allowed with type 'json_schema'",
                                      "response_format.json_schema")
        return None
    if rf.type == "json_object":
        if rf.json_schema is not None:
            raise InvalidRequestError("response_format.json_schema is only allowed with type 'json_schema'",
                                      "response_format.json_schema")
        return StructuredOutputsParams(json_object=True, source_field="response_format")
    if rf.json_schema is None:
        raise InvalidRequestError("response_format of type 'json_schema' needs 'json_schema' "
                                  "({\"name\": ..., \"schema\": {...}})", "response_format.json_schema")
    schema = rf.json_schema.schema_
    if schema is None:
        raise InvalidRequestError("response_format.json_schema needs 'schema' (a JSON schema object)",
                                  "response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema, source_field="response_format.json_schema.schema")


class GrammarCompiles:
    """Grammars compiled off the event loop and off the engine thread, on a bounded pool.

    A compile cannot be stopped once it runs, so: at most `max_concurrent` run at once; one per
    grammar (a second request for it waits on the first); a request whose compile has not started
    within the timeout (every slot busy) gets 429 and leaves the queue, one whose compile has not
    finished within the timeout of its start gets 400. A grammar whose compile used more than the
    timeout of CPU time stays refused (its compile finishes in the background and is cached, but
    no request may collect it), remembered by digest for the last REFUSED_KEPT of them. CPU time,
    not wall time: compile threads run at the lowest priority, so on a busy server a quick
    grammar can take long on the clock, and must not be refused for good because of that."""

    REFUSED_KEPT = 4096

    def __init__(self, max_concurrent: int, timeout: float) -> None:
        self.timeout = timeout
        self.max_concurrent = max_concurrent
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="kvshare-grammar",
                                        initializer=_lowest_cpu_priority)
        self._in_flight: dict[bytes, _Compile] = {}
        self._refused: OrderedDict[bytes, None] = OrderedDict()

    async def compile(self, compile_grammar, spec: StructuredOutputsParams) -> None:
        """Compile (or find cached) `spec` so the engine then finds the grammar in the cache."""
        key = hashlib.sha256(repr(spec.cache_key()).encode()).digest()
        if key in self._refused:
            raise self._too_slow(spec)
        job = self._in_flight.get(key)
        if job is None or job.future.cancelled():
            job = self._in_flight[key] = _Compile(self._pool, compile_grammar, spec)
            loop = asyncio.get_running_loop()
            job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._settle, key, job))
        job.waiters += 1
        try:
            await self._wait(job, spec, key)
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.running():
                job.future.cancel()  # still queued and nobody waits for it: it never runs

    async def _wait(self, job: "_Compile", spec: StructuredOutputsParams, key: bytes) -> None:
        waiting = asyncio.wrap_future(job.future)
        try:
            await asyncio.wait_for(asyncio.shield(waiting), self.timeout)
            return self._check_cpu(job, spec)
        except TimeoutError:
            pass
        started = job.started
        if started is None:
            raise APIError(429, f"{spec.source_field}: {self.max_concurrent} grammars were compiling for "
                                f"{self.timeout:g} s (--max-concurrent-grammar-compiles), so this one did not start "
                                f"within --grammar-compile-timeout; retry later", param=spec.source_field,
                           code="grammar_compiles_busy", headers={"Retry-After": "1"})
        remaining = started + self.timeout - time.monotonic()
        try:  # the compile's own time is what the timeout limits, not its wait for a slot
            await asyncio.wait_for(asyncio.shield(waiting), max(remaining, 0))
        except TimeoutError:
            raise self._too_slow(spec) from None  # refused for good only if its CPU time says so (_settle)
        self._check_cpu(job, spec)

    def _check_cpu(self, job: "_Compile", spec: StructuredOutputsParams) -> None:
        if job.future.result() > self.timeout:
            raise self._too_slow(spec)

    def _settle(self, key: bytes, job: "_Compile") -> None:
        if self._in_flight.get(key) is job:
            del self._in_flight[key]
        if not job.future.cancelled() and job.future.exception() is None and job.future.result() > self.timeout:
            self._refuse(key)

    def _refuse(self, key: bytes) -> None:
        self._refused[key] = None
        self._refused.move_to_end(key)
        while len(self._refused) > self.REFUSED_KEPT:
            self._refused.popitem(last=False)

    def _too_slow(self, spec: StructuredOutputsParams) -> InvalidRequestError:
        return InvalidRequestError(f"{spec.source_field}: the {spec.kind} grammar took longer than {self.timeout:g} s "
                                   f"to compile (--grammar-compile-timeout); simplify it", spec.source_field)


def _lowest_cpu_priority() -> None:
    """A compile thread yields the cores to the engine: on Linux a thread has its own nice value.
    At the default priority, two compiles of a large schema on this 2-core machine took the cores
    from the engine's OpenMP threads and made a streaming neighbour's inter-token gaps 5.5x longer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass  # not Linux (the nice value is the process's): compiles run at the server's priority


class _Compile:
    """One grammar's compile on the pool, when it started, and how many requests wait for it."""

    def __init__(self, pool: ThreadPoolExecutor, compile_fn, spec: StructuredOutputsParams) -> None:
        self.started: float | None = None
        self.waiters = 0
        self.future: Future = pool.submit(self._run, compile_fn, spec)

    def _run(self, compile_fn, spec: StructuredOutputsParams) -> float:
        """The compile's CPU time in seconds (llguidance compiles on the calling thread), so one
        that finishes after every waiter left is still judged, and by its own work."""
        self.started = time.monotonic()
        cpu = time.thread_time()
        compile_fn(spec)
        return time.thread_time() - cpu
