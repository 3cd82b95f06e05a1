"""Fan-out of the engine's block events to the live KV view's clients (/kv/events), on the event loop.

The engine thread hands over one batch per engine step (AsyncEngine.watch_kv); each batch is
redacted and serialized once, then queued for every client. A client's queue holds a bounded
number of batches: a slow client loses the oldest ones and its next message says how many
(`dropped`); the engine never waits for anyone. The recorder behind it runs only while at least
one client is connected.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from collections import deque

from kvshare.kvcache.pool_view import HASH_HEX

DEFAULT_QUEUE_BATCHES = 64


class EventRedactor:
    """What a view may show of an event: a tenant's cache_salt only as a keyed hash (stable within
    this process, so a view can still group blocks by tenant; the key never leaves it), token ids
    only when the server logs prompts anyway (--log-prompts)."""

    def __init__(self, show_tokens: bool, key: bytes | None = None) -> None:
        self.show_tokens = show_tokens
        self._key = key if key is not None else os.urandom(16)

    def salt(self, salt: str | None) -> str | None:
        if salt is None:
            return None
        return hmac.new(self._key, salt.encode("utf-8"), hashlib.sha256).hexdigest()[:12]

    def event(self, e: dict) -> dict:
        out = dict(e)
        if "salt" in out:
            out["salt"] = self.salt(out["salt"])
        if "tokens" in out and not self.show_tokens:
            del out["tokens"]
        for k in ("hash", "parent"):
            if out.get(k):
                out[k] = out[k][:HASH_HEX]  # as the snapshot shows them
        return out


class Subscriber:
    """One client's queue of serialized batches: (step, events JSON)."""

    def __init__(self, max_batches: int) -> None:
        self.queue: deque[tuple[int, str]] = deque(maxlen=max_batches)
        self.dropped = 0  # batches lost since the last one delivered
        self._ready = asyncio.Event()

    def put(self, batch: tuple[int, str]) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1  # the deque pushes the oldest out
        self.queue.append(batch)
        self._ready.set()

    async def get(self, timeout: float) -> tuple[int, str, int] | None:
        """(step, events JSON, batches dropped before it), or None after `timeout` seconds idle."""
        if not self.queue:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        step, events = self.queue.popleft()
        dropped, self.dropped = self.dropped, 0
        return step, events, dropped


class KVEventHub:
    def __init__(self, engine, redactor: EventRedactor) -> None:
        self.engine = engine  # the AsyncEngine
        self.redactor = redactor
        self.subscribers: set[Subscriber] = set()
        self._watching: asyncio.Future | None = None  # the recorder being switched on, or on

    async def subscribe(self, max_batches: int = DEFAULT_QUEUE_BATCHES) -> Subscriber:
        """A new client; returns once the recorder runs, so every step from now on reaches it."""
        sub = Subscriber(max_batches)
        self.subscribers.add(sub)
        if self._watching is None:
            self._watching = asyncio.ensure_future(self.engine.watch_kv(self.publish))
        try:
            # Shielded: one client giving up must not cancel the switch-on the others wait for.
            await asyncio.shield(self._watching)
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub not in self.subscribers:
            return
        self.subscribers.discard(sub)
        if not self.subscribers:
            self._watching = None
            self.engine.unwatch_kv()

    def publish(self, step: int, events: list[dict]) -> None:
        if not self.subscribers:
            return  # the recorder is being switched off
        batch = (step, json.dumps([self.redactor.event(e) for e in events], separators=(",", ":")))
        for sub in self.subscribers:
            sub.put(batch)


def sse_message(event: str, data: str, msg_id: int | None = None) -> str:
    head = f"id: {msg_id}\n" if msg_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n"


def step_message(step: int, events_json: str, dropped: int) -> str:
    return sse_message("step", f'{{"step":{step},"dropped":{dropped},"events":{events_json}}}', step)
